"""Continuous batching: which sequences run in the next step, and with which tokens.

Each step is one batched forward under a token budget. Decoding sequences go first (one token
each), then sequences part-way through their prompt continue, then waiting requests are admitted
into free KV slots. A long prompt is prefilled in chunks across steps, mixed with decodes.
The scheduler is the only one who assigns slots: a slot belongs to one sequence at a time.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass, field

from neuron.sampling import SamplingParams, SequenceSampler


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sampler: SequenceSampler
    max_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    slot: int | None = None
    num_computed: int = 0  # tokens whose keys and values are in the slot
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def pending(self) -> list[int]:
        """Tokens not yet run through the model (the prompt's rest, or the last sampled token)."""
        if self.num_computed < len(self.prompt_token_ids):
            return self.prompt_token_ids[self.num_computed :] + self.output_token_ids
        return self.output_token_ids[self.num_computed - len(self.prompt_token_ids) :]


@dataclass(slots=True)
class Scheduled:
    seq: Sequence
    token_ids: list[int]
    offset: int

    @property
    def completes_prompt(self) -> bool:
        """After this chunk the sequence has no pending tokens, so its logits are sampled."""
        return self.offset + len(self.token_ids) == self.seq.num_tokens


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, prefill_chunk: int):
        self.max_num_seqs = max_num_seqs
        self.budget = max(max_num_batched_tokens, max_num_seqs)
        self.prefill_chunk = prefill_chunk
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[Scheduled]:
        batch: list[Scheduled] = []
        budget = self.budget
        decoding = [s for s in self.running if len(s.pending()) == 1]
        prefilling = [s for s in self.running if len(s.pending()) > 1]
        for seq in decoding:
            batch.append(Scheduled(seq, seq.pending(), seq.num_computed))
            budget -= 1
        for seq in prefilling:
            if budget <= 0:
                break
            budget -= self._chunk(seq, budget, batch)
        while self.waiting and self.free_slots and budget > 0:
            seq = self.waiting.popleft()
            seq.slot = self.free_slots.pop()
            seq.status = Status.RUNNING
            self.running.append(seq)
            budget -= self._chunk(seq, budget, batch)
        return batch

    def _chunk(self, seq: Sequence, budget: int, batch: list[Scheduled]) -> int:
        tokens = seq.pending()[: min(budget, self.prefill_chunk)]
        batch.append(Scheduled(seq, tokens, seq.num_computed))
        return len(tokens)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """Retire a sequence (finished, aborted or failed) and give its slot back."""
        if seq.status is Status.FINISHED:
            return
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.slot is not None:
            self.free_slots.append(seq.slot)
            seq.slot = None

    def all_sequences(self) -> list[Sequence]:
        return list(self.running) + list(self.waiting)
