"""The rows of a step that its last layer runs alone (models/inputs.py's `kept_rows` picks them)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from neuron.layers.lora import LoraRows
from neuron.layers.paged_attention import PagedAttentionMetadata


@dataclass(slots=True)
class KeptRows:
    """The rows of a step that the head reads (each sequence's last token, a speculative step's
    last few), where nothing else reads the last layer's output. That layer stores every row's key
    and value, then runs attention, the output projection and the MLP for these rows alone: in a
    prefill chunk of 512 tokens the rest is a layer's worth of arithmetic thrown away."""

    index: torch.Tensor  # their places in the flat batch, in order
    paged: PagedAttentionMetadata  # the step's attention metadata for their queries alone
    lora: LoraRows | None = None  # the adapter each of them runs (the step's `lora` for these rows)
