"""Quantized weights: the CPU kernel against dequantize-then-matmul, and load-time int8 end to end
against transformers running the same int8-rounded weights."""

from __future__ import annotations

import pytest
import torch
from checkpoints import ODD, assert_matches_reference, build_checkpoint, greedy_with_logprobs

from neuron import LLM, SamplingParams
from neuron.errors import ConfigError
from neuron.layers import cpu_ops, quantized
from neuron.layers.kernels import Kernels
from neuron.layers.quantized import QuantizedWeight, quantize_int8

pytestmark = pytest.mark.usefixtures("exact_quantized_products")  # logprobs to 1e-3 of transformers
needs_kernel = pytest.mark.skipif(cpu_ops.library() is None, reason="the CPU kernels could not be built here")
KERNELS = Kernels(quant_exact=True)  # the exact kernel; the integer one: test_quant_int.py


def _random(bits: int, n: int, k: int, group: int, per_super: int = 1, sub: bool = False, offset: bool = False,
            seed: int = 0) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    groups = k // group
    codes = torch.randint(0, 256, (n, k * bits // 8), dtype=torch.uint8, generator=g)

    def top():
        return torch.rand(n, groups // per_super, generator=g) * 0.01

    def subs():
        return torch.randint(-64, 64, (n, groups), dtype=torch.int8, generator=g) if sub else None
    return QuantizedWeight(codes=codes, k=k, bits=bits, group=group, per_super=per_super, scale=top(),
                           scale_sub=subs(), offset=top() if offset else None, offset_sub=subs() if offset else None,
                           format="test")


LAYOUTS = {
    "int8 per row": dict(bits=8, group=192),
    "8-bit groups of 32 (Q8_0)": dict(bits=8, group=32),
    "8-bit groups of 16 under two-level scales (Q6_K)": dict(bits=8, group=16, per_super=16, sub=True),
    "8-bit groups of 16, two-level scales and offsets (Q2_K)": dict(bits=8, group=16, per_super=16, sub=True,
                                                                   offset=True),
    "8-bit groups of 32 with offsets (Q5_1)": dict(bits=8, group=32, offset=True),
    "4-bit with offsets (Q4_0)": dict(bits=4, group=32, offset=True),
    "4-bit, two-level scales and offsets (Q4_K)": dict(bits=4, group=32, per_super=8, sub=True, offset=True),
    "4-bit groups of 128 (AWQ-like)": dict(bits=4, group=128, offset=True),
}


@needs_kernel
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 16])
def test_kernel_equals_dequantize_then_matmul(layout, rows):
    spec = LAYOUTS[layout]
    k = 192 if spec["group"] == 192 else 512
    w = _random(n=37, k=k, **spec)  # 37 rows: whole tiles and a ragged end
    x = torch.randn(rows, k)
    bias = torch.randn(37)
    ref = torch.nn.functional.linear(x.double(), w.dequantize().double(), bias.double())
    got = quantized.linear(KERNELS, x, w, bias)
    assert got.dtype == torch.float32
    scale = ref.abs().max().item()
    assert (got.double() - ref).abs().max().item() <= 1e-5 * scale


def test_int8_rounds_each_row_to_its_own_scale():
    w = torch.randn(8, 64) * torch.logspace(-3, 1, 8).unsqueeze(1)
    q = quantize_int8(w)
    assert q.codes.dtype == torch.uint8 and q.scale.shape == (8, 1)
    err = (q.dequantize() - w).abs().amax(dim=1)
    assert torch.all(err <= q.scale.squeeze(1) / 2 * (1 + 1e-6))
    assert q.codes_int().abs().amax(dim=1).tolist() == [127] * 8
    zero = quantize_int8(torch.zeros(2, 32))
    assert torch.equal(zero.dequantize(), torch.zeros(2, 32))


def test_vocabulary_padding_rows_are_zero():
    w = _random(bits=4, n=4, k=512, group=32, per_super=8, sub=True, offset=True)
    padded = w.pad_rows(6)
    assert torch.equal(padded.dequantize()[:4], w.dequantize())
    assert torch.equal(padded.dequantize()[4:], torch.zeros(2, 512))
    assert torch.equal(padded.take_rows(torch.tensor([5, 1])).dequantize()[1], w.dequantize()[1])


def test_weights_of_different_layouts_stack_by_parts():
    a, b = _random(bits=4, n=6, k=64, group=32, offset=True), _random(bits=8, n=3, k=64, group=16, seed=1)
    stacked = quantized.stack([a, b], torch.float32, "cpu")
    assert isinstance(stacked, quantized.StackedWeight) and stacked.shape == (9, 64)
    x = torch.randn(2, 64)
    ref = x @ torch.cat([a.dequantize(), b.dequantize()]).T
    assert torch.allclose(quantized.linear(KERNELS, x, stacked), ref, atol=1e-5)
    same = quantized.stack([a, a], torch.float32, "cpu")
    assert isinstance(same, QuantizedWeight) and same.shape == (12, 64)


# ---- load-time int8 end to end ------------------------------------------------------------------

PROMPTS = [[5, 17, 200, 3], list(range(10, 50))]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("int8"), seed=1, **ODD)


def _int8_reference(path, tp: int, quantize=quantize_int8, head: bool = True):
    """transformers with every linear weight replaced by its rounding as neuron's ranks make it:
    per output row (and group), and for the row-parallel o_proj and down_proj per rank's slice of
    the inputs; the LM head too where `head` (int8: its rows are the vocabulary's, whole on each
    rank, so the split changes nothing; a tied head is untied from the embedding, which stays)."""
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name != "lm_head":
            w = mod.weight.data
            if name.endswith(("o_proj", "down_proj")):
                mod.weight.data = torch.cat([quantize(c).dequantize() for c in w.chunk(tp, dim=1)], 1)
            else:
                mod.weight.data = quantize(w).dequantize()
    if head:
        model.lm_head.weight = torch.nn.Parameter(quantize(model.lm_head.weight.data).dequantize())
    return model


@pytest.mark.parametrize("method,tp", [("int8", 1), ("int8", 2), pytest.param("int8", 4, marks=pytest.mark.slow),
                                       ("fp8", 1), ("fp8", 2)])
def test_quantization_at_load_matches_transformers_on_the_rounded_weights(checkpoint, method, tp):
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5, ignore_eos=True)
    with LLM(str(checkpoint), tensor_parallel_size=tp, device="cpu", dtype="float32", quantization=method) as llm:
        model = llm.engine.executor.rank0.models["model"].model
        assert isinstance(model.layers[0].mlp.gate_up.weight, QuantizedWeight)
        # int8 takes the LM head too (as 8-bit GGUF files do); fp8 leaves it in the model dtype (fp32 on
        # CPU: held as panels)
        assert isinstance(model.lm_head.weight, QuantizedWeight if method == "int8" else cpu_ops.PanelWeight)
        quant_bytes = llm.engine.executor.weight_bytes
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    reference = _int8_reference(checkpoint, tp, quantized.QUANTIZERS[method], head=method == "int8")
    for prompt, out in zip(PROMPTS, outs):
        assert_matches_reference(out.outputs[0], *greedy_with_logprobs(reference, prompt, 8))
    with LLM(str(checkpoint), tensor_parallel_size=tp, device="cpu", dtype="float32") as llm:
        dense_bytes = llm.engine.executor.weight_bytes
    assert all(q < d for q, d in zip(quant_bytes, dense_bytes))


@pytest.mark.gpu
def test_int8_at_load_on_a_gpu_matches_the_cpu(checkpoint):
    """On CUDA, int8 at load (its LM head too) runs through the Triton kernel (or, where the
    self-check failed it, the reference) to the CPU's greedy tokens and logprobs in fp32."""
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=3, ignore_eos=True)
    runs = {}
    for device in ("cpu", "cuda"):
        with LLM(str(checkpoint), device=device, dtype="float32", quantization="int8") as llm:
            assert isinstance(llm.engine.executor.rank0.models["model"].model.lm_head.weight, QuantizedWeight)
            runs[device] = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]
    for cpu, gpu in zip(runs["cpu"], runs["cuda"]):
        assert cpu.token_ids == gpu.token_ids
        for a, b in zip(cpu.logprobs, gpu.logprobs):
            assert max(abs(a[t] - b[t]) for t in a if t in b) <= 1e-3


def test_int8_kernel_and_reference_paths_agree(checkpoint, monkeypatch):
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, ignore_eos=True)
    runs = []
    for reference in ("0", "1"):
        monkeypatch.setenv("NEURON_NO_QUANT_KERNELS", reference)  # read when the model loads
        with LLM(str(checkpoint), device="cpu", dtype="float32", quantization="int8") as llm:
            assert llm.engine.executor.rank0.models["model"].kernels.quant_kernels == (reference == "0")
            runs.append(llm.generate({"prompt_token_ids": PROMPTS[1]}, params)[0].outputs[0])
    assert runs[0].token_ids == runs[1].token_ids
    for a, b in zip(runs[0].logprobs, runs[1].logprobs):
        assert a.keys() == b.keys() and max(abs(a[t] - b[t]) for t in a) < 1e-4


def test_unknown_quantization_is_refused():
    with pytest.raises(ConfigError, match="quantization"):
        LLM(device="cpu", quantization="int3")


def test_served_int8_says_so_in_health_and_models(checkpoint):
    import httpx
    from server_harness import LiveServer, client, real_engine

    with LiveServer(real_engine(str(checkpoint), 1, name="odd", quantization="int8")) as server:
        server.wait_ready()
        assert httpx.get(f"{server.url}/health").json()["quantization"] == "int8"
        card = client(server).models.list().data[0]
        assert card.model_extra["quantization"] == "int8"
        out = client(server).completions.create(model="odd", prompt=PROMPTS[0], max_tokens=4, temperature=0,
                                                extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 4


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 5])
def test_fp8_codes_widen_exactly(rows):
    """Every e4m3 byte (subnormals, both zeros, the largest) through the kernel's bit-level widening
    equals torch's float8_e4m3fn conversion times the block scale."""
    codes = torch.arange(256, dtype=torch.uint8).repeat(2)
    codes = codes[(codes.view(torch.float8_e4m3fn).float().isfinite())]  # NaN bytes are never weights
    k = codes.numel() // 16 * 16
    n = 12
    w = QuantizedWeight(codes=codes[:k].repeat(n, 1).roll(3, dims=1).contiguous(), k=k, bits=8, group=16,
                        scale=torch.rand(n, k // 16) * 2.0 ** torch.randint(-12, 7, (n, k // 16)).float(),
                        format="fp8", fp8=True)
    x = torch.randn(rows, k)
    ref = torch.nn.functional.linear(x.double(), w.dequantize().double())
    got = quantized.linear(KERNELS, x, w)
    assert (got.double() - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    one = torch.zeros(1, k)
    for c in (0, 7, k - 1):  # a single input picks out single weights: exact
        one.zero_()
        one[0, c] = 1.0
        assert torch.equal(quantized.linear(KERNELS, one, w)[0], w.dequantize()[:, c])


@needs_kernel
@pytest.mark.parametrize("k,group", [(48, 16), (96, 32), (192, 64)])
def test_kernel_takes_fp8_blocks_cut_by_a_split(k, group):
    """A rank's share of FP8 blocks that tp cuts, held in groups of gcd(block, start, end)
    (quant_formats), runs through the kernel, not the reference."""
    g = torch.Generator().manual_seed(2)
    codes = (torch.randn(37, k, generator=g) * 40).to(torch.float8_e4m3fn).view(torch.uint8)
    w = QuantizedWeight(codes=codes, k=k, bits=8, group=group, scale=torch.rand(37, k // group, generator=g),
                        format="fp8", fp8=True)
    x = torch.randn(2, k, generator=g)
    ref = torch.nn.functional.linear(x.double(), w.dequantize().double())
    assert (quantized.linear(KERNELS, x, w).double() - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    assert w.layout  # set on the kernel's path only


@needs_kernel
def test_half_precision_steps_use_the_kernel_in_fp32():
    w = _random(bits=4, n=40, k=256, group=32, offset=True)
    x = torch.randn(3, 256).bfloat16()
    got = quantized.linear(KERNELS, x, w)
    assert got.dtype == torch.bfloat16
    ref = torch.nn.functional.linear(x.double(), w.dequantize().double())
    assert torch.equal(got, ref.float().to(torch.bfloat16)) or \
        (got.double() - ref).abs().max().item() <= 2 ** -7 * ref.abs().max().item()  # one bf16 rounding
