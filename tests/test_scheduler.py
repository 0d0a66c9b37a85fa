"""The scheduler driven directly, without a model: admission into slots and blocks, prompts in
chunks under the step's token budget, preemption when blocks run out, prefix-cache hits, and what
a step's output does to its sequences (update_from_output, advance)."""

from __future__ import annotations

from types import SimpleNamespace

from neuron.engine.block_manager import BlockManager
from neuron.engine.sampling import SequenceSampler
from neuron.engine.sampling_params import SamplingParams
from neuron.engine.scheduler import Scheduler
from neuron.engine.sequence import Sequence, Status


def seq(tokens, rid: str = "r", max_tokens: int = 16, images: list | None = None) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens)
    return Sequence(rid, list(tokens), params, SequenceSampler(params, list(tokens), 1000), max_tokens,
                    images=images or [])


def scheduler(slots: int = 4, budget: int = 64, chunk: int = 64, blocks: int = 64, block_size: int = 4,
              caching: bool = True) -> Scheduler:
    return Scheduler(max_num_seqs=slots, max_num_batched_tokens=budget, prefill_chunk=chunk,
                     blocks=BlockManager(blocks, block_size, caching))


def run(sched: Scheduler, tokens: dict[str, int] | None = None) -> list:
    """One step: schedule, mark it run, and append a token (7 unless `tokens` names one) to each
    sequence the step samples."""
    batch = sched.schedule()
    rows, _ = sched.update_from_output(batch)
    for i in rows:
        sched.advance(batch[i].seq, (tokens or {}).get(batch[i].seq.request_id, 7))
    return batch


def test_admission_stops_at_the_free_slots_first_come_first_served():
    sched = scheduler(slots=2)
    a, b, c = seq([1, 2], "a"), seq([3, 4], "b"), seq([5, 6], "c")
    for s in (a, b, c):
        sched.add(s)
    batch = run(sched)
    assert [s.seq for s in batch] == [a, b]
    assert {a.slot, b.slot} == {0, 1} and c.slot is None and list(sched.waiting) == [c]
    freed = a.slot
    sched.finish(a, "stop")
    assert [s.seq for s in sched.schedule()] == [b, c] and c.slot == freed  # a's slot, handed on


def test_a_long_prompt_is_chunked_under_the_budget_beside_decodes():
    sched = scheduler(budget=8, chunk=6)
    short, long = seq([1, 2, 3], "short"), seq(range(10, 30), "long")
    sched.add(short)
    sched.add(long)
    batch = run(sched)
    assert [(s.seq, s.offset, len(s.token_ids)) for s in batch] == [(short, 0, 3), (long, 0, 5)]  # budget 8
    batch = run(sched)
    assert [(s.seq, s.offset, len(s.token_ids)) for s in batch] == [(short, 3, 1), (long, 5, 6)]  # chunk 6
    assert not batch[1].completes_prompt and long.output_token_ids == []
    while not long.output_token_ids:
        batch = run(sched)
    assert long.num_computed == 20 and long.output_token_ids == [7]


def test_update_from_output_samples_completed_prompts_and_retires_scored_ones():
    sched = scheduler(chunk=4)
    scored, chunked, whole = seq([1, 2, 3], "scored", max_tokens=0), seq(range(10, 16), "chunked"), seq([4, 5], "whole")
    for s in (scored, chunked, whole):
        sched.add(s)
    batch = sched.schedule()
    assert [s.seq for s in batch] == [scored, chunked, whole]
    rows, retired = sched.update_from_output(batch)
    assert rows == [2] and retired == [scored]  # chunked has two prompt tokens left
    assert scored.status is Status.FINISHED and scored.finish_reason == "length" and scored.slot is None
    assert [s.num_computed for s in (chunked, whole)] == [4, 2]
    assert sched.advance(whole, 9) and whole.output_token_ids == [9] and whole.pending() == [9]


def test_an_image_prompt_is_chunked_like_any_beside_other_admissions():
    sched = scheduler(budget=4, chunk=2, caching=False)
    imaged, after = seq(range(1, 11), "imaged", images=[image(6)]), seq([20, 21], "after")
    sched.add(imaged)
    sched.add(after)
    batch = run(sched)
    assert [(s.seq, s.offset, len(s.token_ids), s.fresh) for s in batch] == [(imaged, 0, 2, True), (after, 0, 2, True)]
    batch = run(sched)
    assert [(s.seq, s.offset, len(s.token_ids), s.fresh) for s in batch] == [(after, 2, 1, False),
                                                                              (imaged, 2, 2, False)]


def test_a_step_carries_no_more_image_bytes_than_fit_its_line():
    """Images travel in the first step of their sequence: one that would pass the bound waits a
    step (a later, smaller one may go first); a sequence alone always goes."""
    sched = Scheduler(max_num_seqs=4, max_num_batched_tokens=64, prefill_chunk=64,
                      blocks=BlockManager(64, 4, False), max_image_bytes=lambda: 10)
    first, second, third = (seq([1, 2, 3], name, images=[image(size)]) for name, size in
                            (("first", 6), ("second", 6), ("third", 3)))
    for s in (first, second, third):
        sched.add(s)
    assert [s.seq for s in run(sched)] == [first, third]
    assert [s.seq for s in run(sched) if s.fresh] == [second]
    big = seq([4, 5], "big", images=[image(6), image(6)])
    sched.add(big)
    assert [s.seq for s in run(sched) if s.fresh] == [big]


def image(size: int) -> SimpleNamespace:
    """What the scheduler reads of an image: its encoded URI's length."""
    return SimpleNamespace(uri="d" * size)


def test_prefix_hits_skip_the_cached_blocks():
    sched = scheduler(block_size=4)
    first = seq(range(1, 11), "first")
    sched.add(first)
    run(sched)
    sched.finish(first, "stop")
    again = seq(range(1, 11), "again")
    sched.add(again)
    [step] = sched.schedule()
    assert (step.offset, step.token_ids) == (8, [9, 10])  # two full blocks of 4 from the cache
    assert (sched.prefix_cache_queries, sched.prefix_cache_hits) == (20, 8)


def test_decode_out_of_blocks_preempts_the_newest():
    sched = Scheduler(max_num_seqs=4, max_num_batched_tokens=64, prefill_chunk=64, blocks=BlockManager(4, 2))
    old, new = seq([1, 2, 3, 4], "old"), seq([5, 6, 7], "new")
    sched.add(old)
    sched.add(new)
    batch = sched.schedule()
    assert [s.seq for s in batch] == [old, new] and all(s.fresh for s in batch)
    assert sched.update_from_output(batch) == ([0, 1], [])
    sched.advance(old, 10)
    sched.advance(new, 11)
    batch = sched.schedule()  # old needs a third block: none free, so `new` gives its blocks back
    assert [s.seq for s in batch] == [old]
    assert batch[0].new_blocks and not batch[0].fresh
    assert new.status is Status.WAITING and new.block_table == [] and new.slot is None
    assert list(sched.waiting) == [new] and sched.num_preemptions == 1
    sched.update_from_output(batch)
    sched.finish(old, "stop")
    batch = sched.schedule()  # recomputed from a fresh table: its own cached first block, then the rest
    assert batch[0].seq is new and batch[0].fresh
    assert (batch[0].offset, batch[0].token_ids, len(batch[0].new_blocks)) == (2, [7, 11], 2)


def test_a_block_being_computed_is_waited_for_not_computed_twice():
    sched = Scheduler(max_num_seqs=4, max_num_batched_tokens=64, prefill_chunk=64, blocks=BlockManager(16, 4))
    prompt = list(range(1, 11))  # two full blocks of 4 and a partial one
    a, b, other = seq(prompt, "a"), seq(prompt, "b"), seq([50, 51, 52], "other")
    for s in (a, b, other):
        sched.add(s)
    batch = sched.schedule()
    assert [s.seq for s in batch] == [a, other]  # b waits for a's blocks; the request behind it does not
    assert list(sched.waiting) == [b]
    sched.update_from_output(batch)
    sched.advance(a, 99)
    sched.advance(other, 98)
    batch = sched.schedule()
    assert [(s.seq, s.offset, s.token_ids) for s in batch] == [(a, 10, [99]), (other, 3, [98]), (b, 8, [9, 10])]
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert (sched.prefix_cache_queries, sched.prefix_cache_hits) == (23, 8)


def test_a_request_whose_adapter_finds_no_slot_waits_and_swaps_in_lru(monkeypatch):
    """Two adapter slots, three adapters: the third adapter's request waits (the base model's
    request behind it goes on); once one adapter's requests end, its slot is reloaded with the
    waiting adapter, least recently used first, and the loads are queued for the engine."""
    from neuron.engine import lora

    monkeypatch.setattr(lora.PeftAdapter, "open", staticmethod(lambda path, base, rank: SimpleNamespace(rank=4)))
    slots = lora.LoraSlots(2, 8, {"hidden_size": 64})
    x, y, z = (slots.register(name, f"/adapters/{name}") for name in "xyz")
    sched = scheduler(slots=4)
    sched.loras = slots
    a, b, c, d = seq([1, 2], "a"), seq([3, 4], "b"), seq([5, 6], "c"), seq([7, 8], "d")
    a.lora, b.lora, c.lora = x, y, z
    for s in (a, b, c, d):
        sched.add(s)
    assert [s.seq for s in run(sched)] == [a, b, d]
    assert list(sched.waiting) == [c] and c.lora_slot is None
    loaded = []
    ranks = SimpleNamespace(load_lora=lambda slot, lora_id, path: loaded.append((slot, path)))
    slots.fill(ranks)
    assert loaded == [(a.lora_slot, "/adapters/x"), (b.lora_slot, "/adapters/y")]
    sched.finish(b, "stop")  # y's slot is idle; x was used less recently than y
    sched.finish(a, "stop")
    run(sched)
    assert c.lora_slot == 0 and slots.resident() == ["z", "y"]
    slots.fill(ranks)
    assert loaded[2:] == [(0, "/adapters/z")]


def test_a_resting_adapter_leaves_the_ranks_only_while_no_request_uses_it(monkeypatch):
    """`rest` (a request's keep_alive ran out) drops an adapter's weights from the ranks at the next
    step unless a sequence holds its slot then; it stays served, comes back as a new loading (its
    prefix-cache keys change), and its next request loads it again from its folder."""
    from neuron.engine import lora

    monkeypatch.setattr(lora.PeftAdapter, "open", staticmethod(lambda path, base, rank: SimpleNamespace(rank=4)))
    slots = lora.LoraSlots(2, 8, {"hidden_size": 64})
    x = slots.register("x", "/adapters/x")
    loaded, forgotten = [], []
    ranks = SimpleNamespace(load_lora=lambda slot, lora_id, path: loaded.append((slot, lora_id, path)),
                            forget_lora=forgotten.append)
    a = seq([1, 2], "a")
    a.lora = x
    assert slots.acquire(a)
    slots.fill(ranks)
    first = x.lora_id
    slots.rest("x")
    slots.forget(ranks)  # a still runs on it: it stays, and the rest is dropped
    assert forgotten == [] and slots.resident() == ["x"] and not slots.rests and not x.resting
    slots.release(a)
    slots.rest("x")
    slots.rest("x")
    slots.rest("unknown")
    slots.forget(ranks)
    assert forgotten == [first] and slots.resident() == [] and x.resting and x.lora_id != first
    assert slots.adapters == {"x": x} and not slots.forgets
    b = seq([3, 4], "b")
    b.lora = x
    assert slots.acquire(b) and not x.resting
    slots.fill(ranks)
    assert loaded[-1] == (b.lora_slot, x.lora_id, "/adapters/x") and x.cache_key(None) != lora.Adapter(
        "x", "/adapters/x", 4, first).cache_key(None)


def test_an_encoders_prompts_run_whole_and_wait_for_a_step_they_fit():
    """With `whole_prompts` (an encoder's), a prompt is never cut: one that does not fit what is
    left of the budget waits for the next step, and the prompts after it wait behind it."""
    sched = Scheduler(max_num_seqs=4, max_num_batched_tokens=10, prefill_chunk=4, blocks=BlockManager(64, 4, False),
                      whole_prompts=True)
    a, b, c = seq(range(1, 7), "a", max_tokens=0), seq(range(10, 17), "b", max_tokens=0), seq([20, 21], "c", 0)
    for s in (a, b, c):
        sched.add(s)
    batch = run(sched)
    assert [(s.seq, s.offset, len(s.token_ids)) for s in batch] == [(a, 0, 6)]  # past the chunk size; b waits
    assert b.slot is None and list(sched.waiting) == [b, c]
    batch = run(sched)
    assert [(s.seq, s.offset, len(s.token_ids)) for s in batch] == [(b, 0, 7), (c, 0, 2)]
    assert all(s.completes_prompt for s in batch) and not sched.has_work()
