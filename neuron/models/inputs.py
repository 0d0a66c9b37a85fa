"""What a model's forward reads and what rank 0 keeps of it. The step itself is
`neuron.step.SeqStep`, the record every rank reads; the model runner (neuron/worker) checks it and
turns it into a `StepBatch`, the one input type of every model's forward."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from neuron.errors import NeuronError
from neuron.layers.kept import KeptRows
from neuron.layers.lora import LoraRows
from neuron.layers.paged_attention import PagedAttentionMetadata, last_queries


class StepRejected(NeuronError):
    """A step that does not fit the KV cache or a model's per-slot state (bad slot or block, gap in
    positions, past the model length, images that do not match their placeholders)."""


@dataclass(slots=True)
class StepBatch:
    """The tokens of all sequences of a step, flattened, with what attention needs to split them."""

    token_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    write_rows: torch.Tensor | int  # [T] pool row of each new token (an int for a lone decode token)
    slots: list[int]
    lengths: list[int]  # new tokens per sequence
    kv_lens: list[int]  # filled positions of each sequence after this step
    last_index: torch.Tensor | None  # each sequence's last token(s) in the flat batch (all but decode steps)
    all_decode: bool  # every sequence brings exactly one token
    read_rows: list[torch.Tensor]  # pool rows to attend over: decode, one [B, L] (padded; [L] for a lone
    # sequence); prefill, [kv_len] per sequence
    masks: list[torch.Tensor | None]  # decode: one padding mask or None; prefill: a causal mask per sequence
    paged: PagedAttentionMetadata | None = None  # the flat step for attention that reads blocks in place
    prompt_topk: list[int | None] | None = None  # per sequence: top-k of its chunk's prompt logprobs, if asked
    prompt_out: dict | None = None  # rank 0: PromptChunkLogprobs by sequence index, filled by the forward
    logit_counts: list[int] | None = None  # a speculative step: each sequence's rows of logits (else one each)
    pool: list[str | None] | None = None  # per sequence: what rank 0 pools of its chunk (SeqStep.pool), if any
    pool_out: dict | None = None  # rank 0: each pooled sequence's [hidden] vector by index, filled by the forward
    types_from: list[int | None] | None = None  # per sequence: where an encoder pair's second token type starts
    lora: LoraRows | None = None  # the LoRA adapter each row runs; None: every row runs the bare base model


@dataclass(slots=True)
class StepResult:
    """What rank 0 keeps of a step: the last-token logits ([num_seqs, vocab]) and, for the
    sequences that asked, their chunk's prompt logprobs and their pooled hidden states, keyed by
    index in the step."""

    logits: Any
    prompt: dict[int, Any] = field(default_factory=dict)
    pooled: dict[int, Any] = field(default_factory=dict)


def kept_rows(batch: StepBatch) -> KeptRows | None:
    """The rows the last layer need run, or None where it runs them all: a decode step (every row
    is read), a step whose every row's hidden state is read (prompt logprobs, pooling), or
    attention that does not read blocks in place."""
    if (batch.all_decode or batch.paged is None or batch.prompt_topk is not None or batch.pool is not None
            or batch.last_index is None):
        return None
    if batch.last_index.shape[0] >= sum(batch.lengths):
        return None
    counts = [1] * len(batch.lengths) if batch.logit_counts is None else \
        [min(c, n) for c, n in zip(batch.logit_counts, batch.lengths)]
    return KeptRows(batch.last_index, last_queries(batch.paged, counts, batch.last_index),
                    None if batch.lora is None else batch.lora.last_rows(counts))
