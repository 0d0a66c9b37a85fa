"""Rank 0's share of an embedding: the final-norm hidden states a pooling request's chunk asks for
(`SeqStep.pool`). After the last layer's all-reduce every rank holds the full hidden states and the
final norm is replicated, so rank 0 pools alone: no collective, no LM head. The leader adds the
chunks up (engine/pooling.py)."""

from __future__ import annotations

import torch


def compute(model, x: torch.Tensor, batch) -> dict[int, torch.Tensor]:
    """Each pooled sequence's vector of this chunk, keyed by its index in the step: the final norm
    of its last row, its first row, or the float32 sum of all its rows."""
    out: dict[int, torch.Tensor] = {}
    start = 0
    for i, (n, op) in enumerate(zip(batch.lengths, batch.pool)):
        if op == "last":
            out[i] = model.norm(x[start + n - 1 : start + n])[0].float()
        elif op == "first":
            out[i] = model.norm(x[start : start + 1])[0].float()
        elif op == "sum":
            out[i] = model.norm(x[start : start + n]).float().sum(0)
        start += n
    return out
