"""The step record: what one sequence does in a batched step, from the scheduler to every rank.

The leader's engine makes one per scheduled sequence; the executor sends the list to the workers
inside `ForwardStep` (the wire encodes it once, as a compact array) and hands rank 0 the very same
objects; each rank's model reads it. One record, no copies into other shapes on the way. Plain data,
no torch, so the wire, the mock workers and the fuzzers use it too.
"""

from __future__ import annotations

from typing import Literal

import msgspec


class StepImage(msgspec.Struct, array_like=True):
    """An image of a sequence's prompt: its `data:` URI and the position of the first of the
    placeholder tokens it fills (how many it fills, every rank learns from its pixels)."""

    uri: str
    start: int


class SeqStep(msgspec.Struct, array_like=True):
    """One sequence of a batched step: its slot, its new token ids, where they start, and the KV
    block ids its slot's block table gains this step (none most steps, one when decode crosses a
    block boundary). `fresh`: the sequence's first step in its slot; the table restarts as
    `new_blocks`, whose first `offset` positions already hold its cached prefix.
    `prompt_logprobs`: the top-k wanted with the logprobs of its tokens in this chunk (None: not
    wanted); every rank sees it, as the LM head's gathers must pair up. `logits`: how many of its
    last positions rank 0 returns logits for (a speculative step scores its proposed tokens too).
    `images`: on a sequence's first step only, the images its prompt holds, in order; each rank
    keeps them for the slot until its prefill has passed them, so later chunks carry none.
    `pool`: a pooling (embedding) request's chunk, what rank 0 returns of its final-norm hidden
    states: `last` (the chunk's last row), `first` (its first row) or `sum` (of its rows); None
    for a chunk that needs none (engine/pooling.py). `lora`: the slot of the rank's LoRA pool
    whose adapter the sequence runs (-1: the bare base model). `types_from`: an encoder's input of
    two texts, the position from which its tokens are of the second token type (a cross-encoder's
    second text); None: every token is of the first."""

    slot: int
    token_ids: list[int]
    offset: int
    new_blocks: list[int] = []
    fresh: bool = False
    prompt_logprobs: int | None = None
    logits: int = 1
    images: list[StepImage] = []
    pool: Literal["last", "first", "sum"] | None = None
    lora: int = -1
    types_from: int | None = None


class VerifyShape(msgspec.Struct, frozen=True):
    """Speculative decoding's verifying steps: `tokens` per sequence (its last token and the
    proposals after it) and at most `batch` sequences speculating in one step; zeros without
    speculation. One shape, derived from the speculative config, for the scheduler, the ranks'
    load message and their CUDA graphs."""

    tokens: int = 0
    batch: int = 0
