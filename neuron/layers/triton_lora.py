"""Triton kernels behind `neuron.layers.lora` on CUDA: the adapters' contribution to a step's rows,
y[t] += (x[t] A[slot]^T) B^T[slot], as a shrink (x A^T, [rows, parts * rank]) and an expand (times
B^T, added into y), the shape of Punica's SGMV.

Imported on first launch only, like the other Triton kernels (Triton fixes at import whether kernels
compile or run in its interpreter). The rows arrive sorted by adapter (`LoraRows.dest`, each
adapter's run from `starts[u]` to `starts[u + 1]`); a program takes up to BLOCK_M rows of one
adapter, so every tile multiplies one adapter's matrices with tl.dot, accumulating in float32. The
shrink's output is rounded to the activations' dtype, and the expand's sum before it is added to y,
where the grouped PyTorch product (`LoraPool.add_grouped`, the reference) rounds. The base model's
rows are in no run and are never touched.
"""

import triton
import triton.language as tl


@triton.jit
def _run_rows(starts_ptr, dest_ptr, u, pid_m, BLOCK_M: tl.constexpr):
    """The entries of adapter u's run this program takes, which of them exist, and their rows of y."""
    end = tl.load(starts_ptr + u + 1)
    entries = tl.load(starts_ptr + u) + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = entries < end
    rows = tl.load(dest_ptr + entries, mask=valid, other=0).to(tl.int64)
    return entries, valid, rows


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:  # full-precision float32 products, not TF32 (and the interpreter, whose dot mishandles bfloat16)
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee", out_dtype=tl.float32)
    return tl.dot(a, b, out_dtype=tl.float32)


@triton.jit
def lora_shrink_kernel(x_ptr, a_ptr, slots_ptr, starts_ptr, dest_ptr, h_ptr, K, WIDTH, stride_x, stride_as,
                       stride_aw, stride_h, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    """h[entry] = x[row] A[slot]^T for BLOCK_M entries of one adapter's run and BLOCK_W of its columns."""
    u, pid_m, pid_w = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if tl.load(starts_ptr + u) + pid_m * BLOCK_M >= tl.load(starts_ptr + u + 1):
        return  # a run shorter than the step's longest
    entries, valid, rows = _run_rows(starts_ptr, dest_ptr, u, pid_m, BLOCK_M)
    a_ptr += tl.load(slots_ptr + u).to(tl.int64) * stride_as
    cols = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
    col_mask = cols < WIDTH
    acc = tl.zeros((BLOCK_M, BLOCK_W), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=valid[:, None] & k_mask[None, :], other=0.0)
        a = tl.load(a_ptr + cols[:, None] * stride_aw + ks[None, :], mask=col_mask[:, None] & k_mask[None, :],
                    other=0.0)
        acc += _dot(x, tl.trans(a), IEEE)
    out = h_ptr + entries[:, None] * stride_h + cols[None, :]
    tl.store(out, acc.to(h_ptr.dtype.element_ty), mask=valid[:, None] & col_mask[None, :])


@triton.jit
def lora_expand_kernel(h_ptr, bt_ptr, bounds_ptr, slots_ptr, starts_ptr, dest_ptr, y_ptr, N, RANK, stride_h,
                       stride_bs, stride_bw, stride_y, PARTS: tl.constexpr, IEEE: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    """y[row, cols] += h[entry] B^T[slot][:, cols] for BLOCK_M entries of one adapter's run. B^T is
    block-diagonal (part p's RANK rows are zero outside its outputs, `bounds` [PARTS, 2]: start,
    size), so only the parts whose outputs meet this program's BLOCK_N columns are read."""
    u, pid_m, pid_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if tl.load(starts_ptr + u) + pid_m * BLOCK_M >= tl.load(starts_ptr + u + 1):
        return
    entries, valid, rows = _run_rows(starts_ptr, dest_ptr, u, pid_m, BLOCK_M)
    bt_ptr += tl.load(slots_ptr + u).to(tl.int64) * stride_bs
    first = pid_n * BLOCK_N
    cols = first + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for p in tl.static_range(PARTS):
        start = tl.load(bounds_ptr + 2 * p)
        # a part that misses these columns runs no iteration: its rows of B^T are zero here
        span = tl.where((start < first + BLOCK_N) & (start + tl.load(bounds_ptr + 2 * p + 1) > first), RANK, 0)
        for r0 in range(0, span, BLOCK_R):
            rs = r0 + tl.arange(0, BLOCK_R)
            r_mask = rs < RANK
            h = tl.load(h_ptr + entries[:, None] * stride_h + (p * RANK + rs)[None, :],
                        mask=valid[:, None] & r_mask[None, :], other=0.0)
            b = tl.load(bt_ptr + (p * RANK + rs)[:, None] * stride_bw + cols[None, :],
                        mask=r_mask[:, None] & col_mask[None, :], other=0.0)
            acc += _dot(h, b, IEEE)
    out = y_ptr + rows[:, None] * stride_y + cols[None, :]
    mask = valid[:, None] & col_mask[None, :]
    dtype = y_ptr.dtype.element_ty
    y = tl.load(out, mask=mask, other=0.0).to(tl.float32)
    tl.store(out, (y + acc.to(dtype).to(tl.float32)).to(dtype), mask=mask)
