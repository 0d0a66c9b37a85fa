"""x W^T on CPU: neuron's kernel on weights held as panels (cpu_ops.PanelWeight) for every step; on a
row-major weight, its kernel for decode batches and oneDNN for long prefills.

An fp32 CPU weight is held as panels from load (`held`), its one copy: the kernel streams a panel as
one run of memory, which at batch 1 read 36-38 GB/s on one core here against 28-29 for the row-major
tile, and from 16 rows on it skips the transposing copy the row-major path makes of every panel as it
goes; from 4 rows to 512 it was ahead of oneDNN on a packed copy, and at 512 7 % ahead of oneDNN on
the row-major weight (scripts/bench_linear.py, docs/benchmarks.md). The rest of this note is the row-major path, which
runs where the kernels are off (NEURON_NO_CPU_OPS) or not built:

torch's F.linear hands a [rows, in] x [out, in]^T product to MKL's sgemm, which takes a generic code
path on the benchmark machine's AMD CPU; oneDNN's matmul (`torch.ops.mkldnn._linear_pointwise`)
JIT-compiles for the CPU it finds (docs/benchmarks.md). Given the weight in its row-major
`[out, in]` layout it copies blocks of it into its scratch memory as it goes, so a model holds one
copy of its weights. A copy reordered once into oneDNN's blocked layout (`_reorder_linear_weight`,
an opaque tensor), which ran here before, was 5 % faster at 512 rows and 10-25 % at 32-64, but
doubled every rank's resident memory after its first prefill ("One copy of the weights"). Up to
cpu_ops.MAX_LINEAR_ROWS rows neuron's kernel is at least as fast as oneDNN on the row-major weight
(up to a fifth faster at 16-64 rows on thin layers, docs/benchmarks.md). NEURON_NO_ONEDNN keeps F.linear (the layer's
`Kernels`, as for the rest).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from neuron.layers import cpu_ops, quantized

# the fewest rows oneDNN takes where the small-batch kernel does not (switched off, not built):
# F.linear is faster below
MIN_ROWS = 5
# oneDNN builds and caches a primitive (and its scratch memory) for every row count it sees, so
# each new size of step grows the process: random step sizes of 17-2,048 rows over four small
# weights grew it by 800 MiB, and a served mix of prompt lengths by 30-80 MiB over a few thousand
# requests, without end in sight. Steps are padded up to one of a few sizes instead: PADDED_ROWS
# for the small decode batches (where the small-batch kernel does not take them), above it a
# multiple of 16, or of an eighth of the power of two below the rows, so at most 1/8 of a large
# step is padding and a model sees about 60 sizes up to 8,192 rows.
PADDED_ROWS = 16
_ONEDNN = torch.backends.mkldnn.is_available()


def linear(owner, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), through neuron's kernel for a few rows or oneDNN for many; a
    quantized weight through its own kernel (quantized.py). `owner`, the layer, holds the model's
    `kernels`, which say which of these may run."""
    kernels = owner.kernels
    if isinstance(weight, cpu_ops.PanelWeight):
        rows = x.reshape(-1, x.shape[-1])
        if cpu_ops.takes(rows) and (bias is None or cpu_ops.takes(bias)):
            y = cpu_ops.panel_linear(rows, weight, bias)
            return y if x.dim() == 2 else y.view(*x.shape[:-1], weight.n)
        return F.linear(x, weight.dequantize(x.dtype), bias)
    if not isinstance(weight, torch.Tensor):
        return quantized.linear(kernels, x, weight, bias)
    if kernels.cpu_ops and x.dim() == 2 and x.shape[0] <= cpu_ops.MAX_LINEAR_ROWS and cpu_ops.takes(x, weight) \
            and (bias is None or bias.dtype == x.dtype):
        return cpu_ops.linear(x, weight, bias)
    if not (kernels.onednn and _onednn_takes(x, weight, bias)):
        return F.linear(x, weight, bias)
    rows = x.shape[0]
    padded = padded_rows(rows)
    if padded > rows:
        x = torch.cat((x, x.new_zeros((padded - rows, x.shape[1]))))
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")[:rows]


def held(weight: quantized.Weight, kernels) -> quantized.Weight:
    """How a layer holds its weight: a 2-D fp32 CPU one as panels where the kernels run (a layer's
    `kernels.cpu_ops`, the library built), anything else as it is."""
    if (kernels.cpu_ops and isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.is_cpu
            and weight.dtype is torch.float32 and cpu_ops.library() is not None):
        return cpu_ops.PanelWeight(weight)
    return weight


def padded_rows(rows: int) -> int:
    """The step size oneDNN sees for a step of `rows` rows (see PADDED_ROWS)."""
    step = max(PADDED_ROWS, 1 << max(rows.bit_length() - 4, 0))
    return -(-rows // step) * step


def _onednn_takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """A step of many rows in fp32 on CPU, the weight's rows contiguous (oneDNN reads it in place)."""
    return (_ONEDNN and x.device.type == "cpu" and x.dim() == 2 and x.shape[0] >= MIN_ROWS
            and x.dtype == weight.dtype == torch.float32 and weight.is_contiguous()
            and (bias is None or bias.dtype == torch.float32))
