"""The Triton RMSNorm and RMSNorm + rotary kernels against their PyTorch references. Without a GPU
they run in Triton's interpreter on CPU tensors; with one they compile and run on CUDA."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from triton_interpret import DEVICE, require_triton  # before anything loads Triton

from neuron.layers import norm

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module", autouse=True)
def triton_ready():
    require_triton()


def _close(got: torch.Tensor, expected: torch.Tensor, terms: torch.Tensor | None = None) -> None:
    """fp32 to rounding; half precision: at most one unit in the last place, on few elements (the
    kernels round where the reference does, so most elements are equal). Where the result is a
    sum of rounded terms (the rotary embedding), the unit is that of the terms' magnitudes, since
    one unit of a term can be many of a result that cancels. Triton's interpreter truncates
    float32 to bfloat16 where the GPU rounds to nearest, so there bf16 gets the tolerance of a few
    truncations."""
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        return
    if DEVICE == "cpu" and got.dtype == torch.bfloat16:
        torch.testing.assert_close(got.float(), expected.float(), atol=3e-2, rtol=2e-2)
        return
    diff = (got.float() - expected.float()).abs()
    scale = expected.float().abs() if terms is None else torch.maximum(expected.float().abs(), terms)
    ulp = torch.finfo(got.dtype).eps * scale.clamp_min(1e-3)
    assert bool((diff <= ulp * 1.01).all()), f"max diff {diff.max().item()}"
    assert (diff > 0).float().mean().item() < 0.02


def _tables(tokens: int, head_dim: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    freqs = torch.arange(7, 7 + tokens, dtype=torch.float)[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos().to(DEVICE, dtype).unsqueeze(1), emb.sin().to(DEVICE, dtype).unsqueeze(1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [64, 24, 1024])
def test_rms_norm_kernel_matches_reference(dtype, width):
    gen = torch.Generator().manual_seed(width)
    x = (torch.randn(5, 3, width, generator=gen) * 3).to(DEVICE, dtype)
    weight = (1 + torch.randn(width, generator=gen) * 0.5).to(DEVICE, dtype)
    _close(norm.rms_norm_triton(x, weight, 1e-6), norm.rms_norm_reference(x, weight, 1e-6))


def test_rms_norm_kernel_reads_a_strided_slice():
    """A norm over part of a wider tensor's rows (as a split projection hands it)."""
    wide = torch.randn(6, 96, device=DEVICE)
    x, weight = wide[:, 32:], torch.rand(64, device=DEVICE) + 0.5
    _close(norm.rms_norm_triton(x, weight, 1e-6), norm.rms_norm_reference(x, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,head_dim", [(4, 16), (2, 128), (3, 24)])
def test_norm_rope_kernel_matches_reference(dtype, heads, head_dim):
    """Queries cut out of a fused qkv output (a strided view), normalised per head and rotated."""
    gen = torch.Generator().manual_seed(heads * head_dim)
    tokens = 5
    qkv = (torch.randn(tokens, (heads + 2) * head_dim, generator=gen) * 2).to(DEVICE, dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    weight = (1 + torch.randn(head_dim, generator=gen) * 0.5).to(DEVICE, dtype)
    cos, sin = _tables(tokens, head_dim, dtype)
    normed = norm.rms_norm_reference(q, weight, 1e-6)
    expected = norm.apply_rotary(normed, cos, sin)
    # |x·cos| + |rotate_half(x)·sin|: the magnitudes of the two rounded terms each output sums
    size = normed.float().abs()
    partner = torch.cat((size[..., head_dim // 2:], size[..., : head_dim // 2]), dim=-1)
    terms = size * cos.float().abs() + partner * sin.float().abs()
    _close(norm.norm_rope_triton(q, weight, 1e-6, cos, sin), expected, terms)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [64, 40, 2048])
def test_add_rms_norm_kernel_matches_reference(dtype, width):
    """The residual sum and its norm, the delta read from a strided view (an attention output slice)."""
    gen = torch.Generator().manual_seed(width + 1)
    x = (torch.randn(7, width, generator=gen) * 2).to(DEVICE, dtype)
    delta = (torch.randn(7, 2 * width, generator=gen) * 2).to(DEVICE, dtype)[:, width:]
    weight = (1 + torch.randn(width, generator=gen) * 0.5).to(DEVICE, dtype)
    total, normed = norm.add_rms_norm_triton(x, delta, weight, 1e-6)
    ref_total, ref_normed = norm.add_rms_norm_reference(x, delta, weight, 1e-6)
    if DEVICE == "cuda" or dtype != torch.bfloat16:  # the interpreter truncates to bf16
        assert torch.equal(total, ref_total)
    _close(total, ref_total)
    _close(normed, ref_normed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [48, 1024, 3000])
def test_silu_mul_kernel_matches_reference(dtype, width):
    """Gate and up as the two halves of one merged projection's output; rows wider than one program."""
    gen = torch.Generator().manual_seed(width + 2)
    merged = (torch.randn(5, 2 * width, generator=gen) * 3).to(DEVICE, dtype)
    gate, up = merged.split(width, dim=-1)
    _close(norm.silu_mul_triton(gate, up), norm.silu_mul_reference(gate, up))


def test_dispatch_uses_the_reference_off_cuda():
    from neuron.layers.kernels import Kernels

    kernels = Kernels(cpu_ops=False)  # not the C++ kernels (test_cpu_ops.py)
    x = torch.randn(3, 2, 16)
    weight, (cos, sin) = torch.rand(16) + 0.5, _tables(3, 16, torch.float32)
    assert torch.equal(norm.rms_norm(kernels, x, weight, 1e-6), norm.rms_norm_reference(x, weight, 1e-6))
    if DEVICE == "cpu":
        expected = norm.apply_rotary(norm.rms_norm_reference(x, weight, 1e-6), cos, sin)
        assert torch.equal(norm.norm_rope(kernels, x, weight, 1e-6, cos, sin), expected)


def test_norm_rope_refuses_an_odd_head_dim():
    x = torch.randn(2, 1, 15, device=DEVICE)
    cos = torch.ones(2, 1, 15, device=DEVICE)
    with pytest.raises(ValueError, match="even head_dim"):
        norm.norm_rope_triton(x, torch.ones(15, device=DEVICE), 1e-6, cos, cos)


COMPILE = textwrap.dedent("""
    import re
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from neuron.layers.norm import _ROUNDED
    from neuron.layers.triton_norm import add_rms_norm_kernel, norm_rope_kernel, rms_norm_kernel, silu_mul_kernel

    def compile_for(kernel, dtype, capability, block):
        constexprs = {"BLOCK": block, "LIBDEVICE": True} if kernel is silu_mul_kernel else {"BLOCK": block}
        pointers = {name: dtype for name in kernel.arg_names if name.endswith("_ptr")}
        signature = {name: "constexpr" if name in constexprs else "*" + pointers[name] if name in pointers
                     else "fp32" if name == "eps" else "i32" for name in kernel.arg_names}
        source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
        compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32), options=dict(_ROUNDED))
        assert compiled.asm["cubin"]
        return compiled.asm["ptx"]

    compile_for(rms_norm_kernel, "bf16", 90, 4096)
    compile_for(add_rms_norm_kernel, "bf16", 90, 4096)
    silu = compile_for(silu_mul_kernel, "bf16", 90, 1024)
    # Triton's own exp is x * -log2(e) into ex2.approx; the launched kernel uses libdevice's expf
    assert not re.search(r"mul[.a-z]*f32[^;]*0fBFB8AA3B;", silu), "silu uses the approximate exp"
    rope = compile_for(norm_rope_kernel, "bf16", 90, 128)
    # each rotary product is rounded before the sum: no multiply-add may fuse them
    assert not re.search(r"\\bfma\\.", rope), "the rotary step contracted a product into its sum"
    compile_for(norm_rope_kernel, "fp32", 80, 64)
""")


@pytest.mark.slow
def test_kernels_compile_for_nvidia_gpus():
    """The interpreter accepts code the GPU compiler refuses: compile the kernels to cubin for sm_90
    and sm_80 as the runtime launches them, no GPU needed, in a fresh process (this one's Triton
    interprets). Their PTX shows the two roundings the first GPU run found missing: silu's exact
    exp, and no fused multiply-add across the rotary step's products."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
