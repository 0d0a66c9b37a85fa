"""Triton kernels behind `neuron.layers.norm`: RMSNorm, RMSNorm after the residual add, RMSNorm
followed by the rotary embedding, and the MLP's silu(gate) * up.

Imported on first launch only, like triton_attention (Triton fixes at import whether kernels
compile or run in its interpreter). All compute in float32 and round where the reference does
(transformers' Qwen3 modules in the model's dtype): the normalised row is rounded to the model's
dtype before the weight multiplies it, and in the rotary step each product is rounded before the
sum, so in bf16 the kernels give the reference's values, not values one rounding closer. The same
holds for the residual sum and the activation: rounded where PyTorch's separate operations round.
"""

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def _normalised(x_ptr, w_ptr, cols, mask, n_cols, inv_rms, OUT_DTYPE: tl.constexpr):
    """Row elements `cols` normalised by `inv_rms`, rounded, times the weight, rounded."""
    x = tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return ((x * inv_rms).to(OUT_DTYPE).to(tl.float32) * w).to(OUT_DTYPE).to(tl.float32)


@triton.jit
def rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_out, n_cols, eps, BLOCK: tl.constexpr):
    """One program per row of a [rows, n_cols] tensor."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    inv_rms = 1.0 / tl.sqrt_rn(tl.sum(x * x, 0) / n_cols + eps)
    out_dtype = out_ptr.dtype.element_ty
    y = _normalised(x_ptr + row * stride_x, w_ptr, cols, mask, n_cols, inv_rms, out_dtype)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_dtype), mask=mask)


@triton.jit
def norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, stride_xt, stride_xh, stride_ot, stride_oh,
                     stride_rope, head_dim, eps, BLOCK: tl.constexpr):
    """One program per (token, head) of x [tokens, heads, head_dim]: RMSNorm over head_dim, then the
    rotary embedding with the token's cos and sin rows ([tokens, head_dim]); `rotate_half` pairs
    element i with element i + head_dim / 2."""
    token, head = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    half = head_dim // 2
    cols = tl.arange(0, BLOCK)
    mask = cols < head_dim
    partner = tl.where(cols < half, cols + half, cols - half)
    row_ptr = x_ptr + token * stride_xt + head * stride_xh
    x = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    inv_rms = 1.0 / tl.sqrt_rn(tl.sum(x * x, 0) / head_dim + eps)
    out_dtype = out_ptr.dtype.element_ty
    y = _normalised(row_ptr, w_ptr, cols, mask, head_dim, inv_rms, out_dtype)
    y_partner = _normalised(row_ptr, w_ptr, partner, mask, head_dim, inv_rms, out_dtype)
    rotated = tl.where(cols < half, -y_partner, y_partner)
    cos = tl.load(cos_ptr + token * stride_rope + cols, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_rope + cols, mask=mask, other=0.0).to(tl.float32)
    out = (y * cos).to(out_dtype).to(tl.float32) + (rotated * sin).to(out_dtype).to(tl.float32)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + cols, out.to(out_dtype), mask=mask)


@triton.jit
def add_rms_norm_kernel(x_ptr, delta_ptr, w_ptr, sum_ptr, out_ptr, stride_x, stride_delta, stride_sum,
                        stride_out, n_cols, eps, BLOCK: tl.constexpr):
    """One program per row: the residual sum x + delta, rounded to the model's dtype and stored,
    then RMSNorm of that rounded sum (transformers adds in the model's dtype, then normalises)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    out_dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    delta = tl.load(delta_ptr + row * stride_delta + cols, mask=mask, other=0.0).to(tl.float32)
    total = (x + delta).to(out_dtype)
    tl.store(sum_ptr + row * stride_sum + cols, total, mask=mask)
    total = total.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt_rn(tl.sum(total * total, 0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = ((total * inv_rms).to(out_dtype).to(tl.float32) * w).to(out_dtype)
    tl.store(out_ptr + row * stride_out + cols, y, mask=mask)


@triton.jit
def silu_mul_kernel(gate_ptr, up_ptr, out_ptr, stride_gate, stride_up, stride_out, n_cols, BLOCK: tl.constexpr,
                    LIBDEVICE: tl.constexpr):
    """silu(gate) * up over a block of one row, each rounded to the model's dtype as PyTorch's two
    operations round."""
    row, block = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    out_dtype = out_ptr.dtype.element_ty
    gate = tl.load(gate_ptr + row * stride_gate + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * stride_up + cols, mask=mask, other=0.0).to(tl.float32)
    # PyTorch's silu: x / (1 + exp(-x)) with the accurate expf and an IEEE division; Triton's own exp
    # and `/` are the fast approximations, which flipped fp16 roundings on a GPU. Triton's CPU
    # interpreter (the tests without a GPU) has no libdevice; its exp is numpy's.
    if LIBDEVICE:
        exp = libdevice.exp(-gate)
    else:
        exp = tl.exp(-gate)
    activated = tl.math.div_rn(gate, 1.0 + exp).to(out_dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (activated * up).to(out_dtype), mask=mask)
