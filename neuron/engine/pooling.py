"""Embeddings on the leader: what a model is served for, how it pools, and the vectors it returns.

A pooling model (Qwen3-Embedding, any sentence-transformers checkpoint of a decoder neuron runs) is
a causal LM whose final-norm hidden states are pooled into one vector per input: the last token's
(`lasttoken`), their mean (`mean`) or the first token's (`cls`), L2-normalized when the checkpoint
has a Normalize module. sentence-transformers describes this in `modules.json` and
`1_Pooling/config.json` (read with the rest of the checkpoint's description, in model_config.py);
`--task embed` on a checkpoint without them pools the last token and normalizes, as
Qwen3-Embedding does.

A pooling request runs through the scheduler like any other, prefill only: each of its chunks
asks rank 0 for what the mode needs of it (`SeqStep.pool`), and `Pooled` adds the chunks up until
the prompt is done. Nothing here runs a model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from neuron.engine.classifier import Classifier
from neuron.engine.sampling_params import InvalidParams, check_truncation

# the tasks a model is served for (`--task`): chat and completions; embeddings; a classification
# head over the last token (engine/classifier.py), for /classify and cross-encoder scoring
GENERATE, EMBED, CLASSIFY = "generate", "embed", "classify"


@dataclass(frozen=True, slots=True)
class PoolingConfig:
    """How a model's hidden states become one embedding."""

    mode: str = "lasttoken"  # lasttoken, mean or cls
    normalize: bool = True  # L2-normalize the pooled vector (and again after `dimensions` truncates it)
    # a classification model's head: its pooled vector is the head's logits (task classify)
    classifier: Classifier | None = None

    def chunk_op(self, offset: int, length: int, prompt_len: int) -> str | None:
        """What rank 0 returns for a prompt chunk [offset, offset + length) (`SeqStep.pool`):
        `last` (its last row), `first` (its first row) or `sum` (of its rows); None when the
        chunk holds nothing the mode needs."""
        if self.mode == "mean":
            return "sum"
        if self.mode == "cls":
            return "first" if offset == 0 else None
        return "last" if offset + length == prompt_len else None


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """An embedding request's parameters (vLLM's name), where SamplingParams would make it a
    generation: `dimensions` keeps the vector's first values (Matryoshka); `truncate_prompt_tokens`
    the input's last tokens, as SamplingParams'; `task` what the caller takes the vector for (embed:
    an embedding, classify: a classifier's logits), refused by a model not served for it (None: what
    the model pools); `use_activation` false: an embedding as it is pooled, not L2-normalized
    (None: as the model's pooling says; true: normalized), and a classifier's logits rather than its
    probabilities (the offline APIs read that; the engine returns logits either way), as vLLM's."""

    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None
    task: str | None = None
    use_activation: bool | None = None

    def __post_init__(self) -> None:
        check_truncation(self.truncate_prompt_tokens)
        if self.use_activation is not None and not isinstance(self.use_activation, bool):
            raise InvalidParams("use_activation", f"use_activation must be true or false, got {self.use_activation!r}")
        if self.task not in (None, EMBED, CLASSIFY):
            raise InvalidParams("task", f"task must be {EMBED} or {CLASSIFY}, got {self.task!r}")


@dataclass(slots=True)
class Pooled:
    """A pooling sequence's vector so far: the chunks' contributions, on rank 0's device until
    the vector is read (one copy to the host per request, not one per chunk)."""

    dimensions: int | None = None  # PoolingParams.dimensions
    normalize: bool | None = None  # PoolingParams.use_activation: None as the model's pooling says
    total: torch.Tensor | None = None
    rows: int = 0

    def add(self, op: str, value: torch.Tensor, length: int) -> None:
        value = value.float()
        if op == "sum":
            self.total = value if self.total is None else self.total + value
            self.rows += length
        else:
            self.total, self.rows = value, 1

    def reset(self) -> None:
        """The sequence starts over (preempted, to be recomputed from its first token)."""
        self.total, self.rows = None, 0

    def vector(self, cfg: PoolingConfig) -> list[float]:
        """The embedding, or a classification model's logits."""
        v = self.total / max(self.rows, 1) if cfg.mode == "mean" else self.total
        if cfg.classifier is not None:
            return cfg.classifier.logits(v)
        return finish(v.cpu(), cfg.normalize if self.normalize is None else self.normalize, self.dimensions)


def normalized(vector: list[float]) -> list[float]:
    """`vector` over its L2 norm (a zero vector as it is), as Ollama's /api/embed returns each."""
    return torch.nn.functional.normalize(torch.tensor(vector, dtype=torch.float64), dim=0).tolist()


def cosine_similarities(vectors: list[list[float]], firsts: list[int], seconds: list[int]) -> list[float]:
    """The cosine similarity of rows firsts[k] and seconds[k] of `vectors` (0 where one is zero):
    how vLLM scores a pair of texts with an embedding model."""
    unit = torch.nn.functional.normalize(torch.tensor(vectors, dtype=torch.float64), dim=-1)
    return (unit[firsts] * unit[seconds]).sum(-1).tolist()


def finish(v: torch.Tensor, normalize: bool, dimensions: int | None = None) -> list[float]:
    """The embedding as a client gets it: its first `dimensions` values (Matryoshka truncation),
    L2-normalized after the cut when the model normalizes."""
    if dimensions is not None:
        v = v[:dimensions]
    if normalize:
        v = torch.nn.functional.normalize(v, dim=-1)
    return v.tolist()


def wanted(s) -> str | None:
    """What rank 0 returns for this scheduled chunk of a pooling request (`SeqStep.pool`); None
    for any other request, or a chunk that holds nothing its pooling needs."""
    seq = s.seq
    if seq.pooling is None:
        return None
    return seq.pooling.chunk_op(s.offset, len(s.token_ids), len(seq.prompt_token_ids))


def accumulate(part: list, steps: list, result) -> None:
    """Add this step's pooled rows (rank 0's `StepResult.pooled`) to each pooling request of `part`.
    A chunk at offset 0 starts the vector anew: a preempted request is recomputed from its start."""
    for i, (s, step) in enumerate(zip(part, steps)):
        if step.pool is None or i not in result.pooled:
            continue
        if s.offset == 0:
            s.seq.pooled.reset()
        s.seq.pooled.add(step.pool, result.pooled[i], len(s.token_ids))
