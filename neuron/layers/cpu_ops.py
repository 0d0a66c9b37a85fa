"""The CPU fp32 step's small-batch linear layers and element-wise passes (`csrc/cpu_ops.cpp`),
called through ctypes.

Batch-1 decode is bound by reading the weights: torch's F.linear sends a one-row product to MKL's
sgemv, which on the benchmark machine read the 191M model's weights at about 17 GB/s and took
twice as long again for two rows; the kernel here streams each weight once at 30 GB/s for up to
four rows, and from five rows on reads it from the cache once per four rows of x. From 16 rows on,
where the arithmetic binds, it transposes panels of the weight as it goes and multiplies them
without sums across vector lanes: on the same row-major weight, level with oneDNN on the 191M
model's shapes and up to a fifth faster on SmolLM2's at 16-64 rows (docs/benchmarks.md).
The layers hold an fp32 weight as panels from load (`PanelWeight`), which the same panel tiles
multiply without the copy, for any number of rows; `linear` is the row-major weight's kernel.
Between the matrix products, each element-wise pass (RMSNorm, the residual add + RMSNorm, the
per-head RMSNorm + rotary of queries and keys, silu(gate) * up) is one loop instead of several
PyTorch operations and their temporaries.

Built on first use (and by `./run install`) like the attention kernel (neuron.utils.native); where
it cannot be built `takes()` is False, and where a model's `Kernels` turns them off
(NEURON_NO_CPU_OPS) its layers do not ask: either way the callers keep their PyTorch versions. `python -m neuron.layers.cpu_ops` builds it and prints where it lies.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from neuron.utils import native
from neuron.utils.native_memory import huge_page_tensor

SOURCE = Path(__file__).parent / "csrc" / "cpu_ops.cpp"
# the most rows the kernel takes: up to here it is level with oneDNN on the 191M model's shapes and
# ahead on SmolLM2's thinner ones; at 256 rows oneDNN was 7 % faster on the 191M model's
# (scripts/bench_linear.py)
MAX_LINEAR_ROWS = 128

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "neuron_linear": [_P, _I, _I, _P, _I, _I, _I, _P, _P, _I, ctypes.c_int],
    "neuron_rms_norm": [_P, _I, _I, _I, _P, _F, _P, _I, ctypes.c_int],
    "neuron_add_rms_norm": [_P, _I, _P, _I, _I, _I, _P, _F, _P, _I, _P, _I, ctypes.c_int],
    "neuron_norm_rope": [_P, _I, _I, _I, _I, _I, _P, _F, _P, _P, _I, _P, _I, _I, ctypes.c_int],
    "neuron_silu_mul": [_P, _I, _P, _I, _I, _I, _P, _I, ctypes.c_int],
    "neuron_qlinear": [_P, _I, _I, _P, _P, _P, _I, ctypes.c_int],  # quantized.py
    "neuron_qlinear_int": [_P, _I, _I, _P, _P, _P, _I, ctypes.c_int],  # quantized.py
    "neuron_qlinear_int_stack": [_P, _I, _I, _P, _I, _P, _I, ctypes.c_int],  # cpu_decoder.py
    "neuron_qlinear_int_block": [_P, _I],  # quantized.py
    "neuron_qrows": [_P, _P, _I, _P, _I],  # quantized.py
    "neuron_qlinear_panels": [_P, _I, _I, _P, _P, _P, _I, ctypes.c_int],  # quantized.py
    "neuron_qlinear_int_many": [_P, _I, _I, _P, _P, _P, _I, ctypes.c_int],  # quantized.py
    "neuron_qlinear_int_many_takes": [_P],  # quantized.py
    "neuron_greedy": [_P, _I, _I, _I, _P],
    "neuron_panel_linear": [_P, _I, _I, _P, _P, _P, _I, ctypes.c_int],
    "neuron_panel_width": [],
    "neuron_panel_rows": [_P, _P, _I, _P, _I],
    "neuron_gguf_codes": [ctypes.c_int, _P, _I, _I, _P, _I, ctypes.c_int],  # models/gguf.py
    "neuron_delta_step": [_P, _P, _P, _I, _I, _I, _I, _P, _P, _P, _P, _P, _P, ctypes.c_int],  # gated_deltanet.py
}
_RETURNS = {"neuron_qrows": ctypes.c_int, "neuron_qlinear_int_many_takes": ctypes.c_int,
            "neuron_qlinear_int_stack": ctypes.c_int, "neuron_qlinear_int_block": ctypes.c_int,
            "neuron_panel_width": ctypes.c_int64, "neuron_panel_rows": ctypes.c_int, "neuron_gguf_codes": ctypes.c_int,
            "neuron_delta_step": ctypes.c_int}


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded library, built if this machine has none yet; None where it cannot be built."""
    lib = native.load(SOURCE, "CPU linear layers and element-wise passes run in PyTorch")
    if lib is not None:
        for name, args in _SIGNATURES.items():
            getattr(lib, name).argtypes = args
            getattr(lib, name).restype = _RETURNS.get(name)
    return lib


def takes(*tensors: torch.Tensor) -> bool:
    """Whether the kernels take these tensors: fp32 on CPU, rows contiguous, the library built.
    Asked before every kernel call, so written for a small model's step, whose host side is most of
    its time: a plain loop over cheap properties (no generator, no device object)."""
    for t in tensors:
        if not t.is_cpu or t.dtype is not torch.float32 or t.stride(-1) != 1:
            return False
    return library() is not None


_alone_rows = 0  # kernels of at most this many rows run on one thread (`few_rows_alone`); 0: none


def few_rows_alone(rows: int) -> None:
    """From now on, run the CPU kernels of a step of at most `rows` rows on one thread (0: every
    kernel on torch's count). For a rank whose OpenMP threads wait asleep because the ranks on its
    host outnumber the cores (worker.set_cpu_threads): each parallel region then wakes a sleeping
    thread, which costs a step of few rows more than the second thread gains it (docs/benchmarks.md,
    "Issue 35, sixteenth session")."""
    global _alone_rows
    _alone_rows = rows


def threads_for(rows: int) -> int:
    """The threads a CPU kernel over `rows` rows runs on: torch's count, or one (`few_rows_alone`)."""
    return 1 if rows <= _alone_rows else torch.get_num_threads()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [m, k] times weight [n, k] transposed, plus bias [n]; for the few rows of a small decode step."""
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype)
    bias = None if bias is None else bias.contiguous()  # held until the call returns
    library().neuron_linear(x.data_ptr(), m, x.stride(0), weight.data_ptr(), n, k, weight.stride(0),
                            None if bias is None else bias.data_ptr(), y.data_ptr(), n, threads_for(m))
    return y


class _PanelLayout(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("n", ctypes.c_int64), ("k", ctypes.c_int64)]


class PanelWeight:
    """An fp32 CPU weight [n, k] held as the kernel reads it best: panels of `width` outputs, each
    transposed to [k, width] and contiguous, `data[p, c, j] = W[p * width + j, c]` (the last panel
    padded with zero outputs). A batch-1 product streams each panel as one run of memory, which the
    hardware prefetcher follows at the speed of a single stream; a row-major weight is read as many
    streams at once (a tile of rows), about a quarter slower on one core (docs/benchmarks.md). The
    panels are the weight's one copy: `neuron_panel_linear` multiplies them for any number of rows,
    and `rows` reads an embedding table tied to the head from them."""

    __slots__ = ("data", "n", "layout")

    def __init__(self, weight: torch.Tensor):
        n, k = weight.shape
        width = int(library().neuron_panel_width())
        panels = -(-n // width)
        padded = weight if panels * width == n else torch.cat((weight, weight.new_zeros(panels * width - n, k)))
        self.data = huge_page_tensor((panels, k, width), torch.float32)
        self.data.copy_(padded.reshape(panels, width, k).transpose(1, 2))
        self.n = n
        self.layout = _PanelLayout(self.data.data_ptr(), n, k)

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.data.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    def tensors(self) -> list[torch.Tensor]:
        return [self.data]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W as a dense [n, k] tensor (a copy), as quantized weights give theirs."""
        return self.data.transpose(1, 2).reshape(-1, self.data.shape[1])[: self.n].to(dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows `ids` (int64, 1-D) of W, [len(ids), k]: the lookups of an embedding table tied to the head."""
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty((ids.shape[0], self.data.shape[1]), dtype=torch.float32)
        if library().neuron_panel_rows(ctypes.byref(self.layout), ids.data_ptr(), ids.shape[0], out.data_ptr(),
                                       out.stride(0)) != 0:
            raise IndexError(f"row index out of range for a table of {self.n} rows")
        return out if dtype is torch.float32 else out.to(dtype)

    def __repr__(self) -> str:
        return f"PanelWeight(shape={self.shape}, width={self.data.shape[2]})"


def panel_linear(x: torch.Tensor, weight: PanelWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [m, k] (fp32, rows contiguous) times the panels' W transposed, plus bias [n]; any m."""
    m = x.shape[0]
    y = torch.empty((m, weight.n), dtype=torch.float32)
    bias = None if bias is None else bias.contiguous()  # held until the call returns
    library().neuron_panel_linear(x.data_ptr(), m, x.stride(0), ctypes.byref(weight.layout),
                                  None if bias is None else bias.data_ptr(), y.data_ptr(), weight.n, threads_for(m))
    return y


def greedy(x: torch.Tensor) -> torch.Tensor:
    """Each row's argmax as int64 [rows], -1 where the row holds a NaN or nothing above -inf; x fp32
    [rows, width], rows contiguous (`takes`). A 32,000-token row takes microseconds here against
    tens of them for torch's max(dim)."""
    rows, width = x.shape
    out = torch.empty(rows, dtype=torch.int64)
    library().neuron_greedy(x.data_ptr(), rows, x.stride(0), width, out.data_ptr())
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    width = x.shape[-1]
    rows = x.reshape(-1, width)
    out = torch.empty(rows.shape, dtype=x.dtype)
    library().neuron_rms_norm(rows.data_ptr(), rows.shape[0], rows.stride(0), width, weight.data_ptr(), eps,
                              out.data_ptr(), width, threads_for(rows.shape[0]))
    return out.view(x.shape)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    rows, width = x.shape
    total = torch.empty((rows, width), dtype=x.dtype)
    out = torch.empty_like(total)
    library().neuron_add_rms_norm(x.data_ptr(), x.stride(0), delta.data_ptr(), delta.stride(0), rows, width,
                                  weight.data_ptr(), eps, total.data_ptr(), width, out.data_ptr(), width,
                                  threads_for(rows))
    return total, out


def norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
              sin: torch.Tensor) -> torch.Tensor:
    """Each head's RMSNorm (none where `weight` is None), then the rotary embedding."""
    tokens, heads, head_dim = x.shape
    cos, sin = cos.reshape(tokens, head_dim), sin.reshape(tokens, head_dim)
    if cos.stride() != sin.stride() or cos.stride(-1) != 1:
        cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty((tokens, heads, head_dim), dtype=x.dtype)
    library().neuron_norm_rope(x.data_ptr(), tokens, heads, x.stride(0), x.stride(1), head_dim,
                               None if weight is None else weight.data_ptr(),
                               eps, cos.data_ptr(), sin.data_ptr(), cos.stride(0), out.data_ptr(), heads * head_dim,
                               head_dim, threads_for(tokens))
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    rows, width = gate.shape
    out = torch.empty((rows, width), dtype=gate.dtype)
    library().neuron_silu_mul(gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0), rows, width,
                              out.data_ptr(), width, threads_for(rows))
    return out


if __name__ == "__main__":
    if library() is None:
        raise SystemExit("the CPU kernels could not be built here; see the warning above")
    print(native.build(SOURCE))


def gguf_codes(kind: int, blocks, out_bytes: int) -> torch.Tensor | None:
    """GGUF blocks of ggml type `kind` ([rows, blocks, bytes] uint8, numpy) rewritten into neuron's
    codes, `out_bytes` a block, [rows, blocks * out_bytes] uint8 (csrc/gguf_codes.h); None where the
    library is not built or does not rewrite the type (the caller decodes with numpy)."""
    import numpy as np

    lib = library()
    if lib is None:
        return None
    blocks = np.ascontiguousarray(blocks)
    rows, n, size = blocks.shape
    out = torch.empty(rows, n * out_bytes, dtype=torch.uint8)
    done = lib.neuron_gguf_codes(kind, blocks.ctypes.data, rows * n, size, out.data_ptr(), out_bytes,
                                 torch.get_num_threads())
    return out if done == 0 else None


def delta_step(state: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor | None:
    """The gated delta rule's one-token update in place on `state` [slots, heads, dk, dv] (the rows
    `slots` int64 [B], zeroed first where `fresh` uint8 [B]), and its output [B, heads, dv]
    (csrc/delta_step.h); None where the library is not built or the tensors are not fp32 and
    contiguous on the CPU (the caller keeps PyTorch's way)."""
    lib = library()
    if lib is None or not takes(state, q, k, v, g, beta) or not all(
            t.is_contiguous() for t in (state, q, k, v, g, beta)):
        return None
    batch, heads, dk = q.shape
    dv = v.shape[-1]
    out = torch.empty(batch, heads, dv, dtype=torch.float32)
    done = lib.neuron_delta_step(state.data_ptr(), slots.data_ptr(), fresh.data_ptr(), batch, heads, dk, dv,
                                 q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(),
                                 out.data_ptr(), torch.get_num_threads())
    return out if done == 0 else None
