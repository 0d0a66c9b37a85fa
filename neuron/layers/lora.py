"""LoRA adapters on a tensor-parallel linear layer: a fixed pool of slots, mixed in one step.

A linear layer with adapters holds a `LoraPool`: for every slot, the A matrices of its
projections stacked ([parts * rank, in]) and its B matrices laid block-diagonally beside them
([out, parts * rank]), each projection's B scaled by the adapter's alpha / r (or alpha / sqrt(r)
for rsLoRA). A fused layer (q, k and v; gate and up) has one part per projection; an adapter of
a smaller rank, or one that leaves a projection out, fills the rest with zeros, which add
exactly nothing.

Sharding follows the base weight: a column-parallel layer keeps B's rows of this rank's outputs
and all of A; a row-parallel layer keeps A's columns of this rank's inputs and all of B, so its
contribution is a partial sum that joins the base output's all-reduce: (x_r A_r^T) B^T summed
over ranks is (x A^T) B^T.

A step mixes rows of several adapters and of the bare base model (`LoraRows`). Per layer the
contribution is one grouped product over the step's rows: the A and B stacks of the step's
adapters are gathered, every row is multiplied by all of them at once ([T, U * parts * rank],
U adapters in the step), each row keeps the columns of its own adapter (a one-hot mask by its
slot) and one product with the stacked Bs brings them back to the output width. No Python loop
over adapters; the extra work is the rank's, not the layer's width.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class LoraRows:
    """Which adapter each row of a step runs: `slots`, the pool slots the step uses ([U]); `mask`,
    each row's one-hot choice among them ([T, U], all zeros for a row of the bare base model), or
    None when every row runs the one adapter of the step."""

    slots: torch.Tensor
    mask: torch.Tensor | None
    all_slots: bool  # the step uses every slot of the pool, in order: no gather needed
    _widened: dict[int, torch.Tensor] = field(default_factory=dict)

    def mask_for(self, width: int) -> torch.Tensor:
        """The mask with each adapter's column repeated `width` times ([T, U * width]), built once
        per step for each width the layers have."""
        wide = self._widened.get(width)
        if wide is None:
            wide = self._widened[width] = self.mask.repeat_interleave(width, dim=1)
        return wide

    @classmethod
    def build(cls, seq_slots: list[int], lengths: list[int], pool_slots: int, device, dtype) -> LoraRows | None:
        """From each sequence's slot (-1: the base model) and its number of rows; None when no
        sequence of the step runs an adapter."""
        used = sorted({s for s in seq_slots if s >= 0})
        if not used:
            return None
        slots = torch.tensor(used, dtype=torch.long, device=device)
        all_slots = used == list(range(pool_slots))
        if len(used) == 1 and min(seq_slots) >= 0:
            return cls(slots, None, all_slots)
        column = {s: i for i, s in enumerate(used)}
        per_row = torch.tensor([column.get(s, -1) for s, n in zip(seq_slots, lengths) for _ in range(n)],
                               dtype=torch.long, device=device)
        mask = (per_row[:, None] == torch.arange(len(used), device=device)).to(dtype)
        return cls(slots, mask, all_slots)


class LoraPool:
    """Every slot's adapter for one linear layer of this rank. `parts`: the (start, size) of each
    projection's rows in the layer's local output (one part for a plain layer)."""

    def __init__(self, slots: int, rank: int, in_features: int, parts: list[tuple[int, int]], dtype, device):
        self.rank = rank
        self.parts = parts
        out_features = sum(size for _, size in parts)
        width = len(parts) * rank
        self.a = torch.zeros(slots, width, in_features, dtype=dtype, device=device)  # [S, P*R, in]
        self.b = torch.zeros(out_features, slots, width, dtype=dtype, device=device)  # [out, S, P*R]

    def set(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Projection `part` of the adapter in `slot`: a [r, in] and b [size, r], b already scaled."""
        r, (start, size) = a.shape[0], self.parts[part]
        self.a[slot, part * self.rank : part * self.rank + r] = a
        self.b[start : start + size, slot, part * self.rank : part * self.rank + r] = b

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[:, slot].zero_()

    def add_to(self, y: torch.Tensor, x: torch.Tensor, rows: LoraRows) -> torch.Tensor:
        """`y` ([T, out], the layer's output for rows `x` [T, in]) plus the adapters' contribution,
        added in place."""
        a, b = (self.a, self.b) if rows.all_slots else (self.a.index_select(0, rows.slots),
                                                        self.b.index_select(1, rows.slots))
        used, width, inputs = a.shape
        shrunk = x @ a.reshape(used * width, inputs).T  # [T, U*P*R]: every row through every adapter's A
        if rows.mask is not None:
            shrunk.mul_(rows.mask_for(width))  # each row keeps its own adapter's columns
        return y.addmm_(shrunk, b.reshape(b.shape[0], used * width).T)

    def delta(self, x: torch.Tensor, rows: LoraRows) -> torch.Tensor:
        """The adapters' contribution alone ([T, out])."""
        return self.add_to(x.new_zeros(x.shape[0], self.b.shape[0]), x, rows)

    def nbytes(self) -> int:
        return self.a.numel() * self.a.element_size() + self.b.numel() * self.b.element_size()
