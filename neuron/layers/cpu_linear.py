"""x W^T on CPU: neuron's own kernel for a few rows, oneDNN with W prepacked once for many.

torch's F.linear hands a [rows, in] x [out, in]^T product to MKL's sgemm, which re-reads the
weight in its row-major layout every call; oneDNN's inner-product with the weight reordered once
into its blocked layout ran a 64 x 1024 x 6144 decode GEMM at 98 GFLOP/s against F.linear's 40 on
the 2-core benchmark machine, and the 191M model's offline throughput went from 162-166 to 234-241
output tok/s (docs/benchmarks.md). For a few rows (small-batch decode) both lose to a kernel that
streams the row-major weight once (cpu_ops.linear, up to cpu_ops.MAX_LINEAR_ROWS rows); from
MIN_ROWS rows up, oneDNN leads. The packed copy is a second copy of each weight, made on a
layer's first large step; NEURON_NO_ONEDNN turns it off (the layer's `Kernels`, as for the rest).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from neuron.layers import cpu_ops, quantized

MIN_ROWS = cpu_ops.MAX_LINEAR_ROWS + 1
# oneDNN builds and caches a primitive (and its scratch memory) for every row count it sees, so
# each new size of step grows the process: random step sizes of 17-2,048 rows over four small
# weights grew it by 800 MiB, and a served mix of prompt lengths by 30-80 MiB over a few thousand
# requests, without end in sight. Steps are padded up to one of a few sizes instead: PADDED_ROWS
# for the small decode batches (a 16-row step of the 191M model's weights takes 25.7 ms against
# 20.4 ms for 8 rows), above it a multiple of 16, or of an eighth of the power of two below the
# rows, so at most 1/8 of a large step is padding and a model sees about 60 sizes up to 8,192 rows.
PADDED_ROWS = 16


def linear(owner, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), through neuron's kernel for a few rows, or `owner`'s packed copy of
    `weight` where that pays; a quantized weight through its own kernel (quantized.py). `owner`, the
    layer, holds the model's `kernels`, which say which of these may run."""
    kernels = owner.kernels
    if not isinstance(weight, torch.Tensor):
        return quantized.linear(kernels, x, weight, bias)
    if kernels.cpu_ops and x.dim() == 2 and x.shape[0] <= cpu_ops.MAX_LINEAR_ROWS and cpu_ops.takes(x, weight) \
            and (bias is None or bias.dtype == x.dtype):
        return cpu_ops.linear(x, weight, bias)
    if not _large_cpu_fp32(x, weight):
        return F.linear(x, weight, bias)
    cached = getattr(owner, "_onednn", None)
    if cached is None or cached[0] is not weight:  # first use, or the layer's weight was replaced
        cached = (weight, _pack(weight) if kernels.onednn else None)
        owner._onednn = cached
    if cached[1] is None:
        return F.linear(x, weight, bias)
    rows = x.shape[0]
    padded = padded_rows(rows)
    if padded > rows:
        x = torch.cat((x, x.new_zeros((padded - rows, x.shape[1]))))
    return torch.ops.mkldnn._linear_pointwise(x, cached[1], bias, "none", [], "")[:rows]


def padded_rows(rows: int) -> int:
    """The step size oneDNN sees for a step of `rows` rows (see PADDED_ROWS)."""
    step = max(PADDED_ROWS, 1 << max(rows.bit_length() - 4, 0))
    return -(-rows // step) * step


def _large_cpu_fp32(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dim() == 2 and x.shape[0] >= MIN_ROWS
            and x.dtype == weight.dtype == torch.float32)


def _pack(weight: torch.Tensor) -> torch.Tensor | None:
    if not torch.backends.mkldnn.is_available():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)
