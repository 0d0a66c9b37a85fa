"""Continuous batching: which sequences run in the next step, and with which tokens.

Each step is one batched forward under a token budget. Decoding sequences go first (one token
each), then sequences part-way through their prompt continue, then waiting requests are admitted
into free slots while the KV blocks for their prompt (less any cached prefix) are free; one whose
next prompt block another sequence is computing waits until that block is cached. A long
prompt is prefilled in chunks across steps, mixed with decodes. A decode that finds no free
block preempts the most recently admitted sequence: its blocks are freed and it waits again, to
be recomputed (prompt and generated tokens) when admitted anew. A decoding sequence given draft
tokens (speculative decoding, engine/spec_decode) brings them behind its last token, within the
budget, in a step that prefills nothing; their blocks were reserved when they were proposed.
A prompt with images is chunked like any other; its first step carries the images to every
rank, in the step's protocol line, so a step admits no more sequences with images than
`max_image_bytes` of them fit (the others wait a step).
An encoder's input (models/bert.py) attends both ways, so it is never cut: it runs whole in one
step, and waits for a step whose budget holds it (the budget is at least the model length).
A request for a LoRA adapter is admitted only once its adapter holds one of the ranks' adapter
slots (engine/lora.py); while every slot serves other running adapters it waits, and later
requests may pass it.
The scheduler is the only one who assigns slots and blocks: a slot belongs to one sequence at a time.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from neuron.engine.block_manager import BlockManager
from neuron.engine.lora import LoraSlots
from neuron.engine.sequence import Sequence, Status

log = logging.getLogger("neuron.engine.scheduler")


@dataclass(slots=True)
class Scheduled:
    seq: Sequence
    token_ids: list[int]
    offset: int
    new_blocks: list[int] = field(default_factory=list)  # blocks the ranks' table of the slot gains
    fresh: bool = False  # the sequence's first step in its slot
    proposal: list[int] = field(default_factory=list)  # speculative tokens after its last one, scored too

    @property
    def logits(self) -> int:
        """Positions whose logits the step returns: the last token's, and each proposed one's."""
        return 1 + len(self.proposal)

    @property
    def completes_prompt(self) -> bool:
        """After this chunk the sequence has no pending tokens, so its logits are sampled."""
        return self.offset + len(self.token_ids) - len(self.proposal) == self.seq.num_tokens


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, prefill_chunk: int,
                 blocks: BlockManager | None = None, max_image_bytes: Callable[[], int] | None = None,
                 loras: LoraSlots | None = None, whole_prompts: bool = False):
        self.max_num_seqs = max_num_seqs
        self.budget = max(max_num_batched_tokens, max_num_seqs)
        self.prefill_chunk = prefill_chunk
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.blocks = blocks
        self.prefix_cache_queries = 0  # tokens of admitted sequences looked up in the prefix cache
        self.prefix_cache_hits = 0  # of those, tokens found there (their prefill skipped)
        self.num_preemptions = 0
        self.max_image_bytes = max_image_bytes  # encoded image bytes one step carries (None: no bound)
        self.loras = loras  # the ranks' LoRA adapter slots (None: the model serves no adapters)
        self.whole_prompts = whole_prompts  # an encoder's: each prompt in one step, never in chunks

    def use_blocks(self, blocks: BlockManager) -> None:
        """Schedule over a new block pool (at start, and after the ranks were rebuilt)."""
        assert not self.running, "blocks change only while nothing runs"
        self.blocks = blocks

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[Scheduled]:
        batch: list[Scheduled] = []
        budget = self.budget
        decoding = [s for s in self.running if s.num_computed == s.num_tokens - 1]
        prefilling = [s for s in self.running if s.num_computed < s.num_tokens - 1]
        preempted = False
        ready = []
        for seq in decoding:
            if seq.status is not Status.RUNNING or not self._room_for_next_token(seq):
                preempted = True
                continue
            ready.append(seq)
        budget -= len(ready)
        # draft tokens ride only in a step that prefills nothing (one that does is bound by compute
        # already); a request that arrived since they were proposed makes this such a step
        speculate = not prefilling and not (self.waiting and self.free_slots)
        for seq in ready:
            draft = seq.draft_token_ids[:max(budget, 0)] if speculate else []
            batch.append(self._scheduled(seq, seq.pending() + draft, draft))
            budget -= len(draft)
        for seq in prefilling:
            if budget <= 0:
                break
            if seq.status is Status.RUNNING:
                budget -= self._chunk(seq, budget, batch)
        if not preempted:
            self._admit(budget, batch)
        return batch

    def _admit(self, budget: int, batch: list[Scheduled]) -> None:
        """Admit waiting sequences, oldest first, while slots, blocks and the budget last. One whose
        next prompt block another running sequence is computing is passed over until that block is
        cached, so it is computed once (several samples of one prompt, identical prompts). One with
        images waits a step when the step's images would pass `max_image_bytes` (alone it goes)."""
        image_bytes = 0
        for seq in list(self.waiting):
            if not self.free_slots or budget <= 0 or (self.whole_prompts and seq.num_tokens > budget):
                return
            if self.blocks.computing_elsewhere(seq, self.running):
                continue
            size = sum(len(image.uri) for image in seq.images)
            if size and image_bytes and self.max_image_bytes and image_bytes + size > self.max_image_bytes():
                continue
            if seq.lora is not None and not self.loras.acquire(seq):
                continue  # every adapter slot is busy: it waits, requests for resident adapters go on
            if not self.blocks.allocate(seq):
                if self.loras is not None:
                    self.loras.release(seq)
                return  # first come, first served: later requests wait too
            self.waiting.remove(seq)
            self._start(seq)
            image_bytes += size
            budget -= self._chunk(seq, budget, batch)

    def _start(self, seq: Sequence) -> None:
        seq.slot = self.free_slots.pop()
        seq.status = Status.RUNNING
        seq.num_computed = seq.num_cached_blocks * self.blocks.block_size
        seq.num_blocks_sent = 0
        if self.blocks.enable_prefix_caching:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += seq.num_computed
        self.running.append(seq)

    def _room_for_next_token(self, seq: Sequence) -> bool:
        """Find the block the sequence's next token needs, preempting the newest sequences
        (possibly this one) until one is free. False when this sequence was preempted."""
        if seq.num_computed < len(seq.block_table) * self.blocks.block_size:
            return True  # the usual case: its last block has room
        while not self.blocks.can_append(seq):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        self.blocks.append(seq)
        return True

    # ---- what speculative decoding asks (engine/spec_decode) ----

    def decoding(self) -> list[Sequence]:
        """The running sequences whose next step decodes one token."""
        return [s for s in self.running if s.num_computed == s.num_tokens - 1]

    def prefills_next(self) -> bool:
        """Whether the next step prefills: a running prompt is unfinished, or a waiting one can start."""
        return any(s.num_computed < s.num_tokens - 1 for s in self.running) or bool(self.waiting and self.free_slots)

    def reserve_drafts(self, seqs: list[Sequence], ks: list[int]) -> list[int]:
        """Blocks for up to ks[i] draft tokens of seqs[i] after its next one, from free blocks only
        and only once every decoding sequence's next token has its block: drafts never cost a
        preemption. Returns how many draft tokens each sequence's blocks now cover (a draft model
        writes its keys and values there while it proposes)."""
        for seq in seqs:
            if seq.num_computed >= len(seq.block_table) * self.blocks.block_size and self.blocks.can_append(seq):
                self.blocks.append(seq)
        covered = []
        for seq, k in zip(seqs, ks):
            if k:
                k = max(min(k, self.blocks.reserve(seq, seq.num_computed + 1 + k) - seq.num_computed - 1), 0)
            covered.append(k)
        return covered

    def _preempt(self, seq: Sequence) -> None:
        """Free a running sequence's slot and blocks and queue it first, to be recomputed."""
        log.info("request %s preempted at %d tokens: out of KV blocks (%d in the pool)", seq.request_id,
                 seq.num_tokens, self.blocks.num_blocks)
        self.running.remove(seq)
        self._release(seq)
        seq.status = Status.WAITING
        seq.num_computed = 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _chunk(self, seq: Sequence, budget: int, batch: list[Scheduled]) -> int:
        tokens = seq.pending()
        if not self.whole_prompts:
            tokens = tokens[: min(budget, self.prefill_chunk)]
        elif len(tokens) > budget:
            return 0  # it runs whole, in a later step
        batch.append(self._scheduled(seq, tokens))
        return len(tokens)

    def _scheduled(self, seq: Sequence, tokens: list[int], proposal: list[int] | None = None) -> Scheduled:
        """The step of one sequence, with the blocks the ranks have not been told about."""
        new_blocks = seq.block_table[seq.num_blocks_sent :]
        fresh = seq.num_blocks_sent == 0
        seq.num_blocks_sent = len(seq.block_table)
        return Scheduled(seq, tokens, seq.num_computed, new_blocks, fresh, proposal or [])

    def update_from_output(self, ran: list[Scheduled]) -> tuple[list[int], list[Sequence]]:
        """The step ran: its tokens are in the KV cache and newly full blocks become cacheable.
        Returns the rows of `ran` whose logits are sampled now (a prompt just completed, or a
        decode), and the sequences that only scored their prompt (max_tokens 0), which it retires."""
        rows, scored = [], []
        for i, s in enumerate(ran):
            # proposed tokens count as computed only once the sampling kept them (accept_proposed)
            s.seq.num_computed = s.offset + len(s.token_ids) - len(s.proposal)
            self.blocks.cache_computed(s.seq)
            if not s.completes_prompt:
                continue
            if s.seq.max_tokens == 0:
                self.finish(s.seq, "length")
                scored.append(s.seq)
            else:
                rows.append(i)
        return rows, scored

    def accept_proposed(self, seq: Sequence, accepted: int) -> None:
        """`accepted` proposed tokens were sampled as proposed: their keys and values, written by the
        step, are the sequence's; full blocks among them become cacheable."""
        seq.num_computed += accepted
        self.blocks.cache_computed(seq)

    @staticmethod
    def advance(seq: Sequence, token: int) -> bool:
        """A sampled token joins its sequence (and its penalties' counts, and its grammar); False
        when the grammar refuses it (one past llguidance's limits mid-way)."""
        seq.output_token_ids.append(token)
        seq.sampler.append(token)
        return seq.grammar is None or seq.grammar.accept(token)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """Retire a sequence (finished, aborted or failed) and give its slot and blocks back."""
        if seq.status is Status.FINISHED:
            return
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        seq.draft_token_ids = []
        seq.draft_state = None  # a draft model's progress in a slot it no longer holds
        if seq.slot is not None:
            self.free_slots.append(seq.slot)
            seq.slot = None
        if seq.lora_slot is not None:
            self.loras.release(seq)
        if seq.block_table:
            self.blocks.release(seq)
        seq.num_blocks_sent = 0

    def all_sequences(self) -> list[Sequence]:
        return list(self.running) + list(self.waiting)
