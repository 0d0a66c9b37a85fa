"""What rank 0 keeps of a step; the step itself is `neuron.step.SeqStep`, the record every rank reads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class StepResult:
    """What rank 0 keeps of a step: the last-token logits ([num_seqs, vocab]) and, for the
    sequences that asked, their chunk's prompt logprobs keyed by index in the step."""

    logits: Any
    prompt: dict[int, Any] = field(default_factory=dict)
