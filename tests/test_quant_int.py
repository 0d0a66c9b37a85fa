"""The integer path of the CPU quantized kernel (`neuron_qlinear_int`, csrc/qlinear_int.h): the
activations rounded to int8 per 32 inputs (per 256 for the K-quants' two-level factors at a few
rows, in builds without VNNI), so not equal to dequantize-then-matmul but within a stated normalized mean
squared error of it, NMSE = sum((y - ref)^2) / sum(ref^2) (as llama.cpp's
backend tests measure theirs); and greedy decoding that picks the same tokens as the exact fp32
kernel (NEURON_QUANT_EXACT=1)."""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from checkpoints import build_checkpoint
from gguf_files import quantize, write_gguf

from neuron import LLM, SamplingParams
from neuron.layers import cpu_attention, cpu_ops, quantized
from neuron.layers.kernels import Kernels
from neuron.layers.quantized import QuantizedWeight, quantize_int8
from neuron.models import quant_formats
from neuron.utils import native

pytestmark = pytest.mark.skipif(cpu_ops.library() is None, reason="the CPU kernels could not be built here")
gguf = pytest.importorskip("gguf", reason="the gguf package is a dependency of neuron; this install lacks it")

INTEGER, EXACT = Kernels(), Kernels(quant_exact=True)

# Rounding 32 Gaussian activations to int8 under their maximum leaves an error of variance about
# (max / 127)^2 / 12, some 3e-5 of x's: measured 2.1e-5 .. 3.5e-5 over every case below (67 outputs;
# the same on the AVX2, AVX-512BW and scalar builds).
# A group's scale 10 % off in every row, or a group dropped, lands above 3e-4.
NMSE_BOUND = 1e-4
# Rounded per 256 inputs (the K-quants' super-blocks, as llama.cpp's Q8_K rounds them), the largest
# |x| of 256 Gaussians sets the step: measured 3.0e-5 .. 9.1e-5 over 72 cases each of Q4_K, Q5_K,
# Q6_K, Q3_K, Q2_K and IQ4_XS at 1 to 3 rows and 512 to 2,048 inputs (AVX2 build), where the same
# weights at 5 rows (per 32) stay under 3.3e-5. A group of 32 with its scale 10 % off lands at
# 6.3e-4, above 3x this; a group of 16 (Q6_K) at 3.5e-4, above 2x.
NMSE_BOUND_SUPER = 1.5e-4


def _weight(kind: str, n: int, k: int, seed: int = 0) -> QuantizedWeight:
    """Gaussian weights quantized as `kind`: int8 at load, AWQ's layout ("g128": 4-bit codes, a scale
    and a zero per 128 inputs; "g96": per 96, as GPTQ's act-order runs may be padded to), or a GGUF
    type read back as neuron reads files."""
    x = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    if kind == "int8":
        return quantize_int8(torch.from_numpy(x))
    if kind in ("g128", "g96"):
        return _asymmetric_4bit(torch.from_numpy(x), int(kind[1:]))
    from neuron.models import gguf as neuron_gguf

    data, qtype = quantize(x, kind)
    return neuron_gguf._DECODERS[kind](data.reshape(n, -1, gguf.GGML_QUANT_SIZES[qtype][1]), k)


def _asymmetric_4bit(x: torch.Tensor, group: int) -> QuantizedWeight:
    """x rounded to 4-bit codes with a scale and a zero per `group` inputs, as AWQ and GPTQ store it."""
    n, k = x.shape
    g = x.reshape(n, k // group, group)
    low, high = g.amin(-1), g.amax(-1)
    scales = (high - low) / 15
    zeros = torch.round(-low / scales)
    q = torch.clamp(torch.round(g / scales[..., None]) + zeros[..., None], 0, 15).reshape(n, k).int()
    return quant_formats._grouped(q, 4, torch.arange(k) // group, scales, zeros, f"g{group}", "test")


def _nmse(y: torch.Tensor, ref: torch.Tensor) -> float:
    return (((y.double() - ref) ** 2).sum() / (ref ** 2).sum()).item()


def _block(w: QuantizedWeight, rows: int) -> int:
    """The inputs under one activation scale where the integer kernel multiplies `rows` rows by W (32
    past its rows, in the kernel for many rows)."""
    chosen = quantized.cpu_kernel(INTEGER, w, rows)
    return 32 if chosen is None else cpu_ops.library().neuron_qlinear_int_block(ctypes.byref(chosen[1]), rows)


def _bound(w: QuantizedWeight, rows: int) -> float:
    return NMSE_BOUND_SUPER if _block(w, rows) == 256 else NMSE_BOUND


# (kind, k): the kernel steps through 64 inputs of int8 codes, or 128 of 4-bit codes, at a time with
# AVX-512 (32 and 64 with AVX2), so the widths leave every tail: 288 = 4 x 64 + 32 = 2 x 128 + 32,
# 352 = 2 x 128 + 96, 576 = 4 x 128 + 64 (SmolLM2's hidden size), 1536 (its MLP's) none. The
# K-quants take multiples of 256. g96's groups straddle the 128-input steps.
CASES = [("int8", 288), ("Q8_0", 288), ("Q8_0", 576), ("Q4_0", 288), ("Q4_0", 352), ("Q4_0", 576),
         ("Q4_0", 1536), ("Q4_1", 288), ("Q4_1", 576), ("Q4_1", 1536), ("Q4_K", 512), ("Q4_K", 1536),
         ("Q5_K", 512), ("Q6_K", 512), ("Q3_K", 512), ("Q2_K", 512), ("IQ4_XS", 512), ("g128", 384), ("g96", 576)]
OUTPUTS = 67  # whole tiles of 4 and 8 weight rows, and a ragged end


@pytest.mark.parametrize(("kind", "k"), CASES)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16, 32])
@pytest.mark.parametrize("with_bias", [False, True])
def test_integer_kernel_is_within_the_bound_of_dequantize_then_matmul(kind, k, rows, with_bias):
    w = _weight(kind, OUTPUTS, k)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g)
    bias = torch.randn(OUTPUTS, generator=g) * 0.1 if with_bias else None
    ref = torch.nn.functional.linear(x.double(), w.dequantize().double(), None if bias is None else bias.double())
    got = quantized.linear(INTEGER, x, w, bias)
    assert got.dtype == torch.float32 and got.shape == (rows, OUTPUTS)
    assert _nmse(got, ref) <= _bound(w, rows)
    assert _nmse(quantized.linear(EXACT, x, w, bias), ref) <= 1e-12  # the exact kernel, for contrast


# Row counts past the kernels' (MAX_KERNEL_ROWS, moved up to kernel_rows for K-quants): tiles of 6
# rows with a ragged end, one thread's share of units x rows ending inside a unit, a prefill chunk.
MANY_ROWS = [33, 61, 200]
MANY_KINDS = ["int8", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K", "IQ4_XS", "g128"]


@functools.cache
def _macros(flags: str = "") -> str:
    """The macros the compiler defines for -march=native and `flags` (and, in the narrower builds'
    runs below, their own flag, through NEURON_CXX): the ISA the kernels' build sees."""
    return subprocess.run([native.compiler(), "-march=native", *flags.split(), "-dM", "-E", "-x", "c++", "-"],
                          input="", capture_output=True, text=True, check=True).stdout


@functools.cache
def _build_isa() -> tuple[str | None, bool]:
    """The integer kernels' width in this run's build, and whether it has VNNI: ("avx512", VNNI) with
    AVX-512 BW and VL, ("avx2", AVX-VNNI) with AVX2 and no AVX-512, (None, False) below AVX2."""
    macros = _macros()

    def has(name: str) -> bool:
        return f"#define {name} " in macros

    if has("__AVX512BW__") and has("__AVX512VL__"):
        return "avx512", has("__AVX512VNNI__")
    if has("__AVX2__") and not has("__AVX512F__"):
        return "avx2", has("__AVXVNNI__")
    return None, False


def _many_int_expected(w: QuantizedWeight) -> bool:
    """Whether this run's build multiplies W in integers past its kernel rows: with VNNI 4-bit codes
    in groups of 32 and int8 codes in groups of 16; without it the 4-bit ones alone; nothing in a
    build without AVX2."""
    width, vnni = _build_isa()
    if width is not None and vnni:
        return (w.bits == 4 and w.group % 32 == 0) or (w.bits == 8 and w.group % 16 == 0)
    return width is not None and w.bits == 4 and w.group % 32 == 0


def _many(kind: str, rows: int, kernels: Kernels, monkeypatch):
    """A weight of `kind`, x of `rows` rows past its kernel's (and a bias), and the calls of the
    many-row kernels made by quantized.linear on them, counted."""
    w = _weight(kind, OUTPUTS, 384 if kind == "g128" else 512)
    rows += quantized.kernel_rows(kernels, w) - quantized.MAX_KERNEL_ROWS  # K-quants: past their own 128
    g = torch.Generator().manual_seed(rows)
    x, bias = torch.randn(rows, w.k, generator=g), torch.randn(OUTPUTS, generator=g) * 0.1
    return w, x, bias, _counted(monkeypatch, "neuron_qlinear_panels", "neuron_qlinear_int_many")


def _counted(monkeypatch, *names: str) -> list[tuple[str, int]]:
    """The library's kernels `names`, each call counted as (name, rows) in the list returned."""
    calls, lib = [], cpu_ops.library()
    for name in names:
        real = getattr(lib, name)
        monkeypatch.setattr(lib, name, lambda *a, name=name, real=real: (calls.append((name, a[1])), real(*a))[1])
    return calls


def _same_bits_on_other_teams(kernel, w, x, bias, got) -> None:
    for threads in (1, 3):
        y = torch.empty_like(got)
        kernel(x.data_ptr(), x.shape[0], x.stride(0), ctypes.byref(w.layout), bias.data_ptr(), y.data_ptr(),
               y.stride(0), threads)
        assert torch.equal(y, got)


@pytest.mark.parametrize("kind", MANY_KINDS)
@pytest.mark.parametrize("rows", MANY_ROWS)
def test_a_step_of_many_rows_dequantizes_panels_inside_the_product(kind, rows, monkeypatch):
    """Past its kernel's rows, on the exact setting (and wherever the integer kernel for many rows
    does not take W), a quantized product runs `neuron_qlinear_panels`: W dequantized two panels
    at a time as `neuron_qrows` dequantizes it, so the sums are dequantize-then-matmul's up to their
    order, with fp16 factors or fp32 ones, a bias, 67 outputs (a unit and a ragged panel) and any
    number of threads (each output is one sum in input order wherever its rows fall)."""
    w, x, bias, calls = _many(kind, rows, EXACT, monkeypatch)
    ref = torch.nn.functional.linear(x.double(), w.dequantize().double(), bias.double())
    got = quantized.linear(EXACT, x, w, bias)
    assert calls == [("neuron_qlinear_panels", x.shape[0])], "the step did not take the panels' product"
    assert got.shape == (x.shape[0], OUTPUTS) and _nmse(got, ref) <= 1e-12
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w.dequantize(), bias), rtol=1e-5, atol=1e-5)
    if w.scale.dtype is torch.float16:
        wide = dataclasses.replace(w, scale=w.scale.float(), offset=None if w.offset is None else w.offset.float())
        assert torch.equal(quantized.linear(EXACT, x, wide, bias), got)
    _same_bits_on_other_teams(cpu_ops.library().neuron_qlinear_panels, w, x, bias, got)


@pytest.mark.parametrize("kind", MANY_KINDS)
@pytest.mark.parametrize("rows", MANY_ROWS)
def test_a_step_of_many_rows_multiplies_integers_where_the_build_has_vnni(kind, rows, monkeypatch):
    """By default, past its kernel's rows, W multiplies the rounded activations in integers
    (`neuron_qlinear_int_many`) where the build takes its codes (`_many_int_expected`): within the
    integer kernels' bound of dequantize-then-matmul, the same bits on any team and with fp16 or
    fp32 factors. Groups of 16 (Q6_K, Q3_K, Q2_K, whose offsets meet each half block's own sum) are
    scaled per half block. The rest take the panels."""
    w, x, bias, calls = _many(kind, rows, INTEGER, monkeypatch)
    ref = torch.nn.functional.linear(x.double(), w.dequantize().double(), bias.double())
    got = quantized.linear(INTEGER, x, w, bias)
    assert w.many_int == _many_int_expected(w)
    name = "neuron_qlinear_int_many" if w.many_int else "neuron_qlinear_panels"
    assert calls == [(name, x.shape[0])]
    assert _nmse(got, ref) <= (NMSE_BOUND if w.many_int else 1e-12)
    if w.scale.dtype is torch.float16:
        wide = dataclasses.replace(w, scale=w.scale.float(), offset=None if w.offset is None else w.offset.float())
        assert torch.equal(quantized.linear(INTEGER, x, wide, bias), got)
    _same_bits_on_other_teams(getattr(cpu_ops.library(), name), w, x, bias, got)


@pytest.mark.parametrize("kind", ["Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q2_K"])
def test_each_weight_changes_kernel_at_its_own_row_count(kind, monkeypatch):
    """Where the integer kernel for many rows takes W (`_many_int_expected`) it takes every step
    past MAX_KERNEL_ROWS_BEFORE_MANY rows (8); elsewhere K-quants keep the decode kernel
    up to MAX_KERNEL_ROWS_TWO_LEVEL (128), whose panels' dequantization costs more, and the rest up
    to MAX_KERNEL_ROWS (32), then the panels. Under the exact setting: the exact kernel up to 32
    rows, then the panels. Each within its bound."""
    w = _weight(kind, OUTPUTS, 512)
    calls = _counted(monkeypatch, "neuron_qlinear_int", "neuron_qlinear_panels", "neuron_qlinear",
                     "neuron_qlinear_int_many")
    many = _many_int_expected(w)
    if many:
        limit, past = quantized.MAX_KERNEL_ROWS_BEFORE_MANY, "neuron_qlinear_int_many"
    elif w.scale_sub is not None:
        limit, past = quantized.MAX_KERNEL_ROWS_TWO_LEVEL, "neuron_qlinear_panels"
    else:
        limit, past = quantized.MAX_KERNEL_ROWS, "neuron_qlinear_panels"
    assert quantized.kernel_rows(INTEGER, w) == limit and quantized.kernel_rows(EXACT, w) == quantized.MAX_KERNEL_ROWS
    exact_limit = quantized.MAX_KERNEL_ROWS
    for kernels, rows, expected in ((INTEGER, limit, "neuron_qlinear_int"), (INTEGER, limit + 1, past),
                                    (INTEGER, 200, past), (EXACT, exact_limit, "neuron_qlinear"),
                                    (EXACT, exact_limit + 1, "neuron_qlinear_panels")):
        x = torch.randn(rows, w.k, generator=torch.Generator().manual_seed(rows))
        ref = torch.nn.functional.linear(x.double(), w.dequantize().double())
        calls.clear()
        got = quantized.linear(kernels, x, w)
        assert calls == [(expected, rows)]
        assert _nmse(got, ref) <= (NMSE_BOUND if "_int" in expected else 1e-12)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_fp16_factors_are_kept_and_read_as_their_fp32_values(kind, rows):
    """GGUF's fp16 scales and offsets stay fp16 in memory (a Q8_0 row holds the file's 34 bytes per
    32 inputs, not 36), and both kernels multiply them as the same weight with its factors widened
    to fp32, bit for bit."""
    k = 512
    w = _weight(kind, OUTPUTS, k)
    assert w.scale.dtype is torch.float16 and (w.offset is None or w.offset.dtype is torch.float16)
    if kind == "Q8_0":
        assert sum(t.numel() * t.element_size() for t in w.tensors()) == OUTPUTS * (k + k // 32 * 2)
    wide = dataclasses.replace(w, scale=w.scale.float(), offset=None if w.offset is None else w.offset.float())
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    for kernels in (INTEGER, EXACT):
        assert quantized.cpu_kernel(kernels, w, min(rows, quantized.kernel_rows(kernels, w))) is not None
        assert torch.equal(quantized.linear(kernels, x, w), quantized.linear(kernels, x, wide))


@pytest.mark.parametrize("kind", ["int8", "g128", "g96", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q2_K",
                                  "Q3_K", "IQ4_XS"])
def test_rows_of_a_quantized_table_are_its_dequantized_rows(kind):
    """An embedding lookup of a quantized table (`QuantizedWeight.rows`, the kernel's
    `neuron_qrows` where it takes the layout) gives `take_rows(ids).dequantize()` bit for bit,
    repeated ids and both ends included, with fp16 or fp32 factors, and refuses an id out of range
    without reading past the table."""
    w = _weight(kind, OUTPUTS, 576 if kind == "g96" else 512)
    wide = dataclasses.replace(w, scale=w.scale.float(), offset=None if w.offset is None else w.offset.float())
    ids = torch.tensor([0, OUTPUTS - 1, 7, 7, 21])
    for weight in (w, wide):
        expected = weight.take_rows(ids).dequantize()
        assert torch.equal(weight.rows(ids), expected)
        assert torch.equal(weight.rows(ids, torch.bfloat16), weight.take_rows(ids).dequantize(torch.bfloat16))
        if weight.input_index is None:  # g96's gathered runs take the reference's way
            assert weight.layout, "the kernel did not take this layout"
        for outside in (OUTPUTS, -1):
            with pytest.raises(IndexError):
                weight.rows(torch.tensor([3, outside]))


def test_greedy_picks_the_first_largest_and_refuses_nan_and_all_minus_infinity_rows():
    """sampling._greedy on CPU (cpu_ops.greedy): torch's argmax on every ordinary row, the first of
    equal largest values, and -1 for a row with a NaN anywhere or nothing above -inf."""
    from neuron.engine.sampling import _greedy

    x = torch.randn(6, 32000, generator=torch.Generator().manual_seed(0))
    x[1, 5] = x[1, 31999] = x[1].max() + 1  # a tie: the first wins
    x[2, 17] = float("nan")
    x[3] = float("-inf")
    x[4, :100] = float("-inf")
    x[5] = float("-inf")
    x[5, 31999] = -3.0  # only the last token is possible
    assert _greedy(x).tolist() == [int(x[0].argmax()), 5, -1, -1, int(x[4].argmax()), 31999]
    strided = x[:, :1000]  # rows not packed
    assert _greedy(strided)[[0, 4]].tolist() == [int(strided[0].argmax()), int(strided[4].argmax())]


def _rounded(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """x as the kernel rounds it, in fp64: per `block` inputs, d = max|x| / 127 and q = round(x 127 /
    max|x|) (ties to even) in fp32, then q d."""
    blocks = x.reshape(x.shape[0], -1, block)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inv)
    return (q.double() * (amax / 127.0).double()).reshape(x.shape)


@pytest.mark.parametrize(("kind", "k"), CASES)
@pytest.mark.parametrize("rows", [1, 2, 3, 5])
def test_integer_kernel_multiplies_the_rounded_activations(kind, k, rows):
    """Against dequantize-then-matmul on the activations rounded as the kernel rounds them, only fp32's
    summation order differs (measured 1.2e-13 at most): one activation a step off, or one lane's
    scale or offset taken from the wrong inputs, lands orders of magnitude above 1e-11 here and may
    stay under the bound above."""
    w = _weight(kind, OUTPUTS, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    x[0, :32] = 0.0  # a block of zeros: its scale is 0
    if k >= 512:
        x[-1, -256:] = 0.0  # and a super-block of them
    ref = _rounded(x, _block(w, rows)) @ w.dequantize().double().T
    assert _nmse(quantized.linear(INTEGER, x, w), ref) <= 1e-11


def _super_expected(w: QuantizedWeight, rows: int) -> bool:
    """Whether this run's build rounds x per 256 inputs for W at `rows` rows: two-level factors over
    256 inputs (the K-quants, IQ4_XS) in groups of 32 (4-bit codes) or 16 and 32 (int8 codes), at
    fewer than 4 rows, in builds with AVX-512 BW and VL but not VNNI, or AVX2 without AVX-512 (with
    AVX-VNNI too: its dpbusd serves the many-row path there, not the few-row one)."""
    width, vnni = _build_isa()
    built = width == "avx2" or (width == "avx512" and not vnni)
    groups = w.group == 32 if w.bits == 4 else w.group in (16, 32)
    return (built and groups and w.scale_sub is not None and w.group * w.per_super == 256
            and (w.offset is None or w.offset_sub is not None) and rows < 4)


@pytest.mark.parametrize("kind", ["Q4_K", "Q4_0", "Q4_1", "Q8_0", "Q5_K", "Q6_K", "Q3_K", "Q2_K", "IQ4_XS", "int8"])
def test_two_level_codes_round_x_per_super_block_where_built(kind):
    """Which rounding the kernel takes, against what the build's flags predict: per 256 inputs for
    the two-level factors of the K-quants and IQ4_XS at 1 to 3 rows without VNNI, per 32 everywhere
    else. The test above holds each to its rounding, and the bound test to its error."""
    w = _weight(kind, OUTPUTS, 512)
    for rows in (1, 3, 4, 16):
        assert _block(w, rows) == (256 if _super_expected(w, rows) else 32), rows


def _stacked(parts: list[QuantizedWeight], x: torch.Tensor) -> tuple[int, torch.Tensor]:
    """`neuron_qlinear_int_stack` on the parts side by side (what the C decoder loop calls for a
    merged projection read as several weights): its answer and y, NaN where it wrote nothing."""
    rows, layouts = x.shape[0], []
    for w in parts:
        kernel, layout = quantized.cpu_kernel(INTEGER, w)
        assert kernel is cpu_ops.library().neuron_qlinear_int
        layouts.append(ctypes.addressof(layout))
    n = sum(w.shape[0] for w in parts)
    y = torch.full((rows, n), float("nan"))
    answer = cpu_ops.library().neuron_qlinear_int_stack(
        x.data_ptr(), rows, x.shape[1], (ctypes.c_void_p * len(parts))(*layouts), len(parts), y.data_ptr(), n,
        torch.get_num_threads())
    return answer, y


# parts as a GGUF file's q, k and v (or gate and up) are: one layout, ragged ends at each part's last tile
STACKS = {"Q4_K": (["Q4_K"] * 3, 512), "Q4_1": (["Q4_1"] * 2, 576), "Q8_0": (["Q8_0"] * 3, 288),
          "int8": (["int8"] * 2, 288), "g128": (["g128"] * 2, 384)}


@pytest.mark.parametrize("stack", list(STACKS))
@pytest.mark.parametrize("rows", [1, 3, 5, 16])
def test_stacked_parts_in_one_call_equal_each_part_s_own_call(stack, rows):
    """Several parts multiplied in one call (x rounded once, one parallel region over every part's
    tiles): each part's own call's outputs, bit for bit, side by side."""
    kinds, k = STACKS[stack]
    parts = [_weight(kind, n, k, seed=i) for i, (kind, n) in enumerate(zip(kinds, [67, 35, 33]))]
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    answer, y = _stacked(parts, x)
    assert answer == 0
    assert torch.equal(y, torch.cat([_decode_kernel(x, w) for w in parts], dim=-1))


def _decode_kernel(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """x W^T through `neuron_qlinear_int` itself, at any row count (quantized.linear hands steps of
    more rows to the kernel for many rows)."""
    kernel, layout = quantized.cpu_kernel(INTEGER, w)
    y = torch.empty((x.shape[0], w.shape[0]))
    kernel(x.data_ptr(), x.shape[0], x.stride(0), ctypes.byref(layout), None, y.data_ptr(), y.stride(0),
           torch.get_num_threads())
    return y


@pytest.mark.parametrize("kinds", [("Q4_K", "Q8_0"), ("Q4_K", "g128"), ("int8", "Q8_0")],
                         ids=["codes", "groups", "offsets-and-groups"])
def test_parts_that_differ_are_declined_untouched(kinds):
    """Parts whose codes, groups or offsets differ would need x rounded twice: the call answers 1
    and writes nothing, and the C loop goes part by part."""
    k = 512 if "g128" not in kinds else 384 * 4
    parts = [_weight(kind, 35, k, seed=i) for i, kind in enumerate(kinds)]
    answer, y = _stacked(parts, torch.randn(2, k))
    assert answer == 1 and torch.isnan(y).all()


# The build picks its code by -march=native; each of these flags takes away part of what an AVX-512
# VNNI machine has, so the other paths (maddubs, 256 bits, plain C++, fp16 factors widened without
# F16C) are checked on it too: through a compiler wrapper named by NEURON_CXX and a kernel cache of
# its own. The runs (a build and the checks each, mostly one core's work) start together. A flag that
# takes away nothing this CPU has builds the same code as -march=native (or as a flag before it), which
# the suite checks already: on an AVX2 machine three of the four are the native build again.
NARROWER = {"avx512-without-vnni": "-mno-avx512vnni", "avx2": "-mno-avx512f",
            "avx2-without-vnni": "-mno-avx512f -mno-avxvnni", "scalar": "-mno-avx"}


def _same_build_as() -> dict[str, str]:
    """Each narrower build whose predefined macros (the ISA the kernels compile for) equal the native
    build's or an earlier one's, and which that is."""
    seen = {_macros(): "the native build"}
    same = {}
    for name, flag in NARROWER.items():
        defined = _macros(flag)
        if defined in seen:
            same[name] = seen[defined]
        else:
            seen[defined] = name
    return same


@pytest.fixture(scope="module")
def narrower_runs(tmp_path_factory):
    runs = {}
    same = _same_build_as()
    for name, flag in NARROWER.items():
        if name in same:
            runs[name] = same[name]
            continue
        root = tmp_path_factory.mktemp(name)
        wrapper = root / "cxx"
        wrapper.write_text(f'#!/bin/sh\nexec {native.compiler()} "$@" {flag}\n')
        wrapper.chmod(0o755)
        env = {**os.environ, "NEURON_CXX": str(wrapper), "NEURON_CACHE_DIR": str(root / "cache")}
        # (and the attention kernel's widening of a 16-bit KV cache, which has a path per width too)
        # (and the fp32 linear kernel's panel transposes, one per vector width)
        checks = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
                  str(Path(__file__).parent / "test_paged_attention.py"),
                  str(Path(__file__).parent / "test_cpu_ops.py"), "-k",
                  "bound_of or rounded_activations or super_block or fp16_factors or rows_of or stacked "
                  "or declined or 16_bit_pool or linear_matches or strided_rows or held_as_panels "
                  "or same_bits_in_any_batch or share_units or many_rows or own_row_count"]
        # the two libraries built side by side first (the checks would build them one after the other)
        build = [sys.executable, "-m", "neuron.utils.native", str(cpu_ops.SOURCE), str(cpu_attention.SOURCE)]
        proc = subprocess.Popen(f"{shlex.join(build)} >/dev/null && exec {shlex.join(checks)}", shell=True, env=env,
                                cwd=Path(__file__).parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        runs[name] = (proc, root)
    yield runs
    for run in runs.values():
        if not isinstance(run, str):
            run[0].kill()
            run[0].wait()


@pytest.mark.slow
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the flags are x86's")
@pytest.mark.parametrize("name", list(NARROWER))
def test_narrower_builds_pass_the_same_checks(name, narrower_runs):
    if isinstance(narrower_runs[name], str):
        pytest.skip(f"{NARROWER[name]} takes nothing away from this CPU: the same code as {narrower_runs[name]}")
    proc, root = narrower_runs[name]
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0 and "skipped" not in out, out[-3000:]
    assert list((root / "cache" / "kernels").glob("cpu_ops-*.so"))  # built there, with the flag
    assert list((root / "cache" / "kernels").glob("paged_attention_cpu-*.so"))


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K", "Q6_K"])
def test_the_bound_catches_one_group_wrong(kind):
    """A kernel that got one group's scale 10 % wrong, or dropped a group, fails the bound (by 3x, or
    2x for groups of 16 under the rounding per 256)."""
    w = _weight(kind, 67, 512)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(5))
    ref = x.double() @ w.dequantize().double().T
    bound = _bound(w, 3)
    margin = 2 if bound == NMSE_BOUND_SUPER and w.group == 16 else 3
    assert _nmse(quantized.linear(INTEGER, x, w), ref) <= bound
    for factor in (1.1, 0.0):
        bad = w.dequantize().double()
        bad[:, 32:32 + w.group] *= factor
        assert _nmse(x.double() @ bad.T, ref) > margin * bound


def test_the_integer_path_is_the_default_and_exact_a_setting(monkeypatch):
    monkeypatch.setenv("NEURON_QUANT_EXACT", "1")
    assert Kernels.from_settings().quant_exact
    monkeypatch.delenv("NEURON_QUANT_EXACT")
    assert not Kernels.from_settings().quant_exact
    w = _weight("Q8_0", 8, 64)
    x = torch.randn(1, 64)
    ref = x.double() @ w.dequantize().double().T
    assert not torch.equal(quantized.linear(INTEGER, x, w), quantized.linear(EXACT, x, w))
    assert _nmse(quantized.linear(EXACT, x, w), ref) <= 1e-12


def test_fp8_stays_on_the_exact_kernel():
    w = quantized.quantize_fp8(torch.randn(8, 128))
    x = torch.randn(2, 128)
    assert torch.equal(quantized.linear(INTEGER, x, w), quantized.linear(EXACT, x, w))


# ---- greedy decoding: the same tokens as the exact kernel ----------------------------------------

# This random model (initializer range 0.25) is chaotic: the integer path moves its logprobs by up
# to 0.1-0.2 against the exact kernel's, and where the top two tokens are that close greedy decoding
# may part (it did within 32 tokens for about two prompts in three of 24 random ones, always at a
# step whose top two were within 0.1). Each variant's prompt here is one of those 24 whose top two,
# on the exact kernel, stay at least 0.15 apart at every step of the 32.
PROMPTS = {"int8": [276, 104, 280, 300, 147, 227, 46, 197], "Q4_K": [128, 78, 287, 6, 234, 40, 171, 23, 278],
           "Q8_0": [218, 31, 51, 74, 112, 23, 293, 273]}
TOKENS = 32
MARGIN = 0.15
# K-quant rows are multiples of 256
SHAPE = dict(vocab_size=301, hidden_size=256, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def dense_checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("qint") / "hf", seed=5, **SHAPE)


def _greedy(path, monkeypatch, exact: bool, prompt: list[int], **kwargs):
    monkeypatch.setenv("NEURON_QUANT_EXACT", "1" if exact else "0")  # read when the model loads
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True, logprobs=2)
    with LLM(str(path), device="cpu", dtype="float32", **kwargs) as llm:
        assert llm.engine.executor.rank0.models["model"].kernels.quant_exact == exact
        return llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0]


def _assert_same_tokens(path, monkeypatch, prompt: list[int], **kwargs) -> None:
    exact = _greedy(path, monkeypatch, True, prompt, **kwargs)
    assert len(exact.token_ids) == TOKENS
    assert min(sorted(lp.values())[-1] - sorted(lp.values())[-2] for lp in exact.logprobs) >= MARGIN
    assert _greedy(path, monkeypatch, False, prompt, **kwargs).token_ids == exact.token_ids


def test_int8_at_load_decodes_the_exact_kernels_tokens(dense_checkpoint, monkeypatch):
    _assert_same_tokens(dense_checkpoint, monkeypatch, PROMPTS["int8"], quantization="int8")


@pytest.mark.parametrize("kind", ["Q4_K", "Q8_0"])
def test_gguf_decodes_the_exact_kernels_tokens(dense_checkpoint, tmp_path, monkeypatch, kind):
    path = write_gguf(dense_checkpoint, tmp_path / f"model-{kind}.gguf", kind)
    _assert_same_tokens(path, monkeypatch, PROMPTS[kind])
