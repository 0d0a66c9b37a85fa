"""What a model takes for one step, independent of how the leader sent it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class SeqStep:
    """One sequence of a batched step: its slot, its new token ids, where they start, and the KV
    block ids its slot's block table gains this step (none most steps, one when decode crosses a
    block boundary). `fresh`: the sequence's first step in this slot; the table restarts as
    `new_blocks`, whose first `offset` positions already hold its cached prefix. `prompt_logprobs`:
    the top-k wanted with the logprobs of its tokens in this chunk (None: not wanted)."""

    slot: int
    token_ids: list[int]
    offset: int
    new_blocks: list[int] = field(default_factory=list)
    fresh: bool = False
    prompt_logprobs: int | None = None


@dataclass(slots=True)
class StepResult:
    """What rank 0 keeps of a step: the last-token logits ([num_seqs, vocab]) and, for the
    sequences that asked, their chunk's prompt logprobs keyed by index in the step."""

    logits: Any
    prompt: dict[int, Any] = field(default_factory=dict)
