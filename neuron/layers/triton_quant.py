"""Triton kernel behind `neuron.layers.quantized` on CUDA: y = x W^T with W in neuron's quantized
layout (int8 codes, 4-bit codes two to a byte, or FP8 e4m3 bytes; a scale and optional offset per
group, optionally two-level), dequantized tile by tile in registers and never written out.

Imported on first launch only, like the other Triton kernels (Triton fixes at import whether kernels
compile or run in its interpreter). Each [BLOCK_N, BLOCK_K] tile of W is widened to float32 from its
codes exactly as `QuantizedWeight.stored` dequantizes it (s * q - z, s = top * sub), rounded to the
activations' dtype and multiplied with tl.dot, accumulating in float32: W4A16/W8A16 and FP8 weight-only.
"""

import triton
import triton.language as tl


@triton.jit
def _codes(codes_ptr, rows, cols, stride_c, row_mask, col_mask, BITS: tl.constexpr, FP8: tl.constexpr):
    """The codes of W[rows, cols] as float32 ([BLOCK_N, BLOCK_K]), FP8 ones exactly: a normal e4m3
    value's exponent rebiased (7 to 127) by integer arithmetic, a subnormal one as mantissa x 2^-9
    (no float32 subnormal, which a GPU may flush to zero)."""
    mask = row_mask[:, None] & col_mask[None, :]
    if BITS == 4:
        # groups of 32 inputs in 16 bytes: byte i holds input i (low nibble) and i + 16 (high)
        byte = (cols // 32) * 16 + cols % 16
        b = tl.load(codes_ptr + rows[:, None] * stride_c + byte[None, :], mask=mask, other=0).to(tl.int32)
        high = ((cols % 32) >= 16)[None, :]
        return tl.where(high, b >> 4, b & 15).to(tl.float32)
    b = tl.load(codes_ptr + rows[:, None] * stride_c + cols[None, :], mask=mask, other=0).to(tl.int32)
    if FP8:
        normal = (((b & 0x7F) << 20) + (120 << 23)).to(tl.float32, bitcast=True)
        value = tl.where((b & 0x78) == 0, (b & 7).to(tl.float32) * 0.001953125, normal)
        return tl.where((b & 0x80) != 0, -value, value)
    return tl.where(b >= 128, b - 256, b).to(tl.float32)  # the byte as int8


@triton.jit
def _factor(top_ptr, sub_ptr, rows, groups, stride_top, stride_sub, mask, PER_SUPER: tl.constexpr,
            HAS_SUB: tl.constexpr):
    """Each element's group factor: top[row, group // PER_SUPER] (times sub[row, group])."""
    f = tl.load(top_ptr + rows[:, None] * stride_top + (groups // PER_SUPER)[None, :], mask=mask, other=0.0)
    if HAS_SUB:
        s = tl.load(sub_ptr + rows[:, None] * stride_sub + groups[None, :], mask=mask, other=0).to(tl.float32)
        f = f * s
    return f


@triton.jit
def quant_linear_kernel(x_ptr, codes_ptr, scale_ptr, scale_sub_ptr, offset_ptr, offset_sub_ptr, bias_ptr, y_ptr,
                        M, N, K, stride_x, stride_c, stride_s, stride_ss, stride_o, stride_os, stride_y,
                        GROUP: tl.constexpr, PER_SUPER: tl.constexpr, BITS: tl.constexpr, FP8: tl.constexpr,
                        HAS_SUB: tl.constexpr, HAS_OFFSET: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = rows_m < M, rows_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        k_mask = cols < K
        mask = n_mask[:, None] & k_mask[None, :]
        x = tl.load(x_ptr + rows_m[:, None] * stride_x + cols[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0)
        q = _codes(codes_ptr, rows_n, cols, stride_c, n_mask, k_mask, BITS, FP8)
        groups = cols // GROUP
        s = _factor(scale_ptr, scale_sub_ptr, rows_n, groups, stride_s, stride_ss, mask, PER_SUPER, HAS_SUB)
        w = q * s
        if HAS_OFFSET:
            w = w - _factor(offset_ptr, offset_sub_ptr, rows_n, groups, stride_o, stride_os, mask, PER_SUPER, HAS_SUB)
        if IEEE:  # full-precision float32 products (not TF32), the weight rounded to x's dtype first
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(x.dtype).to(tl.float32)), input_precision="ieee",
                          out_dtype=tl.float32)
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)), out_dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + rows_m[:, None] * stride_y + rows_n[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])
