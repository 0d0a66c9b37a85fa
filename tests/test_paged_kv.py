"""Paged KV cache: the leader's block manager, the ranks' block tables, prefix caching, preemption,
and memory that follows real sequence lengths. Outputs are checked against transformers."""

from __future__ import annotations

import json

import pytest
from checkpoints import reference_greedy

from neuron import LLM, SamplingParams
from neuron.engine.block_manager import BlockManager, chain_hash
from neuron.engine.sequence import Sequence
from neuron.errors import ConfigError
from neuron.models.inputs import StepRejected
from neuron.step import SeqStep
from neuron.worker.step_input import BlockTables


def seq(tokens: list[int], rid: str = "r") -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(), None, 16)


def computed(bm: BlockManager, s: Sequence) -> None:
    """As after a step that ran all of the sequence's tokens."""
    s.num_computed = s.num_tokens
    bm.cache_computed(s)


# ---- block manager ----


def test_allocate_and_release_plain_blocks():
    bm = BlockManager(8, 4)
    a = seq(range(10))
    assert bm.allocate(a)
    assert len(a.block_table) == 3 and bm.num_free == 5
    assert [bm.blocks[b].ref_count for b in a.block_table] == [1, 1, 1]
    bm.release(a)
    assert a.block_table == [] and bm.num_free == 8 and not bm.evictable  # nothing computed, nothing cached


def test_out_of_blocks_admission_changes_nothing():
    bm = BlockManager(4, 4)
    a, b = seq(range(12), "a"), seq(range(100, 108), "b")
    assert bm.allocate(a)
    assert not bm.allocate(b)  # needs 2, 1 free
    assert b.block_table == [] and bm.num_free == 1
    bm.release(a)
    assert bm.allocate(b)


def test_freed_blocks_go_out_again_before_untouched_ones():
    """A CPU pool's pages become resident as blocks are first written: a server whose requests come
    and go one after another keeps reusing the same few blocks instead of walking the whole pool."""
    bm = BlockManager(1000, 4, enable_prefix_caching=False)
    touched: set[int] = set()
    for i in range(200):
        s = seq(range(i, i + 10), f"r{i}")
        assert bm.allocate(s)
        bm.append(s)
        touched.update(s.block_table)
        bm.release(s)
    assert touched == {0, 1, 2}  # three blocks a request, the lowest ids, every time
    a, b = seq(range(10), "a"), seq(range(20), "b")
    assert bm.allocate(a) and bm.allocate(b)
    assert sorted(a.block_table + b.block_table) == list(range(8))  # then on in id order
    bm.release(a)
    c = seq(range(5), "c")
    assert bm.allocate(c) and set(c.block_table) <= {0, 1, 2}  # what a released

def test_shared_prefix_is_reused_with_refcounts():
    bm = BlockManager(16, 4)
    a = seq([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], "a")
    assert bm.allocate(a)
    computed(bm, a)
    assert a.num_cached_blocks == 2  # the third block is partial: never shared
    b = seq([1, 2, 3, 4, 5, 6, 7, 8, 99, 98], "b")
    assert bm.allocate(b)
    assert b.num_cached_blocks == 2 and b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] not in a.block_table
    assert [bm.blocks[x].ref_count for x in b.block_table] == [2, 2, 1]
    bm.release(a)
    assert [bm.blocks[x].ref_count for x in b.block_table] == [1, 1, 1]


def test_a_fully_cached_prompt_still_computes_its_last_token():
    bm = BlockManager(16, 4)
    a = seq(range(8), "a")
    assert bm.allocate(a)
    computed(bm, a)
    again = seq(range(8), "again")
    assert bm.allocate(again)
    assert again.num_cached_blocks == 1  # block 2 holds the last token, whose logits are needed


def test_hash_chain_names_the_whole_prefix():
    assert chain_hash(None, [1, 2]) != chain_hash(chain_hash(None, [0, 0]), [1, 2])
    bm = BlockManager(16, 2)
    a = seq([1, 2, 3, 4, 0], "a")
    assert bm.allocate(a)
    computed(bm, a)
    b = seq([9, 9, 3, 4, 0], "b")  # same second block, different first: no hit at all
    assert bm.allocate(b) and b.num_cached_blocks == 0


def test_released_cached_blocks_are_evicted_least_recently_used_first():
    bm = BlockManager(6, 2)
    a = seq([1, 2, 3, 4, 5], "a")
    assert bm.allocate(a)
    computed(bm, a)
    head, tail, partial = a.block_table
    bm.release(a)
    assert list(bm.evictable) == [tail, head] and partial in bm.free
    assert bm.num_free == 6
    filler = seq(range(100, 110), "filler")  # 5 blocks: the 4 plain free ones, then evicts `tail`
    assert bm.allocate(filler)
    assert tail in filler.block_table and head not in filler.block_table
    assert bm.blocks[tail].hash is None and bm.blocks[head].hash is not None
    b = seq([1, 2, 3, 4, 5], "b")
    assert not bm.allocate(b)  # 3 blocks needed, the cached head and 1 free
    bm.release(filler)
    assert bm.allocate(b)
    assert b.block_table[0] == head and b.num_cached_blocks == 1


def test_generated_tokens_fill_cacheable_blocks():
    bm = BlockManager(8, 2)
    a = seq([1, 2, 3], "a")
    assert bm.allocate(a)
    computed(bm, a)
    a.output_token_ids += [4]
    assert bm.can_append(a)
    bm.append(a)
    a.output_token_ids += [5]  # token 4 now computed with the step that samples 5
    a.num_computed = 4
    bm.cache_computed(a)
    assert a.num_cached_blocks == 2
    b = seq([1, 2, 3, 4, 7], "b")
    assert bm.allocate(b) and b.num_cached_blocks == 2


def test_prefix_caching_off():
    bm = BlockManager(8, 2, enable_prefix_caching=False)
    a = seq([1, 2, 3, 4, 5], "a")
    assert bm.allocate(a)
    computed(bm, a)
    bm.release(a)
    assert not bm.cached and not bm.evictable
    b = seq([1, 2, 3, 4, 5], "b")
    assert bm.allocate(b) and b.num_cached_blocks == 0


# ---- a rank's cache ----


def _cache(paged: bool = True) -> BlockTables:
    """A rank's block tables (the runner's; the pools are the model's and play no part here)."""
    import torch

    return BlockTables(slots=2, num_blocks=8, block_size=4, max_len=16, device=torch.device("cpu"), paged=paged)


@pytest.mark.parametrize("step, message", [
    ([SeqStep(0, [1], 0, [8], True)], "outside the pool"),
    ([SeqStep(0, [1], 0)], "0 blocks"),
    ([SeqStep(0, [1] * 5, 0, [1], True)], "only 1 blocks"),
    ([SeqStep(0, [1], 2, [1], True)], "whole blocks"),
    ([SeqStep(0, [1], 4, [1], True)], "only 1 blocks"),
    ([SeqStep(0, [1, 2], 0, [3, 3], True)], "twice"),
    ([SeqStep(0, [1], 0, [2], True), SeqStep(1, [1], 0, [2], True)], "written by two"),
    ([SeqStep(0, [1] * 17, 0, [0, 1, 2, 3, 4], True)], "max_model_len"),
])
def test_rank_refuses_steps_outside_its_blocks(step, message):
    with pytest.raises(StepRejected, match=message):
        _cache().check(step, vocab_size=10)


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "gather"])
def test_rank_tables_grow_by_the_blocks_a_step_carries(paged):
    cache = _cache(paged)
    for s in ([SeqStep(0, [1, 2, 3], 0, [5], True)], [SeqStep(0, [4], 3)], [SeqStep(0, [5], 4, [2])]):
        cache.check(s, vocab_size=10)
        batch = cache.prepare(s)
        cache.commit(batch)
    assert cache.tables[0] == [5, 2] and cache.filled[0] == 5
    if paged:  # the host mirror of the table, and the last step's token written at block 2's first row
        assert cache.table_array[0, :2].tolist() == [5, 2]
        assert batch.paged.slot_mapping.tolist() == [8] and batch.paged.block_tables.tolist() == [[5, 2]]
    else:
        assert cache.slot_rows[0, :5].tolist() == [20, 21, 22, 23, 8]
    with pytest.raises(StepRejected, match="only 5 positions filled"):
        cache.check([SeqStep(0, [1], 6)], vocab_size=10)
    cache.check([SeqStep(1, [7], 4, [5, 6], True)], vocab_size=10)  # a cached first block, shared
    cache.clear([0])
    assert cache.tables[0] == [] and cache.filled[0] == 0


def test_a_paged_step_crosses_to_the_device_in_one_copy(monkeypatch):
    """Metadata, token ids and positions of a mixed step travel packed through the tables' staging:
    one send per step, and nothing else sends host data (on CUDA that is one pinned copy)."""
    import torch

    from neuron.utils.device import Staging
    from neuron.worker import step_input

    cache = _cache()
    sends, send = [], Staging.send
    monkeypatch.setattr(Staging, "send", lambda self, arrays: (sends.append(len(arrays)), send(self, arrays))[1])
    monkeypatch.setattr(step_input, "to_device", lambda *a, **k: pytest.fail("a second host-to-device copy"))
    step = [SeqStep(0, [1, 2, 3, 4, 5], 0, [5, 2], True), SeqStep(1, [9], 0, [3], True)]
    cache.check(step, vocab_size=10)
    batch = cache.prepare(step)
    assert sends == [6]
    assert batch.token_ids.tolist() == [1, 2, 3, 4, 5, 9] and batch.token_ids.dtype == torch.long
    assert batch.positions.tolist() == [0, 1, 2, 3, 4, 0]
    assert batch.paged.slot_mapping.tolist() == [20, 21, 22, 23, 8, 12]
    assert batch.paged.query_start.tolist() == [0, 5, 6] and batch.paged.kv_lens.tolist() == [5, 1]
    assert batch.paged.block_tables.tolist() == [[5, 2], [3, 0]]


@pytest.mark.parametrize("decoding", [[0], [1], [0, 1], [1, 0]])
def test_a_cpu_decode_step_is_described_as_the_general_path_describes_it(decoding, monkeypatch):
    """A CPU step of one token per sequence takes a short path (BlockTables._cpu_decode_step); its
    tensors equal build_step's, values, dtypes and shapes, on one sequence and several, in either
    order, at a block's end and a longer table's."""
    from neuron.layers.paged_attention import build_step
    from neuron.worker import step_input

    cache = _cache()
    for s in ([SeqStep(0, [1, 2, 3, 4, 5], 0, [5, 2], True)], [SeqStep(1, [6, 7, 8], 0, [3], True)]):
        cache.commit(cache.prepare(s))
    offsets = {0: 5, 1: 3}  # slot 0 writes into its second block, slot 1 the last row of its first
    step = [SeqStep(slot, [40 + slot], offsets[slot]) for slot in decoding]
    cache.check(step, vocab_size=50)
    with monkeypatch.context() as m:
        m.setattr(step_input, "build_step", lambda *a, **k: pytest.fail("the general path"))
        batch = cache.prepare(step)
    meta, ids, positions = build_step(cache.table_array[decoding], [offsets[i] for i in decoding], [1] * len(step),
                                      cache.block_size, cache.staging, [40 + i for i in decoding])
    got = [batch.token_ids, batch.positions, batch.paged.slot_mapping, batch.paged.query_start, batch.paged.kv_lens,
           batch.paged.block_tables]
    want = [ids, positions, meta.slot_mapping, meta.query_start, meta.kv_lens, meta.block_tables]
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.tolist() == w.tolist()
    assert (batch.paged.max_query_len, batch.paged.max_kv_len) == (meta.max_query_len, meta.max_kv_len)
    assert batch.all_decode


@pytest.mark.gpu
def test_a_cuda_step_makes_one_host_to_device_copy():
    import torch

    cache = BlockTables(slots=2, num_blocks=8, block_size=4, max_len=16, device=torch.device("cuda"), paged=True)
    step = [SeqStep(0, [1, 2, 3, 4, 5], 0, [5, 2], True), SeqStep(1, [9], 0, [3], True)]
    batch = cache.prepare(step)
    assert cache.staging.copies == 1
    assert batch.paged.slot_mapping.tolist() == [20, 21, 22, 23, 8, 12]


# ---- end to end (transformers is the oracle) ----

SYSTEM = [(7 * i + 3) % 290 + 1 for i in range(45)]  # no 0: the oracle's pad_token_id
NEW = 6


def _greedy(max_tokens: int = NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=3, ignore_eos=True)


def _assert_equal(got, ref_tokens, ref_logprobs, tol=1e-3):
    assert got.token_ids == ref_tokens
    for step, lp in enumerate(got.logprobs):
        for tid, value in lp.items():
            assert abs(value - ref_logprobs[step][tid].item()) <= tol


def _record_steps(llm: LLM) -> list[list[SeqStep]]:
    executor, steps = llm.engine.executor, []
    original = executor.step

    def step(seqs):
        steps.append(list(seqs))
        return original(seqs)

    executor.step = step
    return steps


def _block_bytes(checkpoint, tp: int, block_size: int) -> int:
    c = json.loads((checkpoint / "config.json").read_text())
    kv_heads = max(1, c["num_key_value_heads"] // tp)
    return 2 * c["num_hidden_layers"] * kv_heads * c["head_dim"] * block_size * 4


# Both ways attention reads the cache: blocks read in place from one flat step (the default; the
# C++ kernel on CPU), or context rows gathered out of the pool (the reference path, NEURON_ATTENTION=gather).
ATTENTION = ["gather", "paged"]


@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_shared_system_prompt_prefills_only_the_tail(odd_checkpoint, tp, attention, monkeypatch):
    monkeypatch.setenv("NEURON_ATTENTION", attention)
    first, second = SYSTEM + [11, 12, 13], SYSTEM + [21, 22, 23, 24, 25]
    with LLM(str(odd_checkpoint), tensor_parallel_size=tp, device="cpu", dtype="float32", block_size=8) as llm:
        llm.generate({"prompt_token_ids": first}, _greedy())
        assert llm.engine.prefix_cache_counts() == (len(first), 0)
        steps = _record_steps(llm)
        out = llm.generate({"prompt_token_ids": second}, _greedy())[0].outputs[0]
        queries, hits = llm.engine.prefix_cache_counts()
    cached = 40  # the system prompt's 5 full blocks of 8
    assert (queries, hits) == (len(first) + len(second), cached)
    sent = [t for step in steps for s in step for t in s.token_ids]
    assert len(sent) == len(second) - cached + NEW - 1
    assert steps[0][0].fresh and steps[0][0].offset == cached and len(steps[0][0].new_blocks) == 7
    assert all(len(s.new_blocks) <= 1 for step in steps[1:] for s in step)
    _assert_equal(out, *reference_greedy(odd_checkpoint, second, NEW))
    with LLM(str(odd_checkpoint), tensor_parallel_size=tp, device="cpu", dtype="float32", block_size=8,
             enable_prefix_caching=False) as llm:
        plain = llm.generate({"prompt_token_ids": second}, _greedy())[0].outputs[0]
        assert llm.engine.prefix_cache_counts() == (0, 0)
    assert plain.token_ids == out.token_ids
    for a, b in zip(plain.logprobs, out.logprobs):
        assert max(abs(a[k] - b[k]) for k in a) < 1e-4


PROMPTS = [[5, 17, 200, 3, 9, 1], list(range(10, 22)), [7, 8, 9], [250, 1, 2, 3, 4, 5, 6, 7, 8]]


@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_preemption_under_a_tiny_budget_keeps_outputs(odd_checkpoint, tp, attention, monkeypatch):
    """16 blocks of 4 tokens hold one 64-token sequence; four sequences of ~30 tokens contend."""
    monkeypatch.setenv("NEURON_ATTENTION", attention)
    params = _greedy(20)
    budget = 16 * _block_bytes(odd_checkpoint, tp, 4)
    with LLM(str(odd_checkpoint), tensor_parallel_size=tp, device="cpu", dtype="float32", max_model_len=64,
             block_size=4, kv_cache_memory=budget) as llm:
        assert llm.engine.executor.num_kv_blocks == 16
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.kv_cache_usage() == 0.0
    for prompt, out in zip(PROMPTS, outs):
        _assert_equal(out.outputs[0], *reference_greedy(odd_checkpoint, prompt, 20))


@pytest.mark.slow
def test_memory_follows_real_lengths(odd_checkpoint):
    """A pool too small for 8 x max_model_len still runs 8 short sequences at once."""
    prompts = [[(13 * i + j) % 299 + 1 for j in range(12)] for i in range(8)]
    budget = 40 * _block_bytes(odd_checkpoint, 2, 8)  # 320 tokens; 8 x 128 would need 1024
    with LLM(str(odd_checkpoint), tensor_parallel_size=2, device="cpu", dtype="float32", max_model_len=128,
             max_num_seqs=8, block_size=8, kv_cache_memory=budget) as llm:
        pool = llm.engine.executor.rank0.models["model"].model.cache.k[0]
        # the paged cache's pool has one block past those handed out (the scratch block of CUDA graphs)
        assert llm.engine.executor.num_kv_blocks == 40 and pool.shape[1] == (40 + 1) * 8
        steps = _record_steps(llm)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(12))
        assert max(len(step) for step in steps) == 8
        assert llm.engine.scheduler.num_preemptions == 0
    for prompt, out in zip(prompts[:2], outs[:2]):
        _assert_equal(out.outputs[0], *reference_greedy(odd_checkpoint, prompt, 12))


def test_cleared_tables_and_a_reused_cache(odd_checkpoint):
    prompt = SYSTEM + [1, 2]
    with LLM(str(odd_checkpoint), device="cpu", dtype="float32", block_size=8) as llm:
        first = llm.generate({"prompt_token_ids": prompt}, _greedy())[0].outputs[0]
        llm.engine.executor.clear()  # the tables go; the blocks' contents and the leader's cache stay
        again = llm.generate({"prompt_token_ids": prompt}, _greedy())[0].outputs[0]
        assert llm.engine.prefix_cache_counts()[1] == 40
    assert again.token_ids == first.token_ids


def test_a_pool_smaller_than_one_sequence_is_refused(odd_checkpoint):
    with pytest.raises(ConfigError, match="fewer than max_model_len 64"):
        LLM(str(odd_checkpoint), device="cpu", dtype="float32", max_model_len=64, block_size=4,
            kv_cache_memory=8 * _block_bytes(odd_checkpoint, 1, 4))


def test_prefix_cache_metrics():
    from neuron.engine.metrics import Metrics

    server = Metrics()
    m = server.for_model("m")
    m.kv_cache(0.25, 100, 40)
    m.kv_cache(0.5, 150, 40)
    text = server.render().decode()
    assert 'neuron_prefix_cache_queries_total{model="m"} 150.0' in text
    assert 'neuron_prefix_cache_hits_total{model="m"} 40.0' in text
    assert 'neuron_prefix_cache_hit_rate{model="m"} 0.266' in text
    assert 'neuron_kv_cache_usage_ratio{model="m"} 0.5' in text
