"""Weights kept quantized in memory: codes with a scale (and an offset) per group of inputs.

Every format neuron reads lands in one layout, `QuantizedWeight`:

    W[n, c] = s(n, g) * q[n, c] - z(n, g),   g = c // group

with q int8 codes (`bits` 8), FP8 e4m3 bytes (`bits` 8, `fp8`), or 4-bit codes packed two to a
byte (`bits` 4: in each group of 32 inputs byte i holds input i in its low nibble and input i + 16
in its high one, values 0..15, as GGUF's Q4_0 stores them). s is a float per `per_super` groups,
times an int8 sub-scale per group where the format has two levels (GGUF's K-quants); z likewise,
or absent. s and z are float32, or float16 where the file stores them so (GGUF's blocks: kept as
they are, so a Q8_0 row is 34 bytes per 32 inputs as in the file, not 36). Load-time int8 is the
case group = k (one scale per output row); GGUF's Q8_0 is group 32; Q4_K is 4-bit codes in groups
of 32 under super-blocks of 256; Q2_K, Q3_K and the IQ4 types are int8 codes (2- and 3-bit values,
codebook values) under the same two-level factors. Groups that are not runs of consecutive inputs
(GPTQ's act-order) are stored gathered, with `input_index` saying which input each stored column
multiplies.

A CPU step of up to MAX_KERNEL_ROWS rows multiplies through neuron's C++ kernels, which read 1 or
0.5 bytes per weight instead of 4: for int8 and 4-bit codes by default `neuron_qlinear_int`
(csrc/qlinear_int.h), which rounds the activations to int8 per 32 inputs (per 256 for the
K-quants' two-level scales at a few rows, in builds without VNNI) and multiplies integers (within a stated
error of the reference, tests/test_quant_int.py); for FP8 codes, or everywhere
with NEURON_QUANT_EXACT, `neuron_qlinear` (csrc/cpu_ops.cpp), which widens and scales each weight
vector to fp32 as it streams past (the reference's sums up to their order). A CPU step of more
rows (`kernel_rows`: a prefill, a large decode batch) runs `many_kernel`: where the build takes W's
codes `neuron_qlinear_int_many`, which repacks W a panel at a time and multiplies the rounded
activations in integer tiles (the decode kernel's bound; 4-bit codes with AVX-512 or AVX2, int8
codes too with VNNI; AVX2 without VNNI runs the decode kernel itself), else `neuron_qlinear_panels`,
which dequantizes W two panels of outputs at a time into a per-thread buffer and multiplies them
there as fp32 weights are multiplied (`cpu_ops.PanelWeight`), exact. A CUDA step goes through the
Triton kernel (triton_quant.py) once the start-up self-check passed it; every other case (FP8 or
gathered codes past MAX_KERNEL_ROWS, NEURON_NO_QUANT_KERNELS, a kernel the self-check failed)
dequantizes and multiplies, the reference the kernels are checked against.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from neuron.layers import cpu_ops
from neuron.layers.kernels import Kernels
from neuron.layers.paged_attention import HAS_TRITON

# Rows of x up to which the kernel runs; above, the arithmetic binds and a kernel built for many rows
# takes the step (`many_kernel`, docs/benchmarks.md).
MAX_KERNEL_ROWS = 32
# The same for the integer kernel on two-level (K-quant) factors, whose dequantization into panels
# costs more: a SmolLM2-shaped layer in Q4_K took 1.02 / 1.26 / 2.42 ms through the integer kernel
# at 33 / 64 / 128 rows against 1.01-1.33 / 1.54-1.57 / 2.68 through the panels, level from 256 on
# (docs/benchmarks.md). The panels stay exact, so a prefill's chunks keep them.
MAX_KERNEL_ROWS_TWO_LEVEL = 128
# The same where the integer kernel for many rows takes W (`many_kernel`): it
# is level with the decode kernel at 8-10 rows and faster from there (a SmolLM2-shaped layer in
# Q4_1 at 12 / 16 / 32 rows: 0.18 / 0.21 / 0.32 ms against 0.25 / 0.31 / 0.59, docs/benchmarks.md).
MAX_KERNEL_ROWS_BEFORE_MANY = 8
MAX_PER_SUPER = 16  # csrc/cpu_ops.cpp's MAX_PER_SUPER


@dataclass(slots=True)
class QuantizedWeight:
    codes: torch.Tensor  # uint8 [n, k] (int8 codes as bytes) or [n, k // 2] (4-bit)
    k: int
    bits: int
    group: int
    scale: torch.Tensor  # float32 or float16 [n, groups // per_super]
    per_super: int = 1
    scale_sub: torch.Tensor | None = None  # int8 [n, groups]
    offset: torch.Tensor | None = None  # [n, groups // per_super], scale's dtype
    offset_sub: torch.Tensor | None = None  # int8 [n, groups]
    format: str = "int8"  # what it was read or quantized as, for messages and logs
    fp8: bool = False  # codes are FP8 e4m3 bytes (bits 8), not integers
    # Stored column j multiplies input input_index[j] (the input width: a zero input, padding):
    # groups that are not runs of consecutive inputs (GPTQ's act-order, g_idx) gathered into runs.
    input_index: torch.Tensor | None = None
    inputs: int = 0  # the layer's input width where input_index is set
    # the kernel's view, made on first use; False where the kernel cannot take this weight
    layout: object = field(default=None, init=False, repr=False, compare=False)
    # whether neuron_qlinear_int_many takes it (asked of the library once)
    many_int: bool | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], (self.k if self.input_index is None else self.inputs)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.codes, self.scale, self.scale_sub, self.offset, self.offset_sub) if t is not None]

    def _map(self, fn) -> "QuantizedWeight":
        def opt(t):
            return None if t is None else fn(t)
        return replace(self, codes=fn(self.codes), scale=fn(self.scale), scale_sub=opt(self.scale_sub),
                       offset=opt(self.offset), offset_sub=opt(self.offset_sub))

    def to(self, device) -> "QuantizedWeight":
        """On `device`; off the CPU, float16 factors become float32 (the Triton kernel's case)."""
        index = None if self.input_index is None else self.input_index.to(device)
        moved = self._map(lambda t: t.to(device).contiguous())
        if moved.codes.is_cpu or self.scale.dtype is not torch.float16:
            return replace(moved, input_index=index)
        return replace(moved, scale=moved.scale.float(), offset=None if moved.offset is None else moved.offset.float(),
                       input_index=index)

    def take_rows(self, index: torch.Tensor) -> "QuantizedWeight":
        return self._map(lambda t: t[index])

    def pad_rows(self, rows: int) -> "QuantizedWeight":
        """Zero rows appended up to `rows` (a vocabulary shard's padding): zero scales and offsets."""
        extra = rows - self.codes.shape[0]
        return self if extra <= 0 else self._map(lambda t: torch.cat((t, t.new_zeros((extra, t.shape[1])))))

    def codes_int(self) -> torch.Tensor:
        """The codes as numbers, [n, k]: int32, or float32 for FP8."""
        if self.fp8:
            return self.codes.view(torch.float8_e4m3fn).to(torch.float32)
        if self.bits == 8:
            return self.codes.view(torch.int8).to(torch.int32)
        n = self.codes.shape[0]
        blocks = self.codes.reshape(n, -1, 16).to(torch.int32)
        return torch.cat((blocks & 15, blocks >> 4), dim=-1).reshape(n, self.k)

    def _factor(self, top: torch.Tensor, sub: torch.Tensor | None) -> torch.Tensor:
        """A per-group factor (scale or offset), [n, groups] float32."""
        f = top.float().repeat_interleave(self.per_super, dim=1)
        return f if sub is None else f * sub.to(torch.float32)

    def stored(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The stored columns dequantized, [n, k] (in input_index's order where that is set)."""
        n = self.codes.shape[0]
        q = self.codes_int().to(torch.float32).reshape(n, -1, self.group)
        w = q * self._factor(self.scale, self.scale_sub).unsqueeze(-1)
        if self.offset is not None:
            w = w - self._factor(self.offset, self.offset_sub).unsqueeze(-1)
        return w.reshape(n, self.k).to(dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W as a dense [n, inputs] tensor: the reference every kernel is checked against."""
        w = self.stored(dtype)
        if self.input_index is None:
            return w
        out = w.new_zeros((w.shape[0], self.inputs + 1))
        out[:, self.input_index] = w  # padding columns all land on the last, dropped
        return out[:, :self.inputs]

    def rows(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows `ids` (int64, 1-D) dequantized, [len(ids), inputs]: `take_rows(ids).dequantize(dtype)`,
        in one call of the CPU kernel where it takes W (an embedding lookup per step otherwise runs
        a dozen small PyTorch operations)."""
        if ids.is_cpu and ids.dtype is torch.int64 and ids.dim() == 1 and ids.stride(0) == 1 and self.rows_layout():
            out = torch.empty((ids.shape[0], self.k), dtype=torch.float32)
            if cpu_ops.library().neuron_qrows(ctypes.byref(self.layout), ids.data_ptr(), ids.shape[0], out.data_ptr(),
                                              out.stride(0)) != 0:
                raise IndexError(f"row index out of range for a table of {self.codes.shape[0]} rows")
            return out if dtype is torch.float32 else out.to(dtype)
        return self.take_rows(ids).dequantize(dtype)

    def rows_layout(self) -> bool:
        """Whether the kernel's row lookup (`neuron_qrows`) reads this weight: integer codes in a
        layout the kernels take, in stored order. Makes `layout` where it does."""
        if self.input_index is not None or self.fp8 or not _weight_takes(self):
            return False
        if self.layout is None:
            self.layout = _layout(self)
        return bool(self.layout)

    def gather_inputs(self, x: torch.Tensor) -> torch.Tensor:
        """x's columns in the stored order (zeros where the stored column is padding)."""
        return torch.nn.functional.pad(x, (0, 1))[:, self.input_index]


def cat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Several weights of one layout stacked along the outputs (q, k, v; gate and up)."""
    first = parts[0]
    for p in parts[1:]:
        if (p.k, p.bits, p.group, p.per_super, p.format, p.fp8) != (first.k, first.bits, first.group, first.per_super,
                                                                    first.format, first.fp8) \
                or (p.input_index is None) != (first.input_index is None) \
                or (p.input_index is not None and not torch.equal(p.input_index, first.input_index)) \
                or (p.offset is None) != (first.offset is None) or (p.scale_sub is None) != (first.scale_sub is None):
            raise ValueError("cat_rows takes weights of one layout")

    def cat(name):
        ts = [getattr(p, name) for p in parts]
        if ts[0] is None:
            return None
        if len({t.dtype for t in ts}) > 1:  # fp16 factors beside fp32 ones: all fp32
            ts = [t.float() for t in ts]
        return torch.cat(ts)
    return replace(first, codes=cat("codes"), scale=cat("scale"), scale_sub=cat("scale_sub"), offset=cat("offset"),
                   offset_sub=cat("offset_sub"))


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """4-bit codes [n, k] (values 0..15, k a multiple of 32) in QuantizedWeight's layout, uint8
    [n, k // 2]: in each group of 32, byte i holds code i (low nibble) and code i + 16 (high)."""
    n = q.shape[0]
    g = q.reshape(n, -1, 2, 16).to(torch.uint8)
    return (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(n, -1).contiguous()


class StackedWeight:
    """Weights of different layouts stacked along the outputs (a GGUF file that stores q and k as Q4_K
    and v as Q6_K): one product per part, the outputs concatenated."""

    def __init__(self, parts: list[QuantizedWeight | torch.Tensor]):
        self.parts = parts

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    def tensors(self) -> list[torch.Tensor]:
        return [t for p in self.parts for t in (p.tensors() if isinstance(p, QuantizedWeight) else [p])]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.cat([p.dequantize(dtype) if isinstance(p, QuantizedWeight) else p.to(dtype) for p in self.parts])


Weight = torch.Tensor | QuantizedWeight | StackedWeight | cpu_ops.PanelWeight


def stack(parts: list[torch.Tensor | QuantizedWeight], dtype: torch.dtype, device) -> QuantizedWeight | StackedWeight:
    """Parts of one linear layer's weight stacked along the outputs, on `device`: one quantized weight
    where they share a layout, else a StackedWeight (dense parts in `dtype`)."""
    quant = [p for p in parts if isinstance(p, QuantizedWeight)]
    if len(quant) == len(parts):
        try:
            return cat_rows(parts).to(device)
        except ValueError:
            pass
    return StackedWeight([p.to(device) if isinstance(p, QuantizedWeight) else p.to(device=device, dtype=dtype)
                          for p in parts])


def tensors(w: Weight) -> list[torch.Tensor]:
    """The tensors a weight holds, for counting its bytes."""
    return [w] if isinstance(w, torch.Tensor) else w.tensors()


def quantize_int8(w: torch.Tensor) -> QuantizedWeight:
    """Symmetric int8 with one scale per output row: q = round(w / s), s = max|w| / 127."""
    w = w.float()
    n, k = w.shape
    scale = w.abs().amax(dim=1, keepdim=True) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale).clamp_(-127, 127).to(torch.int8)
    return QuantizedWeight(codes=q.view(torch.uint8), k=k, bits=8, group=k, scale=scale, format="int8")


def quantize_fp8(w: torch.Tensor) -> QuantizedWeight:
    """FP8 e4m3 with one scale per output row and 128 inputs (per row where the width is not a
    multiple of 128): codes = w / s rounded to e4m3, s = max|w| / 448 over the group."""
    w = w.float()
    n, k = w.shape
    group = 128 if k % 128 == 0 else k
    blocks = w.reshape(n, k // group, group)
    scale = blocks.abs().amax(dim=-1) / 448.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = (blocks / scale.unsqueeze(-1)).reshape(n, k).to(torch.float8_e4m3fn)
    return QuantizedWeight(codes=codes.view(torch.uint8), k=k, bits=8, group=group, scale=scale, format="fp8",
                           fp8=True)


QUANTIZERS = {"int8": quantize_int8, "fp8": quantize_fp8}
HEAD_QUANTIZATIONS = ("int8",)  # the formats at load that take the LM head too (loader.QuantizingReader)


class _Layout(ctypes.Structure):
    _fields_ = [
        ("codes", ctypes.c_void_p), ("code_stride", ctypes.c_int64), ("n", ctypes.c_int64), ("k", ctypes.c_int64),
        ("bits", ctypes.c_int32), ("group", ctypes.c_int32), ("per_super", ctypes.c_int32), ("fp8", ctypes.c_int32),
        ("scale", ctypes.c_void_p), ("scale_stride", ctypes.c_int64),
        ("scale_sub", ctypes.c_void_p), ("scale_sub_stride", ctypes.c_int64),
        ("offset", ctypes.c_void_p), ("offset_stride", ctypes.c_int64),
        ("offset_sub", ctypes.c_void_p), ("offset_sub_stride", ctypes.c_int64),
        ("half_factors", ctypes.c_int32),
    ]


def _kernel_takes(kernels: Kernels, x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None) -> bool:
    if not (kernels.quant_kernels and kernels.cpu_ops) or x.dim() != 2 or x.shape[0] > kernel_rows(kernels, w):
        return False
    return _weight_takes(w) and cpu_ops.takes(x, *([bias] if bias is not None else []))


def kernel_rows(kernels: Kernels, w: QuantizedWeight) -> int:
    """The most rows of a step that W's CPU kernel (`cpu_kernel`) multiplies; past them, the kernel
    for many rows where one takes W (`many_takes`, `many_kernel`), else the reference."""
    if kernels.quant_exact or not _integer_takes(w, MAX_KERNEL_ROWS):
        return MAX_KERNEL_ROWS
    if _many_int(w):
        return MAX_KERNEL_ROWS_BEFORE_MANY
    return MAX_KERNEL_ROWS_TWO_LEVEL if w.scale_sub is not None else MAX_KERNEL_ROWS


def _many_int(w: QuantizedWeight) -> bool:
    """Whether neuron_qlinear_int_many takes W (asked of the library once per weight)."""
    if w.many_int is None:
        w.many_int = w.rows_layout() and bool(cpu_ops.library().neuron_qlinear_int_many_takes(ctypes.byref(w.layout)))
    return w.many_int


def _many_step(kernels: Kernels, x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None) -> bool:
    """Whether this step has more rows than W's kernel takes and `many_kernel` multiplies it, rather
    than dequantizing all of W and multiplying in torch."""
    if x.dim() != 2 or x.shape[0] <= kernel_rows(kernels, w):
        return False
    return many_takes(kernels, w) and cpu_ops.takes(x, *([bias] if bias is not None else []))


def many_takes(kernels: Kernels, w: QuantizedWeight) -> bool:
    """Whether a CPU kernel multiplies W in a step of more rows than `kernel_rows` (`many_kernel`):
    integer codes in a layout the kernels take, in stored order (FP8 codes keep the reference).
    cpu_decoder.py asks too."""
    return kernels.quant_kernels and kernels.cpu_ops and w.rows_layout()


def many_kernel(kernels: Kernels, w: QuantizedWeight):
    """The kernel for a step of more rows than `kernel_rows`, where `many_takes`: the activations
    rounded to int8 and multiplied in integers (`neuron_qlinear_int_many`) where the library takes
    W's codes (4-bit codes in groups of 32 in AVX-512 and AVX2 builds; int8 codes in groups of 16 or
    more in those with VNNI), unless NEURON_QUANT_EXACT; else W dequantized into fp32 panels
    (`neuron_qlinear_panels`), exact."""
    lib = cpu_ops.library()
    return lib.neuron_qlinear_int_many if _many_int(w) and not kernels.quant_exact else lib.neuron_qlinear_panels


def _weight_takes(w: QuantizedWeight) -> bool:
    """Whether the CPU kernels take W's layout: whole groups (of 16 inputs, 32 for 4-bit codes), a
    power-of-two number of groups per super-block that the kernel's buffer holds, fp32 factors or
    fp16 ones (scale and offset alike), rows contiguous."""
    if w.group % 16 or (w.bits == 4 and w.group % 32) or w.k % w.group:
        return False
    if w.per_super > MAX_PER_SUPER or w.per_super & (w.per_super - 1):  # the kernel's shift and its buffer
        return False
    dtype = w.scale.dtype
    if dtype is not torch.float32 and dtype is not torch.float16:
        return False
    for t in (w.scale, w.offset):
        if t is not None and (not t.is_cpu or t.dtype is not dtype or t.stride(-1) != 1):
            return False
    return w.codes.is_cpu and w.codes.stride(-1) == 1 and cpu_ops.library() is not None


def cpu_kernel(kernels: Kernels, w: QuantizedWeight, rows: int = 1):
    """The CPU kernel that multiplies fp32 steps of up to `rows` rows (at most `kernel_rows`) by W
    in its stored input order, and W's layout as that kernel reads it: `kernel(x, m, x_stride,
    byref(layout), bias, y, y_stride, threads)`. None where `kernels` rule the kernels out or they
    do not take W (its layout, or FP8 scales too large for the kernel's exponent shift)."""
    if not (kernels.quant_kernels and kernels.cpu_ops) or not _weight_takes(w) or rows > kernel_rows(kernels, w):
        return None
    if w.layout is None:
        # FP8 codes are scaled by scale x 2^120 in the kernel (csrc/cpu_ops.cpp), finite below 2^8
        w.layout = _layout(w) if not w.fp8 or bool(w.scale.abs().max() < 256) else False
    if not w.layout:
        return None
    lib = cpu_ops.library()
    kernel = lib.neuron_qlinear if kernels.quant_exact or not _integer_takes(w, rows) else lib.neuron_qlinear_int
    return kernel, w.layout


def _integer_takes(w: QuantizedWeight, rows: int) -> bool:
    """Whether a step of `rows` rows multiplies W through the integer kernel (`neuron_qlinear_int`):
    int8 and 4-bit codes whose width is whole blocks of 32 activations, at every row count up to
    MAX_KERNEL_ROWS. Measured on [3072, 1024] + [1024, 3072] weights (2-core EPYC VM, AVX-512 VNNI,
    other work running; best of 15 alternated runs), the integer kernel against the exact one at
    1, 2, 4, 8, 16, 32 rows: int8 1.33, 1.31, 2.16, 1.56, 2.00, 1.79x as fast; Q4_K 1.73, 1.66,
    1.40, 1.52, 1.66, 1.56x; Q8_0 1.19, 1.59, 1.05, 1.38, 0.91, 1.39x (16 rows within the noise).
    So no row count keeps the float kernel (`rows` is here for when one should)."""
    return not w.fp8 and w.k % 32 == 0


def _layout(w: QuantizedWeight) -> _Layout:
    def ptr(t):
        return None if t is None else t.data_ptr()

    def stride(t):
        return 0 if t is None else t.stride(0)
    return _Layout(w.codes.data_ptr(), w.codes.stride(0), w.codes.shape[0], w.k, w.bits, w.group, w.per_super, int(w.fp8),
                   ptr(w.scale), stride(w.scale), ptr(w.scale_sub), stride(w.scale_sub),
                   ptr(w.offset), stride(w.offset), ptr(w.offset_sub), stride(w.offset_sub),
                   int(w.scale.dtype is torch.float16))


def linear(kernels: Kernels, x: torch.Tensor, w: QuantizedWeight | StackedWeight,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + bias for a quantized W: the CPU kernel where it takes the case (and `kernels` allows
    it), the Triton kernel on CUDA where trusted, else the reference."""
    if isinstance(w, StackedWeight):
        y = torch.cat([linear(kernels, x, p) if isinstance(p, QuantizedWeight) else F.linear(x, p) for p in w.parts],
                      dim=-1)
        return y if bias is None else y + bias
    if w.input_index is not None:
        x = w.gather_inputs(x)
    # a half-precision CPU step runs the kernel in fp32 (its activations are a few rows) and casts back
    half = x.dtype in (torch.bfloat16, torch.float16) and x.is_cpu
    xk, bk = (x.float(), None if bias is None else bias.float()) if half else (x, bias)
    chosen = cpu_kernel(kernels, w, xk.shape[0]) if _kernel_takes(kernels, xk, w, bk) else None
    if chosen is None and _many_step(kernels, xk, w, bk):
        chosen = many_kernel(kernels, w), w.layout
    if chosen is not None:
        kernel, layout = chosen
        m = xk.shape[0]
        y = torch.empty((m, w.codes.shape[0]), dtype=torch.float32)
        kernel(xk.data_ptr(), m, xk.stride(0), ctypes.byref(layout), None if bk is None else bk.data_ptr(),
               y.data_ptr(), y.stride(0), cpu_ops.threads_for(m))
        return y.to(x.dtype) if half else y
    if x.is_cuda and x.dim() == 2 and HAS_TRITON and kernels.triton("quant_linear"):
        return linear_triton(x, w, bias)
    return F.linear(x, w.stored(x.dtype), bias)


def linear_triton(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + bias by the Triton kernel (triton_quant.py), x [m, k] already in W's input order;
    trusted on a GPU once the start-up self-check passed it (kernel_check)."""
    import triton

    from neuron.layers.triton_quant import quant_linear_kernel

    x = x if x.stride(-1) == 1 else x.contiguous()
    m, n = x.shape[0], w.codes.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_m = 16 if m <= 16 else 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, 64))

    def ptr(t):
        return t if t is not None else w.scale  # never read: its flag is off

    def stride(t):
        return t.stride(0) if t is not None else 0
    quant_linear_kernel[grid](
        x, w.codes, w.scale, ptr(w.scale_sub), ptr(w.offset), ptr(w.offset_sub), bias if bias is not None else x, y,
        m, n, w.k, x.stride(0), w.codes.stride(0), w.scale.stride(0), stride(w.scale_sub), stride(w.offset),
        stride(w.offset_sub), y.stride(0),
        GROUP=w.group, PER_SUPER=w.per_super, BITS=w.bits, FP8=w.fp8, HAS_SUB=w.scale_sub is not None,
        HAS_OFFSET=w.offset is not None, HAS_BIAS=bias is not None,
        # float32 activations multiply in float32, not TF32; so does every dtype in Triton's CPU
        # interpreter, whose dot mishandles bfloat16 (the products are the same: bf16 x bf16 is exact in fp32)
        IEEE=x.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1",
        BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=64)
    return y
