"""What a model takes for one step, independent of how the leader sent it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SeqStep:
    """One sequence of a batched step: its slot, its new token ids, where they start, and the KV
    block ids its slot's block table gains this step (none most steps, one when decode crosses a
    block boundary). `fresh`: the sequence's first step in this slot; the table restarts as
    `new_blocks`, whose first `offset` positions already hold its cached prefix."""

    slot: int
    token_ids: list[int]
    offset: int
    new_blocks: list[int] = field(default_factory=list)
    fresh: bool = False
