"""RMSNorm (alone, and after the residual add), the per-head RMSNorm + rotary embedding that Qwen3
applies to queries and keys, and the MLP's silu(gate) * up.

In PyTorch each is a handful of small operations (an upcast, the norm, a downcast, the weight;
then a negation, a concatenation, two products and a sum for the rotation), and at batch 1 each
costs a kernel launch and a trip through memory. On CUDA with Triton installed, one kernel does
each (neuron/layers/triton_norm.py), rounding where the PyTorch version rounds; on CPU in fp32,
one C++ loop (neuron/layers/cpu_ops.py); elsewhere the PyTorch version runs, and is the reference
the kernels are tested against. Which of them may run is the model's `Kernels`, the first argument.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from neuron.layers import cpu_ops
from neuron.layers.kernels import Kernels
from neuron.layers.paged_attention import HAS_TRITON


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' order: normalise in float32, round to x's dtype, then multiply by the weight."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def add_rms_norm_reference(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    total = x + delta
    return total, rms_norm_reference(total, weight, eps)


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def rms_norm(kernels: Kernels, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of x."""
    if _kernel_applies(kernels, x, "rms_norm"):
        return rms_norm_triton(x, weight, eps)
    if kernels.cpu_ops and weight.shape == x.shape[-1:] and cpu_ops.takes(x, weight):
        return cpu_ops.rms_norm(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def norm_rope(kernels: Kernels, x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
              sin: torch.Tensor) -> torch.Tensor:
    """RMSNorm over each head of x ([tokens, heads, head_dim]), then the rotary embedding with each
    token's cos and sin ([tokens, 1, head_dim] or [tokens, head_dim])."""
    if _kernel_applies(kernels, x, "norm_rope"):
        return norm_rope_triton(x, weight, eps, cos, sin)
    if (kernels.cpu_ops and x.dim() == 3 and x.shape[-1] % 2 == 0 and cos.shape[-1] == x.shape[-1] and weight.shape == x.shape[-1:]
            and cos.numel() == x.shape[0] * x.shape[-1] and cpu_ops.takes(x, weight, cos, sin)):
        return cpu_ops.norm_rope(x, weight, eps, cos, sin)
    return apply_rotary(rms_norm_reference(x, weight, eps), cos, sin)


def rope_heads(kernels: Kernels, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding of each head of x ([tokens, heads, head_dim]) with each token's cos and
    sin, in one pass on CPU (a model without per-head norms: Llama, Mistral, Qwen2)."""
    if (kernels.cpu_ops and x.dim() == 3 and x.shape[-1] % 2 == 0 and cos.shape[-1] == x.shape[-1]
            and cos.numel() == x.shape[0] * x.shape[-1] and cpu_ops.takes(x, cos, sin)):
        return cpu_ops.norm_rope(x, None, 0.0, cos, sin)
    return apply_rotary(x, cos, sin)


def add_rms_norm(kernels: Kernels, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual sum x + delta ([tokens, hidden]) and its RMSNorm."""
    if _kernel_applies(kernels, x, "add_rms_norm") and delta.stride(-1) == 1 and x.dim() == 2:
        return add_rms_norm_triton(x, delta, weight, eps)
    if kernels.cpu_ops and x.dim() == 2 and delta.shape == x.shape and weight.shape == x.shape[-1:] and cpu_ops.takes(x, delta, weight):
        return cpu_ops.add_rms_norm(x, delta, weight, eps)
    return add_rms_norm_reference(x, delta, weight, eps)


def silu_mul(kernels: Kernels, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, both [tokens, width] (the halves of a merged projection's output)."""
    if _kernel_applies(kernels, gate, "silu_mul") and up.stride(-1) == 1 and gate.dim() == 2:
        return silu_mul_triton(gate, up)
    if kernels.cpu_ops and gate.dim() == 2 and up.shape == gate.shape and cpu_ops.takes(gate, up):
        return cpu_ops.silu_mul(gate, up)
    return silu_mul_reference(gate, up)


def _kernel_applies(kernels: Kernels, x: torch.Tensor, piece: str) -> bool:
    """The piece's Triton kernel takes x: a CUDA tensor, Triton installed, the kernel trusted here."""
    return x.is_cuda and HAS_TRITON and x.stride(-1) == 1 and kernels.triton(piece)


def _launch_shape(width: int) -> tuple[int, int]:
    """A row's block (a power of two) and the warps that cover it."""
    block = 1 << max(width - 1, 0).bit_length()
    return block, min(max(block // 256, 1), 16)


# The kernels round where PyTorch's separate operations round. Triton contracts a product and the
# sum after it into one fused multiply-add by default, which skips the product's rounding: on a GPU
# the rotary step's first product then went unrounded and 14-19% of bf16/fp16 outputs differed from
# transformers' by up to a unit of the terms. Contraction is off for these memory-bound kernels.
_ROUNDED = {"enable_fp_fusion": False}


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    from neuron.layers.triton_norm import rms_norm_kernel

    width = x.shape[-1]
    rows = x.reshape(-1, width)  # a view for every layout the models pass
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    block, warps = _launch_shape(width)
    rms_norm_kernel[(rows.shape[0],)](rows, weight, out, rows.stride(0), out.stride(0), width, eps,
                                      BLOCK=block, num_warps=warps, **_ROUNDED)
    return out.view(x.shape)


def norm_rope_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                     sin: torch.Tensor) -> torch.Tensor:
    from neuron.layers.triton_norm import norm_rope_kernel

    tokens, heads, head_dim = x.shape
    if head_dim % 2:
        raise ValueError(f"the rotary embedding needs an even head_dim, got {head_dim}")
    cos, sin = cos.reshape(tokens, head_dim), sin.reshape(tokens, head_dim)
    if cos.stride() != sin.stride() or cos.stride(-1) != 1:
        cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty((tokens, heads, head_dim), dtype=x.dtype, device=x.device)
    block, warps = _launch_shape(head_dim)
    norm_rope_kernel[(tokens, heads)](x, weight, cos, sin, out, x.stride(0), x.stride(1), out.stride(0),
                                      out.stride(1), cos.stride(0), head_dim, eps, BLOCK=block, num_warps=warps,
                                      **_ROUNDED)
    return out


def add_rms_norm_triton(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    from neuron.layers.triton_norm import add_rms_norm_kernel

    rows, width = x.shape
    total = torch.empty((rows, width), dtype=x.dtype, device=x.device)
    out = torch.empty_like(total)
    block, warps = _launch_shape(width)
    add_rms_norm_kernel[(rows,)](x, delta, weight, total, out, x.stride(0), delta.stride(0), total.stride(0),
                                 out.stride(0), width, eps, BLOCK=block, num_warps=warps, **_ROUNDED)
    return total, out


_SILU_BLOCK = 1024  # columns per program: a row of a wide MLP spreads over several programs


def silu_mul_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    from neuron.layers.triton_norm import silu_mul_kernel

    rows, width = gate.shape
    out = torch.empty((rows, width), dtype=gate.dtype, device=gate.device)
    block = min(_SILU_BLOCK, _launch_shape(width)[0])
    silu_mul_kernel[(rows, -(-width // block))](gate, up, out, gate.stride(0), up.stride(0), out.stride(0), width,
                                               BLOCK=block, LIBDEVICE=gate.is_cuda, num_warps=4, **_ROUNDED)
    return out
