"""Quantized safetensors checkpoints (FP8 block-wise, AWQ, GPTQ with and without act-order,
compressed-tensors W4A16/W8A16): the weights neuron holds equal the format's dequantization, and
greedy tokens and logprobs at tp 1, 2 and 4 equal transformers' on the dequantized model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoints import assert_matches_reference, build_checkpoint, greedy_with_logprobs
from quant_checkpoints import (
    awq_checkpoint,
    compressed_tensors_checkpoint,
    dense_checkpoint,
    fp8_checkpoint,
    gptq_checkpoint,
)

from neuron import LLM, SamplingParams
from neuron.engine.model_config import load_config
from neuron.errors import ConfigError
from neuron.layers.quantized import QuantizedWeight
from neuron.layers.tensor_parallel import Shard
from neuron.models.loader import CheckpointReader, safetensors_files
from neuron.models.quant_formats import PrequantizedReader, stored_format

pytestmark = pytest.mark.usefixtures("exact_quantized_products")  # logprobs to 1e-3 of transformers

# Every width a multiple of 128 (FP8 blocks, 128-input groups), split by tp 4 on group boundaries
# except where a test means otherwise.
SHAPE = dict(vocab_size=301, hidden_size=256, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=2, head_dim=64, tie_word_embeddings=False, initializer_range=0.05)
PROMPTS = [[5, 17, 200, 3], list(range(10, 50))]

FORMATS = {
    "fp8": lambda src, dst: fp8_checkpoint(src, dst),
    "fp8-bf16-scales": lambda src, dst: fp8_checkpoint(src, dst, scale_dtype=torch.bfloat16),
    "awq": lambda src, dst: awq_checkpoint(src, dst),
    "gptq": lambda src, dst: gptq_checkpoint(src, dst),
    "gptq-act-order": lambda src, dst: gptq_checkpoint(src, dst, act_order=True),
    "gptq-8bit": lambda src, dst: gptq_checkpoint(src, dst, bits=8, group=64),
    "w4a16": lambda src, dst: compressed_tensors_checkpoint(src, dst),
    "w4a16-asym": lambda src, dst: compressed_tensors_checkpoint(src, dst, symmetric=False),
    "w8a16": lambda src, dst: compressed_tensors_checkpoint(src, dst, bits=8),
}


def _stored(path) -> dict:
    """The checkpoint's quantized format, as the model's configuration reads it."""
    return stored_format(load_config(Path(path))["quantization_config"])


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("src"), seed=5, **SHAPE)


@pytest.fixture(scope="module")
def written(source, tmp_path_factory):
    cache = {}

    def get(fmt):
        if fmt not in cache:
            tmp = tmp_path_factory.mktemp(fmt)
            path, dense = FORMATS[fmt](source, tmp / "q")
            cache[fmt] = (path, dense, dense_checkpoint(source, tmp / "dense", dense))
        return cache[fmt]
    return get


@pytest.mark.parametrize("fmt", FORMATS)
def test_held_weights_equal_the_formats_dequantization(written, fmt):
    path, dense, _ = written(fmt)
    spec = _stored(path)
    with PrequantizedReader(CheckpointReader(safetensors_files(path)), spec) as r:
        for name, want in dense.items():
            w = r.read_weight(name)
            assert isinstance(w, QuantizedWeight), name
            assert torch.equal(w.dequantize(), want), name
            n, k = want.shape
            half = r.read_weight(name, 1, k // 2, k)  # a row-parallel rank's share
            assert torch.equal(half.dequantize(), want[:, k // 2:]), name
            rows = r.read_weight(name, 0, 64, n)
            assert torch.equal(rows.dequantize(), want[64:]), name


@pytest.mark.parametrize("fmt,tp", [(f, 1) for f in FORMATS] + [
    ("fp8", 2), ("awq", 2), ("gptq-act-order", 2), ("w4a16", 2),
    pytest.param("fp8", 4, marks=pytest.mark.slow), pytest.param("gptq-act-order", 4, marks=pytest.mark.slow),
    pytest.param("awq", 4, marks=pytest.mark.slow), pytest.param("w8a16", 4, marks=pytest.mark.slow)])
def test_generation_matches_transformers_on_the_dequantized_model(written, fmt, tp):
    from transformers import Qwen3ForCausalLM

    path, _, dense_path = written(fmt)
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5, ignore_eos=True)
    with LLM(str(path), tensor_parallel_size=tp, device="cpu", dtype="float32") as llm:
        layer = llm.engine.executor.rank0.models["model"].model.layers[0]
        assert isinstance(layer.mlp.down.weight, QuantizedWeight)
        assert llm.engine.model.quantization.split()[0] == _stored(path)["method"]
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    reference = Qwen3ForCausalLM.from_pretrained(dense_path, dtype=torch.float32).eval()
    for prompt, out in zip(PROMPTS, outs):
        assert_matches_reference(out.outputs[0], *greedy_with_logprobs(reference, prompt, 8))


def test_fp8_matches_transformers_own_dequantization(written):
    """transformers reads the FP8 checkpoint itself (on CPU it dequantizes block by block)."""
    from transformers import AutoModelForCausalLM

    path, _, _ = written("fp8")
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    held = reference.state_dict()
    spec = _stored(path)
    with PrequantizedReader(CheckpointReader(safetensors_files(path)), spec) as r:
        for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"):
            assert torch.equal(r.read_weight(name).dequantize(), held[name].float())
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, ignore_eos=True)
    with LLM(str(path), device="cpu", dtype="float32") as llm:
        got = llm.generate({"prompt_token_ids": PROMPTS[1]}, params)[0].outputs[0]
    tokens, logprobs = greedy_with_logprobs(reference, PROMPTS[1], 6)
    assert got.token_ids == tokens
    assert max(abs(v - logprobs[s][t].item()) for s, lp in enumerate(got.logprobs) for t, v in lp.items()) <= 1e-3


def test_compressed_tensors_matches_its_own_decompression(written):
    """compressed-tensors' unpacking (its helpers, as its decompressor runs them) gives the weights neuron holds."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from safetensors.torch import load_file

    path, _, _ = written("w4a16-asym")
    tensors = load_file(path / "model.safetensors")
    prefix = "model.layers.0.mlp.down_proj"
    n, k = tensors[f"{prefix}.weight_shape"].tolist()
    q = unpack_from_int32(tensors[f"{prefix}.weight_packed"], 4, torch.Size([n, k]))
    zp = unpack_from_int32(tensors[f"{prefix}.weight_zero_point"], 4, torch.Size([n, k // 128]), packed_dim=0)
    scale = tensors[f"{prefix}.weight_scale"].float()
    want = (q.float() - zp.float().repeat_interleave(128, 1)) * scale.repeat_interleave(128, 1)
    spec = _stored(path)
    with PrequantizedReader(CheckpointReader(safetensors_files(path)), spec) as r:
        assert torch.equal(r.read_weight(f"{prefix}.weight").dequantize(), want)


def test_fp8_split_off_its_blocks_is_read(written):
    """A row-parallel share starting inside a block (inputs [64, 256) against 128-wide blocks) is
    held in groups of 64, each taking its block's scale; it used to be refused."""
    path, dense, _ = written("fp8")
    spec = _stored(path)
    name = "model.layers.0.self_attn.o_proj.weight"
    with PrequantizedReader(CheckpointReader(safetensors_files(path)), spec) as r:
        w = r.read_weight(name, 1, 64, 256)
    assert isinstance(w, QuantizedWeight) and (w.group, w.k) == (64, 192)
    assert torch.equal(w.dequantize(), dense[name][:, 64:256])


def test_fp8_scales_that_do_not_cover_the_weight_are_refused(written):
    """A scale grid other than the weight's blocks (here: the config saying 64 x 64 where the file
    has 128 x 128) is refused naming the tensor, not read into wrong scales."""
    path, _, _ = written("fp8")
    spec = dict(_stored(path), block=[64, 64])
    with PrequantizedReader(CheckpointReader(safetensors_files(path)), spec) as r:
        with pytest.raises(ConfigError, match=r"o_proj.weight_scale_inv has shape \[2, 4\]; an fp8 weight of "
                                              r"256 x 512 in blocks of 64 x 64 needs \[4, 8\]"):
            r.read_weight("model.layers.0.self_attn.o_proj.weight", 1, 0, 256)


@pytest.mark.parametrize("qc,message", [
    ({"quant_method": "bitsandbytes"}, "checkpoint quantization 'bitsandbytes' is not supported"),
    ({"quant_method": "fp8", "weight_block_size": None}, "block-wise scales"),
    ({"quant_method": "fp8", "weight_block_size": [0, 128]}, r"weight_block_size \[0, 128\]"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "GEMM layout"),
    ({"quant_method": "gptq", "bits": 3}, "4 or 8 bits"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"g": {"weights": {"type": "float", "num_bits": 8, "strategy": "tensor"}}}}, "not supported"),
])
def test_what_is_not_read_is_refused_before_loading(source, tmp_path, qc, message):
    import json
    import shutil

    dst = tmp_path / "ckpt"
    shutil.copytree(source, dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=message):
        load_config(dst)


MOE = dict(vocab_size=301, hidden_size=256, intermediate_size=512, moe_intermediate_size=256, num_experts=4,
           num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
           max_position_embeddings=512, norm_topk_prob=True, tie_word_embeddings=False, initializer_range=0.05,
           eos_token_id=None, bos_token_id=None)


def _moe_checkpoint(path, seed: int = 7, **overrides):
    """A tiny random Qwen3-MoE checkpoint written by transformers, its experts stored one by one."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**MOE, **overrides})).save_pretrained(path, safe_serialization=True)
    return path


@pytest.mark.parametrize("fmt", ["fp8", "int8-at-load"])
def test_moe_experts_stay_quantized(tmp_path, fmt):
    """A Qwen3-MoE checkpoint's experts, stored as FP8 or quantized at load, run quantized (the loop
    path through the kernel) and match transformers on the same rounded weights."""
    from transformers import Qwen3MoeForCausalLM

    from neuron.layers.quantized import quantize_int8

    _moe_checkpoint(tmp_path / "hf")
    if fmt == "fp8":
        path, dense = fp8_checkpoint(tmp_path / "hf", tmp_path / "q")
        kwargs = {}
    else:
        from safetensors.torch import load_file

        tensors = load_file(tmp_path / "hf" / "model.safetensors")
        path, kwargs = tmp_path / "hf", {"quantization": "int8"}
        dense = {n: quantize_int8(w).dequantize() for n, w in tensors.items()
                 if n.endswith("proj.weight") or n == "lm_head.weight"}  # tp 1: every linear weight per row
        assert "lm_head.weight" in dense  # int8 at load takes the head too
    reference_dir = dense_checkpoint(tmp_path / "hf", tmp_path / "dense", dense)
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5, ignore_eos=True)
    with LLM(str(path), device="cpu", dtype="float32", **kwargs) as llm:
        moe = llm.engine.executor.rank0.models["model"].model.layers[0].mlp
        assert moe.quantized and isinstance(moe.w_down[0], QuantizedWeight)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    reference = Qwen3MoeForCausalLM.from_pretrained(reference_dir, dtype=torch.float32).eval()
    for prompt, out in zip(PROMPTS, outs):
        assert_matches_reference(out.outputs[0], *greedy_with_logprobs(reference, prompt, 8))


# FP8 blocks wider than a rank's share, as Qwen3-30B-A3B-FP8's at tp 4 (768-wide experts, 192 rows
# and inputs a rank, 128-wide blocks), scaled down: blocks of 64 x 64 and 192-wide attention (4
# heads of 48), MLP and experts, so tp 2 gives each rank 96 and tp 4 gives 48, cutting blocks in the
# column-parallel rows and the row-parallel inputs. Whole tensors stay whole blocks, which
# transformers' own dequantization (the oracle) needs.
CUT_BLOCK = (64, 64)
CUT = dict(hidden_size=128, intermediate_size=192, num_attention_heads=4, num_key_value_heads=4, head_dim=48)


@pytest.fixture(scope="module")
def cut_fp8(tmp_path_factory):
    """{"dense" | "moe": path} of FP8 checkpoints whose blocks tp 2 and 4 cut."""
    tmp = tmp_path_factory.mktemp("cut")
    dense = build_checkpoint(tmp / "dense", seed=6, **dict(SHAPE, **CUT))
    moe = _moe_checkpoint(tmp / "moe", seed=8, **CUT, moe_intermediate_size=192)
    return {kind: fp8_checkpoint(src, tmp / f"{kind}-fp8", block=CUT_BLOCK)[0]
            for kind, src in (("dense", dense), ("moe", moe))}


def _transformers_fp8(path):
    """transformers reading the FP8 checkpoint itself (on CPU it dequantizes block by block)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("tp", [2, 4])
def test_fp8_blocks_cut_by_a_split_are_held_as_transformers_dequantizes_them(cut_fp8, tp):
    """Every rank's rows (column-parallel) and inputs (row-parallel) of every linear weight, experts
    included, stay quantized and equal the slice of transformers' dequantized weight."""
    for kind, path in cut_fp8.items():
        held = _transformers_fp8(path).state_dict()
        spec = _stored(path)
        with PrequantizedReader(CheckpointReader(safetensors_files(path)), spec) as r:
            for name, want in _linear_weights(held):
                for rank in range(tp):
                    for dim in (0, 1):
                        start, end = Shard(rank, tp).even(want.shape[dim], name)
                        w = r.read_weight(name, dim, start, end)
                        assert isinstance(w, QuantizedWeight), (name, rank, dim)
                        assert torch.equal(w.dequantize(), want.narrow(dim, start, end - start)), (name, rank, dim)
            # groups of gcd(64, start, end), the kernels' plain layout: rank 0 of 2 holds inputs
            # [0, 96) as 3 groups of 32 (blocks 0, 0, 1); rank 2 of 4 holds [96, 144) as 3 of 16 (1, 1, 2)
            down = r.read_weight("model.layers.0.mlp.down_proj.weight" if kind == "dense" else
                                 "model.layers.0.mlp.experts.1.down_proj.weight", 1, *{2: (0, 96), 4: (96, 144)}[tp])
            assert (down.group, down.input_index, tuple(down.scale.shape)) == ({2: 32, 4: 16}[tp], None, (128, 3))


def _linear_weights(held: dict):
    """(name, dense [n, k]) of each linear weight, transformers' fused experts split back per expert."""
    for name, w in held.items():
        if name.endswith("proj.weight") and "lm_head" not in name:
            yield name, w
        elif name.endswith("experts.gate_up_proj"):
            prefix = name.removesuffix("gate_up_proj")
            for e, expert in enumerate(w):  # [2 * inter, hidden]: gate's rows, then up's
                gate, up = expert.chunk(2)
                yield f"{prefix}{e}.gate_proj.weight", gate
                yield f"{prefix}{e}.up_proj.weight", up
        elif name.endswith("experts.down_proj"):
            prefix = name.removesuffix("down_proj")
            for e, down in enumerate(w):
                yield f"{prefix}{e}.down_proj.weight", down


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_fp8_blocks_cut_by_a_split_generate_as_transformers(cut_fp8, kind, tp):
    """Greedy tokens and logprobs (within 1e-3) at tp 2 and 4 equal transformers' on its own
    dequantization of the same FP8 checkpoint, every rank holding partial blocks."""
    path = cut_fp8[kind]
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5, ignore_eos=True)
    with LLM(str(path), tensor_parallel_size=tp, device="cpu", dtype="float32") as llm:
        layer = llm.engine.executor.rank0.models["model"].model.layers[0]
        down = layer.mlp.w_down[0] if kind == "moe" else layer.mlp.down.weight
        assert isinstance(down, QuantizedWeight) and down.k == 192 // tp
        assert isinstance(layer.attn.o_proj.weight, QuantizedWeight)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    reference = _transformers_fp8(path)
    for prompt, out in zip(PROMPTS, outs):
        assert_matches_reference(out.outputs[0], *greedy_with_logprobs(reference, prompt, 8))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["awq", "fp8", "gptq-act-order"])
def test_quantized_checkpoints_on_a_gpu_match_the_cpu(written, fmt):
    """On CUDA the Triton kernel (or, where the self-check failed it, the reference) runs the same
    checkpoint to the same greedy tokens as the CPU kernel, in fp32 and within bf16's reach in bf16."""
    path, _, _ = written(fmt)
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=3, ignore_eos=True)
    runs = {}
    for device, dtype in (("cpu", "float32"), ("cuda", "float32"), ("cuda", "bfloat16")):
        with LLM(str(path), device=device, dtype=dtype) as llm:
            runs[device, dtype] = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                                                       params)]
    for cpu, gpu in zip(runs["cpu", "float32"], runs["cuda", "float32"]):
        assert cpu.token_ids == gpu.token_ids
        for a, b in zip(cpu.logprobs, gpu.logprobs):
            assert max(abs(a[t] - b[t]) for t in a if t in b) <= 1e-3
    for cpu, gpu in zip(runs["cpu", "float32"], runs["cuda", "bfloat16"]):
        assert cpu.token_ids[:3] == gpu.token_ids[:3]
