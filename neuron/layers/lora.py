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
contribution is one grouped product over the step's rows, the shape of Punica's SGMV: the rows
are gathered by adapter into a padded batch ([U, rows of the largest group, in], U adapters in
the step), two batched products with the U adapters' A and B stacks give each row its own
adapter's contribution, and an index-add puts them back on their rows of the output. The base
model's rows are in no group. The grouping is worked out once per step, on the host; no layer
loops over adapters. A step whose rows all run one adapter skips the grouping: two plain products.

On CUDA a mixed step runs two Triton kernels instead (triton_lora.py, SGMV's shrink and expand):
each program takes a tile of one adapter's rows, in `dest` order, and reads that adapter's A and
B^T where the pool holds them, so nothing is padded or gathered; B^T's rows of each projection are
read only within its outputs. They run once the start-up self-check passed them on the card (piece
`lora`); otherwise, and on CPU, the grouped PyTorch product above runs, the reference they are
checked against.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from neuron.layers.kernels import Kernels
from neuron.layers.paged_attention import HAS_TRITON


@dataclass(slots=True)
class LoraRows:
    """Which adapter each row of a step runs. `slots`: the pool slots the step uses ([U]), or
    `single`, the one slot every row runs. Otherwise `take` lists, adapter after adapter, the
    rows of each group padded to `group` rows ([U * group] row indices; padding repeats a row),
    and `dest` the output row of each entry of `keep` (the unpadded entries; None: no padding)."""

    slots: torch.Tensor
    all_slots: bool  # the step uses every slot of the pool, in order: no gather needed
    per_row: torch.Tensor | None  # each row's slot (-1: the base model), int64 on the host: the CPU C loop's
    single: int | None = None
    take: torch.Tensor | None = None
    keep: torch.Tensor | None = None
    dest: torch.Tensor | None = None
    group: int = 0
    starts: torch.Tensor | None = None  # where each adapter's rows begin in `dest`, and its end ([U + 1])
    seq_slots: list[int] | None = None  # each sequence's slot and the pool's slot count, as built
    pool_slots: int = 0

    @classmethod
    def build(cls, seq_slots: list[int], lengths: list[int], pool_slots: int, device) -> LoraRows | None:
        """From each sequence's slot (-1: the base model) and its number of rows; None when no
        sequence of the step runs an adapter."""
        used = sorted({s for s in seq_slots if s >= 0})
        if not used:
            return None
        slots = torch.tensor(used, dtype=torch.long, device=device)
        all_slots = used == list(range(pool_slots))
        per_row = torch.tensor([s for s, n in zip(seq_slots, lengths) for _ in range(n)], dtype=torch.long) \
            if torch.device(device).type == "cpu" else None
        if len(used) == 1 and min(seq_slots) >= 0:
            return cls(slots, all_slots, per_row, single=used[0], seq_slots=seq_slots, pool_slots=pool_slots)
        starts = [0]
        for n in lengths:
            starts.append(starts[-1] + n)
        rows: dict[int, list[int]] = {s: [] for s in used}
        for s, start, n in zip(seq_slots, starts, lengths):
            if s >= 0:
                rows[s] += range(start, start + n)
        group = max(len(r) for r in rows.values())
        take = [i for s in used for i in rows[s] + [rows[s][0]] * (group - len(rows[s]))]
        keep = [u * group + j for u, s in enumerate(used) for j in range(len(rows[s]))]
        dest = [i for s in used for i in rows[s]]
        starts = [0]
        for s in used:
            starts.append(starts[-1] + len(rows[s]))
        as_index = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
        return cls(slots, all_slots, per_row, None, as_index(take),
                   None if len(keep) == len(take) else as_index(keep), as_index(dest), group, as_index(starts),
                   seq_slots, pool_slots)

    def last_rows(self, counts: list[int]) -> LoraRows | None:
        """The same sequences' adapters for each one's last `counts[i]` rows alone (the rows a
        step's last layer runs: layers/kept.py, KeptRows)."""
        return LoraRows.build(self.seq_slots, counts, self.pool_slots, self.slots.device)


class LoraPool:
    """Every slot's adapter for one linear layer of this rank. `parts`: the (start, size) of each
    projection's rows in the layer's local output (one part for a plain layer)."""

    def __init__(self, slots: int, rank: int, in_features: int, parts: list[tuple[int, int]], dtype, device,
                 kernels: Kernels):
        self.rank = rank
        self.parts = parts
        self.kernels = kernels
        self.bounds = torch.tensor(parts, dtype=torch.long, device=device)  # [P, 2]: the Triton expand's parts
        out_features = sum(size for _, size in parts)
        width = len(parts) * rank
        self.a = torch.zeros(slots, width, in_features, dtype=dtype, device=device)  # [S, P*R, in]
        # B transposed, [S, P*R, out]: a row's contribution is then a sum of whole rows of it, which
        # the CPU loop (csrc/cpu_decoder.cpp) adds with contiguous vector loads
        self.bt = torch.zeros(slots, width, out_features, dtype=dtype, device=device)

    def set(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Projection `part` of the adapter in `slot`: a [r, in] and b [size, r], b already scaled."""
        r, (start, size) = a.shape[0], self.parts[part]
        self.a[slot, part * self.rank : part * self.rank + r] = a
        self.bt[slot, part * self.rank : part * self.rank + r, start : start + size] = b.T

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.bt[slot].zero_()

    def add_to(self, y: torch.Tensor, x: torch.Tensor, rows: LoraRows) -> torch.Tensor:
        """`y` ([T, out], the layer's output for rows `x` [T, in]) plus the adapters' contribution,
        added in place."""
        if rows.single is not None:
            return y.addmm_(x @ self.a[rows.single].T, self.bt[rows.single])
        if x.is_cuda and HAS_TRITON and y.stride(-1) == 1 and self.kernels.triton("lora"):
            return grouped_triton(self, y, x, rows)
        return self.add_grouped(y, x, rows)

    def add_grouped(self, y: torch.Tensor, x: torch.Tensor, rows: LoraRows) -> torch.Tensor:
        """`add_to` for a step of several adapters, or of adapters and the base, in PyTorch: the
        reference the Triton kernels are checked against."""
        a, bt = (self.a, self.bt) if rows.all_slots else (self.a.index_select(0, rows.slots),
                                                          self.bt.index_select(0, rows.slots))
        grouped = x.index_select(0, rows.take).view(a.shape[0], rows.group, x.shape[1])  # [U, group, in]
        out = torch.bmm(torch.bmm(grouped, a.transpose(1, 2)), bt).view(-1, bt.shape[2])
        return y.index_add_(0, rows.dest, out if rows.keep is None else out.index_select(0, rows.keep))

    def delta(self, x: torch.Tensor, rows: LoraRows) -> torch.Tensor:
        """The adapters' contribution alone ([T, out])."""
        return self.add_to(x.new_zeros(x.shape[0], self.bt.shape[2]), x, rows)

    def nbytes(self) -> int:
        return self.a.numel() * self.a.element_size() + self.bt.numel() * self.bt.element_size()


def grouped_triton(pool: LoraPool, y: torch.Tensor, x: torch.Tensor, rows: LoraRows) -> torch.Tensor:
    """`pool.add_grouped` by the Triton kernels (triton_lora.py): y [T, out] plus each row's
    adapter's contribution, in place; trusted on a GPU once the start-up self-check passed it."""
    import triton

    from neuron.layers.triton_lora import lora_expand_kernel, lora_shrink_kernel

    x = x if x.stride(-1) == 1 else x.contiguous()
    width, out_features = pool.a.shape[1], pool.bt.shape[2]
    h = torch.empty(rows.dest.shape[0], width, dtype=x.dtype, device=x.device)  # x A^T, rows in `dest` order
    block = 16 if rows.group <= 16 else 64  # decode: small tiles, more programs to read A with
    grid_m = (rows.slots.shape[0], triton.cdiv(rows.group, block))
    # float32 activations multiply in float32, not TF32; so does every dtype in Triton's CPU interpreter
    ieee = x.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"
    lora_shrink_kernel[(*grid_m, triton.cdiv(width, block))](
        x, pool.a, rows.slots, rows.starts, rows.dest, h, x.shape[1], width, x.stride(0), pool.a.stride(0),
        pool.a.stride(1), h.stride(0), IEEE=ieee, BLOCK_M=block, BLOCK_W=block, BLOCK_K=64)
    lora_expand_kernel[(*grid_m, triton.cdiv(out_features, 64))](
        h, pool.bt, pool.bounds, rows.slots, rows.starts, rows.dest, y, out_features, pool.rank, h.stride(0),
        pool.bt.stride(0), pool.bt.stride(1), y.stride(0), PARTS=len(pool.parts), IEEE=ieee, BLOCK_M=block,
        BLOCK_N=64, BLOCK_R=min(max(16, triton.next_power_of_2(pool.rank)), 64))
    return y
