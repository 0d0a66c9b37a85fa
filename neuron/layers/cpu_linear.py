"""x W^T on CPU: neuron's own kernel for a few rows, oneDNN for many, both on the one row-major weight.

torch's F.linear hands a [rows, in] x [out, in]^T product to MKL's sgemm, which takes a generic code
path on the benchmark machine's AMD CPU; oneDNN's matmul (`torch.ops.mkldnn._linear_pointwise`)
JIT-compiles for the CPU it finds (docs/benchmarks.md). Given the weight in its row-major
`[out, in]` layout it copies blocks of it into its scratch memory as it goes, so a model holds one
copy of its weights. A copy reordered once into oneDNN's blocked layout (`_reorder_linear_weight`,
an opaque tensor), which ran here before, was 5 % faster at 512 rows and 10-25 % at 32-64, but
doubled every rank's resident memory after its first prefill ("One copy of the weights"). Up to
cpu_ops.MAX_LINEAR_ROWS rows (decode batches) neuron's kernel beats oneDNN on the row-major
weight. NEURON_NO_ONEDNN keeps F.linear (the layer's `Kernels`, as for the rest).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from neuron.layers import cpu_ops, quantized

# the fewest rows oneDNN takes where the small-batch kernel does not (switched off, not built):
# F.linear is faster below
MIN_ROWS = 5
# oneDNN builds and caches a primitive (and its scratch memory) for every row count it sees, so
# each new size of step grows the process; steps of fewer rows than this are padded up to it,
# which keeps the small decode batches on one primitive per weight shape at little cost
PADDED_ROWS = 16
_ONEDNN = torch.backends.mkldnn.is_available()


def linear(owner, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), through neuron's kernel for a few rows or oneDNN for many; a
    quantized weight through its own kernel (quantized.py). `owner`, the layer, holds the model's
    `kernels`, which say which of these may run."""
    kernels = owner.kernels
    if not isinstance(weight, torch.Tensor):
        return quantized.linear(kernels, x, weight, bias)
    if kernels.cpu_ops and x.dim() == 2 and x.shape[0] <= cpu_ops.MAX_LINEAR_ROWS and cpu_ops.takes(x, weight) \
            and (bias is None or bias.dtype == x.dtype):
        return cpu_ops.linear(x, weight, bias)
    if not (kernels.onednn and _onednn_takes(x, weight, bias)):
        return F.linear(x, weight, bias)
    rows = x.shape[0]
    if rows < PADDED_ROWS:
        x = torch.cat((x, x.new_zeros((PADDED_ROWS - rows, x.shape[1]))))
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")[:rows]


def _onednn_takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """A step of many rows in fp32 on CPU, the weight's rows contiguous (oneDNN reads it in place)."""
    return (_ONEDNN and x.device.type == "cpu" and x.dim() == 2 and x.shape[0] >= MIN_ROWS
            and x.dtype == weight.dtype == torch.float32 and weight.is_contiguous()
            and (bias is None or bias.dtype == torch.float32))
