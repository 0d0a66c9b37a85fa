"""The Triton kernel for quantized weights (neuron/layers/triton_quant.py) against dequantize-then-
matmul, for every layout neuron holds. Without a GPU it runs in Triton's interpreter on CPU tensors;
with one it compiles and runs on CUDA."""

import pytest
import torch
from triton_interpret import DEVICE, require_triton  # before anything loads Triton

from neuron.layers import kernel_cases, kernel_check, quantized
from neuron.layers.kernel_check import Widths
from neuron.layers.quantized import QuantizedWeight


@pytest.fixture(scope="module", autouse=True)
def triton_ready():
    require_triton()


def _layout(kind: str, n: int, k: int, seed: int = 0) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    if kind == "fp8":
        codes = torch.arange(256, dtype=torch.uint8)
        codes = codes[codes.view(torch.float8_e4m3fn).float().isfinite()]  # every finite e4m3 byte, subnormals too
        codes = codes[torch.randint(0, codes.numel(), (n, k), generator=g)]
        return QuantizedWeight(codes=codes, k=k, bits=8, group=128, scale=torch.rand(n, k // 128, generator=g),
                               format="fp8", fp8=True)
    if kind == "int8":
        q = torch.randint(-127, 128, (n, k), generator=g).to(torch.int8)
        return QuantizedWeight(codes=q.view(torch.uint8), k=k, bits=8, group=k, scale=torch.rand(n, 1, generator=g))
    if kind == "Q6_K":
        return QuantizedWeight(codes=torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=g), k=k, bits=8,
                               group=16, per_super=16, scale=torch.rand(n, k // 256, generator=g) * 0.01,
                               scale_sub=torch.randint(-64, 64, (n, k // 16), dtype=torch.int8, generator=g))
    if kind == "Q2_K":  # also Q3_K's layout, and IQ4_XS's in groups of 32
        return QuantizedWeight(codes=torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=g), k=k, bits=8,
                               group=16, per_super=16, scale=torch.rand(n, k // 256, generator=g) * 0.01,
                               scale_sub=torch.randint(-32, 32, (n, k // 16), dtype=torch.int8, generator=g),
                               offset=torch.rand(n, k // 256, generator=g) * 0.01,
                               offset_sub=torch.randint(0, 16, (n, k // 16), dtype=torch.int8, generator=g))
    if kind == "Q4_K":
        return QuantizedWeight(codes=torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g), k=k, bits=4,
                               group=32, per_super=8, scale=torch.rand(n, k // 256, generator=g) * 0.01,
                               scale_sub=torch.randint(0, 64, (n, k // 32), dtype=torch.int8, generator=g),
                               offset=torch.rand(n, k // 256, generator=g) * 0.01,
                               offset_sub=torch.randint(0, 64, (n, k // 32), dtype=torch.int8, generator=g))
    # 4-bit in groups of 128 with offsets (AWQ, GPTQ, compressed-tensors)
    return QuantizedWeight(codes=torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g), k=k, bits=4,
                           group=128, scale=torch.rand(n, k // 128, generator=g) * 0.01,
                           offset=torch.rand(n, k // 128, generator=g) * 0.05)


@pytest.mark.parametrize("kind", ["int8", "fp8", "Q6_K", "Q2_K", "Q4_K", "w4a16"])
@pytest.mark.parametrize("rows", [1, 19])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernel_equals_dequantize_then_matmul(kind, rows, dtype):
    w = _layout(kind, 70, 512).to(DEVICE)  # 70 outputs: a ragged last tile
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    bias = torch.randn(70).to(DEVICE, dtype)
    got = quantized.linear_triton(x, w, bias)
    assert got.dtype == dtype and got.shape == (rows, 70)
    ref = torch.nn.functional.linear(x.double(), w.stored(dtype).double(), bias.double())
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the output's rounding (and the interpreter's)
    assert (got.double() - ref).abs().max().item() <= tolerance * ref.abs().max().item()


@pytest.mark.parametrize("k,group", [(48, 16), (96, 32), (192, 64)])
def test_triton_kernel_takes_fp8_blocks_cut_by_a_split(k, group):
    """A rank's share of FP8 blocks that tp cuts (quant_formats: groups of gcd(block, start, end)),
    its width under or off the kernel's 64-wide K tile."""
    g = torch.Generator().manual_seed(2)
    codes = (torch.randn(70, k, generator=g) * 40).to(torch.float8_e4m3fn).view(torch.uint8)
    w = QuantizedWeight(codes=codes, k=k, bits=8, group=group, scale=torch.rand(70, k // group, generator=g),
                        format="fp8", fp8=True).to(DEVICE)
    x = torch.randn(3, k, generator=g).to(DEVICE)
    ref = torch.nn.functional.linear(x.double(), w.stored().double())
    assert (quantized.linear_triton(x, w).double() - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


def test_the_self_check_passes_the_kernel_on_every_layout():
    widths = Widths(hidden=200, heads=4, kv_heads=2, head_dim=16, intermediate=300)
    cases = kernel_cases.cases(DEVICE, torch.float32, widths)["quant_linear"]
    assert len(cases) == 8  # four layouts, a decode row and a prefill tile each
    assert kernel_check._compare("quant_linear", quantized.linear_triton, cases, torch.float32) is None
    broken = kernel_check._compare("quant_linear", lambda x, w: quantized.linear_triton(x, w) * 1.01, cases,
                                   torch.float32)
    assert broken.startswith("quantized linear, int8, 1 rows: differs")
