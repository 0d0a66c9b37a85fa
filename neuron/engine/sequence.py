"""A request as the engine tracks it: its tokens, slot, KV blocks and state. Its own module
because the scheduler, the block manager and the output processor all read it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from neuron.engine.pooling import Pooled, PoolingConfig
from neuron.engine.sampling import SequenceSampler
from neuron.engine.sampling_params import SamplingParams
from neuron.engine.structured_output import GrammarMatcher

if TYPE_CHECKING:
    from neuron.engine.lora import Adapter
    from neuron.engine.spec_decode.acceptance import Acceptance
    from neuron.engine.spec_decode.draft import DraftState


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
    num_computed: int = 0  # tokens whose keys and values are in the sequence's blocks
    block_table: list[int] = field(default_factory=list)
    cache_salt: bytes | None = None  # its cache salt's digest (block_manager.salt_key): the hash chain's start
    block_hashes: list[bytes] = field(default_factory=list)  # hash chain of its full blocks, as far as known
    num_cached_blocks: int = 0  # leading blocks of the table that are in the prefix cache
    num_blocks_sent: int = 0  # leading blocks of the table the ranks already have
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    images: list = field(default_factory=list)  # ImageInputs filling the prompt's placeholders, in order
    grammar: GrammarMatcher | None = None  # structured output: where its text is in the grammar it must match
    prompt_logprobs: list[dict[int, float] | None] | None = None  # one per prompt token computed so far, if asked
    prompt_token_ranks: list[int | None] | None = None  # alongside: each prompt token's rank in the vocabulary
    # speculative decoding (engine/spec_decode): the tokens proposed for its next step, its
    # proposals' recent acceptance, and a draft model's progress through it in its slot
    draft_token_ids: list[int] = field(default_factory=list)
    acceptance: Acceptance | None = None
    draft_state: DraftState | None = None
    # an embedding request (engine/pooling.py): how its hidden states are pooled, and its vector so far
    pooling: PoolingConfig | None = None
    pooled: Pooled | None = None
    types_from: int | None = None  # an encoder's pair: where its second token type starts (SeqStep.types_from)
    # a LoRA adapter's request (engine/lora.py): the adapter, and the ranks' pool slot holding it while it runs
    lora: Adapter | None = None
    lora_slot: int | None = None

    @property
    def wants_every_prompt_row(self) -> bool:
        """Something is read from every prompt position (its logprobs, a mean or first-token pooling),
        so no cached prefix may skip computing them."""
        return self.params.prompt_logprobs is not None or (self.pooling is not None
                                                            and self.pooling.mode != "lasttoken")

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    def pending(self) -> list[int]:
        """Tokens not yet run through the model (the prompt's rest, or the last sampled token)."""
        return self.token_slice(self.num_computed, self.num_tokens)
