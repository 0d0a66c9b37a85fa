"""GGUF files as checkpoints: every supported tensor type reads back exactly as `gguf.dequantize`
reads it, and Qwen3 and Llama files (q and k permuted as llama.cpp writes them) generate the tokens
and logprobs transformers gets from the same file, split across 1, 2 and 4 ranks."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from checkpoints import assert_matches_reference, build_checkpoint, greedy_with_logprobs, model_config
from gguf_files import quantize, random_blocks, write_gguf, write_tensors

from neuron import LLM, SamplingParams
from neuron.engine.tokenizer import Tokenizer
from neuron.errors import ConfigError, ModelNotFound
from neuron.executor.executor import Executor
from neuron.layers.quantized import QuantizedWeight
from neuron.models import gguf as neuron_gguf
from neuron.models.loader import resolve_model_path

pytestmark = pytest.mark.usefixtures("exact_quantized_products")  # logprobs to 1e-3 of transformers
gguf = pytest.importorskip("gguf", reason="the gguf package is a dependency of neuron; this install lacks it")

TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL",
         "IQ4_XS"]
# Shapes every type can hold (K-quant rows are multiples of 256) and every tp up to 4 can split:
# o_proj's 256 inputs split in 32s (Q8_0) and down_proj's 1024 in 256s (K-quants) at tp 4.
SHAPE = dict(vocab_size=301, hidden_size=256, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, tie_word_embeddings=False, initializer_range=0.05)
MIXED = {"attn_q.weight": "Q4_K", "attn_k.weight": "Q5_K", "attn_v.weight": "Q6_K", "attn_output.weight": "Q8_0",
         "ffn_gate.weight": "Q4_0", "ffn_up.weight": "BF16", "ffn_down.weight": "Q6_K", "token_embd.weight": "Q8_0",
         "output.weight": "Q4_K", "default": "F16"}
# every type of TYPES past Q4_0 and Q6_K, where tp 2 can split them (o_proj's 128 inputs a rank: 32-blocks)
NEWER = {"attn_q.weight": "Q2_K", "attn_k.weight": "Q3_K", "attn_v.weight": "Q5_1", "attn_output.weight": "Q5_0",
         "ffn_gate.weight": "Q4_1", "ffn_up.weight": "IQ4_NL", "ffn_down.weight": "IQ4_XS", "token_embd.weight": "IQ4_NL",
         "output.weight": "Q3_K", "default": "F16"}
PROMPTS = [[5, 17, 200, 3], list(range(10, 50))]
# the fixture's largest rounding error of 0.1-scaled normal values: 2- and 3-bit codes are coarse
FAIR = {"Q2_K": 0.12, "Q3_K": 0.08}


@pytest.mark.parametrize("kind", TYPES)
def test_each_type_reads_back_as_gguf_dequantizes_it(kind):
    x = np.random.default_rng(0).standard_normal((5, 512)).astype(np.float32) * 0.1
    data, qtype = quantize(x, kind)
    reference = data if kind == "F32" else gguf.dequantize(data, qtype)
    if kind in neuron_gguf._DECODERS:
        block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
        w = neuron_gguf._DECODERS[kind](data.reshape(5, -1, block_bytes), 512)
        assert isinstance(w, QuantizedWeight) and w.shape == (5, 512)
        ours = w.dequantize()
    else:
        ours = neuron_gguf._DENSE[kind](data)
    assert torch.equal(ours, torch.from_numpy(np.asarray(reference, dtype=np.float32)))
    assert np.abs(reference - x).max() < FAIR.get(kind, 0.05)  # the fixture's blocks are a fair rounding of x


@pytest.mark.parametrize("kind", list(neuron_gguf._DECODERS))
def test_random_blocks_read_back_exactly_whole_and_split_across_two_ranks(tmp_path, kind):
    """Random bytes are valid blocks of every type: each code, sub-scale and sign pattern, under
    modest fp16 scales. Read from a file whole and as tp 2's ranks read it (inputs split on the
    256-value boundary, outputs anywhere), each part equals gguf's dequantization of those bytes;
    the memory plan counts the bytes the layout holds."""
    qtype = gguf.GGMLQuantizationType[kind]
    data = random_blocks(kind, 6, 512, seed=len(kind))
    path = write_tensors(tmp_path / "random.gguf", {"blk.0.ffn_down.weight": (data, qtype)})
    reference = torch.from_numpy(gguf.dequantize(data, qtype))
    reader = neuron_gguf.GGUFReader(path, {"num_attention_heads": 4, "model_type": "qwen3"})
    name = "model.layers.0.mlp.down_proj.weight"
    whole = reader.read_weight(name)
    assert isinstance(whole, QuantizedWeight) and whole.format == kind
    assert torch.equal(whole.dequantize(), reference)
    for start, end in ((0, 256), (256, 512)):
        assert torch.equal(reader.read_weight(name, dim=1, start=start, end=end).dequantize(), reference[:, start:end])
    assert torch.equal(reader.read_weight(name, dim=0, start=1, end=4).dequantize(), reference[1:4])
    held = sum(t.numel() * t.element_size() for t in whole.tensors())
    assert neuron_gguf.held_bytes(reader.file.tensors["blk.0.ffn_down.weight"], 4) == held  # the memory plan's count


@pytest.mark.parametrize("kind", ["Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"])
def test_the_kernel_librarys_codes_are_numpys(monkeypatch, kind):
    """Each type's blocks rewritten in one pass by the kernel library (csrc/gguf_codes.h) and by the
    numpy decoders it stands in for: the same codes, scales and offsets, byte for byte."""
    from neuron.layers import cpu_ops

    if cpu_ops.library() is None:
        pytest.skip("the kernel library cannot be built here (no C++ compiler): the numpy decoders run alone")
    qtype = gguf.GGMLQuantizationType[kind]
    blocks = random_blocks(kind, 5, 1024, seed=3).reshape(5, -1, gguf.GGML_QUANT_SIZES[qtype][1])
    fast = neuron_gguf._DECODERS[kind](blocks, 1024)
    monkeypatch.setattr(neuron_gguf, "_fast_codes", lambda *args: None)
    slow = neuron_gguf._DECODERS[kind](blocks, 1024)
    assert len(fast.tensors()) == len(slow.tensors())
    for a, b in zip(fast.tensors(), slow.tensors()):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("kind", list(neuron_gguf._DENSE))
def test_dense_types_read_back_whole_and_split_across_two_ranks(tmp_path, kind):
    """F32, F16 and BF16 tensors split on their inputs as a row-parallel layer's ranks read them
    (BF16's 16-bit words are its values, not byte pairs)."""
    x = np.random.default_rng(1).standard_normal((6, 512)).astype(np.float32)
    data, qtype = quantize(x, kind)
    path = write_tensors(tmp_path / "dense.gguf", {"blk.0.ffn_down.weight": (data, qtype)})
    reference = torch.from_numpy(np.asarray(data if kind == "F32" else gguf.dequantize(data, qtype), np.float32))
    reader = neuron_gguf.GGUFReader(path, {"num_attention_heads": 4, "model_type": "qwen3"})
    name = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(reader.read(name), reference)
    for start, end in ((0, 256), (256, 512)):
        assert torch.equal(reader.read(name, dim=1, start=start, end=end), reference[:, start:end])
    assert torch.equal(reader.read(name, dim=0, start=2, end=5), reference[2:5])


def test_the_file_reads_as_the_gguf_package_reads_it(qwen3_gguf, llama_gguf, tmp_path):
    """neuron's own walk of the header: every metadata value (the vocabulary, its merges, the chat
    template) and every tensor's type, shape, place and bytes as `gguf.GGUFReader` reads them; the
    tokenizer is the one transformers' AutoTokenizer builds from the same file."""
    from transformers import AutoTokenizer

    from neuron.utils.default_checkpoint import default_model_dir

    with_vocabulary = write_gguf(default_model_dir(), tmp_path / "default.gguf", "Q8_0")
    for path in (qwen3_gguf[1], llama_gguf[1], with_vocabulary):
        ours, theirs = neuron_gguf.GGUFFile(path), gguf.GGUFReader(str(path))
        stored = {k: f for k, f in theirs.fields.items() if not k.startswith("GGUF.")}  # gguf's header items
        assert list(ours.fields) == list(stored)
        for key, field in stored.items():
            expected = field.contents()
            got = ours.array(key) if field.types[0] == gguf.GGUFValueType.ARRAY else ours.field(key)
            assert got == expected and type(got) is type(expected), key
        assert list(ours.tensors) == [t.name for t in theirs.tensors]
        for t in theirs.tensors:
            mine = ours.tensors[t.name]
            assert (mine.tensor_type, mine.shape, mine.n_elements, mine.n_bytes, mine.data_offset) == \
                (t.tensor_type, tuple(int(d) for d in t.shape), t.n_elements, t.n_bytes, t.data_offset), t.name
            assert mine.data.tobytes() == t.data.tobytes(), t.name
            if mine.tensor_type.name != "BF16":  # gguf keeps BF16 as bytes; neuron as 16-bit values
                assert mine.data.shape == t.data.shape and mine.data.dtype == t.data.dtype, t.name
    merges = ours.array("tokenizer.ggml.merges")
    assert len(merges) > 1000 and "{%" in ours.field("tokenizer.chat_template")
    auto = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=with_vocabulary.name)
    tok = Tokenizer.from_gguf(with_vocabulary, "qwen3")
    assert tok._backend.to_str() == auto.backend_tokenizer.to_str()
    assert tok.chat_template == auto.chat_template and tok.eos_token_id == auto.eos_token_id


def test_q4_0_scales_whose_offset_passes_fp16_are_read_in_fp32():
    """Q4_0's offset is 8 d: kept fp16 beside d, unless 8 d passes fp16's largest value (d of 60,000
    is a finite fp16); then both are fp32, and the weight still reads and multiplies as gguf's."""
    from neuron.layers import quantized
    from neuron.layers.kernels import Kernels

    qtype = gguf.GGMLQuantizationType.Q4_0
    data = random_blocks("Q4_0", 6, 512, seed=9)
    blocks = data.reshape(6, -1, gguf.GGML_QUANT_SIZES[qtype][1])
    modest = neuron_gguf._DECODERS["Q4_0"](blocks, 512)
    assert modest.scale.dtype == modest.offset.dtype == torch.float16
    blocks[2, 3, 0:2] = np.array([60000], dtype=np.float16).view(np.uint8)
    w = neuron_gguf._DECODERS["Q4_0"](blocks, 512)
    assert w.scale.dtype == w.offset.dtype == torch.float32
    reference = torch.from_numpy(gguf.dequantize(data, qtype))
    assert torch.equal(w.dequantize(), reference)
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(1))
    assert quantized.cpu_kernel(Kernels(quant_exact=True), w, 2) is not None
    exact = quantized.linear(Kernels(quant_exact=True), x, w)
    assert torch.allclose(exact, x.double().matmul(reference.double().T).float(), rtol=1e-5, atol=1e-2)


def _hf_checkpoint(tmp_path, family: str):
    if family == "qwen3":
        return build_checkpoint(tmp_path / "hf", seed=3, **SHAPE)
    if family == "qwen2":  # biases on q, k and v
        from transformers import Qwen2Config, Qwen2ForCausalLM

        torch.manual_seed(8)
        shape = {k: v for k, v in SHAPE.items() if k != "head_dim"}
        config = Qwen2Config(**shape, max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-6,
                             eos_token_id=None, bos_token_id=None)
        model = Qwen2ForCausalLM(config)
        for layer in model.model.layers:  # non-zero biases, so that reading them is tested
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.05)
        model.save_pretrained(tmp_path / "hf", safe_serialization=True)
        return tmp_path / "hf"
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(4)
    biased = family == "llama-bias"  # q and k biases, which llama.cpp permutes as it permutes their rows
    config = LlamaConfig(**SHAPE, max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-6,
                         eos_token_id=None, bos_token_id=None, attention_bias=biased)
    model = LlamaForCausalLM(config)
    for layer in model.model.layers if biased else []:
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj):
            torch.nn.init.normal_(proj.bias, std=0.3)
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    return tmp_path / "hf"


def _mixed_gguf(tmp, family: str, types: dict = MIXED):
    hf = _hf_checkpoint(tmp, family)
    return hf, write_gguf(hf, tmp / "model.gguf", types)


@pytest.fixture(scope="module")
def qwen3_gguf(tmp_path_factory):
    return _mixed_gguf(tmp_path_factory.mktemp("gguf-qwen3"), "qwen3")


@pytest.fixture(scope="module")
def qwen3_newer_gguf(tmp_path_factory):
    return _mixed_gguf(tmp_path_factory.mktemp("gguf-newer"), "qwen3", NEWER)


@pytest.fixture(scope="module")
def llama_gguf(tmp_path_factory):
    return _mixed_gguf(tmp_path_factory.mktemp("gguf-llama"), "llama")


def _transformers_reference(hf, path):
    """transformers' own reading of the GGUF file (its dequantization, its undoing of llama.cpp's
    q/k permutation), under the original checkpoint's config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                config=AutoConfig.from_pretrained(hf)).eval()


def _check_against_transformers(hf, path, tp: int, down: str = "Q6_K") -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5, ignore_eos=True)
    with LLM(str(path), tensor_parallel_size=tp, device="cpu", dtype="float32") as llm:
        model = llm.engine.executor.rank0.models["model"].model
        layer = model.layers[0]
        assert isinstance(layer.mlp.down.weight, QuantizedWeight) and layer.mlp.down.weight.format == down
        assert isinstance(layer.attn.o_proj.weight, QuantizedWeight)
        assert isinstance(model.lm_head.weight, QuantizedWeight)  # kept as the file stores it
        assert llm.engine.model.quantization.startswith("gguf: ")
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    reference = _transformers_reference(hf, path)
    for prompt, out in zip(PROMPTS, outs):
        assert_matches_reference(out.outputs[0], *greedy_with_logprobs(reference, prompt, 8))


@pytest.mark.parametrize("tp", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
def test_qwen3_gguf_matches_transformers_reading_the_same_file(qwen3_gguf, tp):
    _check_against_transformers(*qwen3_gguf, tp)


@pytest.mark.parametrize("tp", [1, 2])
def test_the_newer_types_match_transformers_reading_the_same_file(qwen3_newer_gguf, tp):
    """Q2_K, Q3_K, Q4_1, Q5_0, Q5_1, IQ4_NL and IQ4_XS in one model, the embedding and LM head too."""
    _check_against_transformers(*qwen3_newer_gguf, tp, down="IQ4_XS")


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_qwen2_gguf_matches_transformers_reading_the_same_file(tmp_path, tp):
    """Qwen2 / Qwen2.5 files: biases on q, k and v read from the file too."""
    _check_against_transformers(*_mixed_gguf(tmp_path, "qwen2"), tp)


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)])
def test_llama_gguf_matches_transformers_reading_the_same_file(llama_gguf, tp):
    """llama.cpp stores Llama's q and k rows permuted; neuron undoes it as transformers does."""
    _check_against_transformers(*llama_gguf, tp)


def test_a_llama_file_with_attention_biases_reads_them_in_transformers_order(tmp_path):
    """llama.cpp permutes Llama's q and k biases as it permutes those rows; an F32 file generates
    what transformers generates from the checkpoint itself."""
    from transformers import AutoModelForCausalLM

    hf = _hf_checkpoint(tmp_path, "llama-bias")
    path = write_gguf(hf, tmp_path / "biased.gguf", "F32")
    with LLM(str(path), device="cpu", dtype="float32") as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0.0, max_tokens=8, logprobs=5, ignore_eos=True))
    reference = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    for prompt, out in zip(PROMPTS, outs):
        assert_matches_reference(out.outputs[0], *greedy_with_logprobs(reference, prompt, 8))


def test_a_split_off_the_block_boundaries_is_refused_with_the_sizes(tmp_path):
    hf = _hf_checkpoint(tmp_path, "qwen3")
    path = write_gguf(hf, tmp_path / "k.gguf", {"attn_output.weight": "Q4_K", "default": "Q8_0"})
    with pytest.raises(Exception, match=r"blk\.0\.attn_output\.weight \(Q4_K, 256 x 256\).*\[0, 128\).*blocks of 256"):
        LLM(str(path), tensor_parallel_size=2, device="cpu", dtype="float32")


def test_an_unsupported_type_is_refused_on_the_leader_naming_it_and_its_tensors(tmp_path, monkeypatch):
    """The file's tensor types are checked from its header before any worker starts."""
    hf = _hf_checkpoint(tmp_path, "qwen3")
    path = write_gguf(hf, tmp_path / "iq2.gguf", {"ffn_up.weight": "IQ2_XXS", "output.weight": "TQ2_0",
                                                  "default": "Q8_0"})
    monkeypatch.setattr(Executor, "__init__", lambda *a, **k: pytest.fail("a worker pool was started"))
    with pytest.raises(ConfigError) as refused:
        LLM(str(path), tensor_parallel_size=2, device="cpu", dtype="float32")
    supported = ", ".join(TYPES)
    assert str(refused.value) == (
        "iq2.gguf: GGUF tensor types TQ2_0 (1 tensor: output.weight), IQ2_XXS (2 tensors: blk.0.ffn_up.weight, "
        f"blk.1.ffn_up.weight) are not supported; neuron reads {supported}")


def test_the_tokenizer_and_chat_template_come_from_the_file(tmp_path):
    from neuron.utils.default_checkpoint import default_model_dir

    src = default_model_dir()
    path = write_gguf(src, tmp_path / "default.gguf", "Q8_0")
    with LLM(str(path), device="cpu", dtype="float32") as llm:
        tok = llm.get_tokenizer()
        ref = Tokenizer.from_dir(src)
        for text in ("Hello world, it's 2026!", "<|im_start|>user\nhi<|im_end|>"):
            assert tok.encode(text) == ref.encode(text)
        assert tok.chat_template == ref.chat_template
        eos = json.loads((src / "config.json").read_text())["eos_token_id"]
        assert eos in llm.engine.model.eos_token_ids
        out = llm.chat([[{"role": "user", "content": "hi"}]], SamplingParams(max_tokens=4, ignore_eos=True))
        assert out[0].outputs[0].token_ids and isinstance(out[0].outputs[0].text, str)

    (tmp_path / "bare").mkdir()
    bare = write_gguf(src, tmp_path / "bare" / "model.gguf", "Q8_0", tokenizer=False)
    assert neuron_gguf.open_file(bare).field("tokenizer.ggml.model") == "none"  # llama.cpp's converter's mark
    with LLM(str(bare), device="cpu", dtype="float32") as llm:
        assert llm.get_tokenizer() is None
    with LLM(str(bare.parent), device="cpu", dtype="float32", tokenizer=str(src)) as llm:  # a folder holding one
        assert llm.get_tokenizer().encode("Hello") == ref.encode("Hello")


def test_a_gguf_file_in_a_cached_repo_is_found_by_name(tmp_path, monkeypatch):
    snap = tmp_path / "hub" / "models--org--tiny-GGUF" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text("abc123")
    (snap / "tiny-Q8_0.gguf").write_bytes(b"")
    (snap / "tiny-Q4_K_M.gguf").write_bytes(b"")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert resolve_model_path("org/tiny-GGUF/tiny-Q4_K_M.gguf") == snap / "tiny-Q4_K_M.gguf"
    with pytest.raises(ModelNotFound, match="tiny-Q4_K_M.gguf, tiny-Q8_0.gguf"):
        resolve_model_path("org/tiny-GGUF/tiny-Q2_K.gguf")
    with pytest.raises(ConfigError, match="several GGUF models"):
        neuron_gguf.find_gguf(snap)


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_qwen3_moe_gguf_keeps_its_experts_quantized(tmp_path, tp):
    """qwen3moe: experts stacked per projection in the file, each rank reading its slice of each
    expert, run through the quantized kernel."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(6)
    config = Qwen3MoeConfig(vocab_size=301, hidden_size=256, intermediate_size=512, moe_intermediate_size=512,
                            num_experts=4, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                            tie_word_embeddings=False, initializer_range=0.05, eos_token_id=None, bos_token_id=None,
                            norm_topk_prob=True)  # what every Qwen3-MoE uses, and llama.cpp assumes
    Qwen3MoeForCausalLM(config).save_pretrained(tmp_path / "hf", safe_serialization=True)
    path = write_gguf(tmp_path / "hf", tmp_path / "moe.gguf",
                      {"ffn_gate_exps.weight": "Q4_K", "ffn_up_exps.weight": "Q8_0", "ffn_down_exps.weight": "Q6_K",
                       "ffn_gate_inp.weight": "F32", "default": "Q8_0"})
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5, ignore_eos=True)
    with LLM(str(path), tensor_parallel_size=tp, device="cpu", dtype="float32") as llm:
        moe = llm.engine.executor.rank0.models["model"].model.layers[0].mlp
        assert moe.quantized and moe.path_for(1) == "loop"
        assert isinstance(moe.w_down[0], QuantizedWeight) and moe.w_down[0].format == "Q6_K"
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    reference = _transformers_reference(tmp_path / "hf", path)
    for prompt, out in zip(PROMPTS, outs):
        assert_matches_reference(out.outputs[0], *greedy_with_logprobs(reference, prompt, 8))


def test_every_end_of_generation_token_of_the_file_stops(tmp_path):
    """llama.cpp ends a generation at the file's EOS, EOT and EOM tokens (Llama 3's <|end_of_text|>,
    <|eot_id|>, <|eom_id|>): each is a stop id, and one outside the vocabulary is refused."""
    from neuron.utils.default_checkpoint import default_model_dir

    src = default_model_dir()
    eos = json.loads((src / "config.json").read_text())["eos_token_id"]
    path = write_gguf(src, tmp_path / "ends.gguf", "Q8_0", ids={"eot": 7, "eom": 11})
    assert {eos, 7, 11} <= set(model_config(path).eos_token_ids)
    (tmp_path / "far").mkdir()
    far = write_gguf(src, tmp_path / "far" / "far.gguf", "Q8_0", ids={"eot": 10**7})
    with pytest.raises(ConfigError, match="eos_token_id must be a token id"):
        model_config(far)


def test_a_split_file_loads_from_its_first_shard_as_the_whole_file_does(llama_gguf, tmp_path):
    """A file split by llama.cpp's converter (PREFIX-00001-of-00003.gguf: the metadata in the first
    shard, the tensors spread over all three) generates at tp 2 exactly what the whole file does,
    named by its folder, its first shard or any other shard; a missing or mislabelled shard is
    refused by name."""
    hf, whole = llama_gguf
    (tmp_path / "split").mkdir()
    first = write_gguf(hf, tmp_path / "split" / "model.gguf", MIXED, split_max_tensors=8)
    shards = sorted(first.parent.glob("*.gguf"))
    assert [s.name for s in shards] == [f"model-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert neuron_gguf.open_file(first).tensors.keys() == neuron_gguf.open_file(whole).tensors.keys()
    assert neuron_gguf.find_gguf(first.parent) == first and neuron_gguf.find_gguf(shards[2]) == first
    (tmp_path / "blobs").mkdir()  # a Hugging Face cache: each shard a link to a blob named by its hash
    (tmp_path / "snapshot").mkdir()
    for i, shard in enumerate(shards):
        blob = tmp_path / "blobs" / f"{i}abc"
        blob.write_bytes(shard.read_bytes())
        (tmp_path / "snapshot" / shard.name).symlink_to(blob)
    assert neuron_gguf.open_file(tmp_path / "snapshot" / first.name).tensors.keys() == \
        neuron_gguf.open_file(whole).tensors.keys()
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    outs = {}
    for path in (whole, first.parent):
        with LLM(str(path), tensor_parallel_size=2, device="cpu", dtype="float32") as llm:
            outs[path] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]
    assert outs[whole] == outs[first.parent]

    shards[1].rename(shards[1].with_suffix(".part"))
    with pytest.raises(ConfigError, match=r"model-00001-of-00003\.gguf: shard 2 of 3, model-00002-of-00003\.gguf, "
                                          r"is missing"):
        neuron_gguf.GGUFFile(first)
    shards[1].with_suffix(".part").rename(shards[2].with_name("model-00002-of-00003.gguf"))
    shards[2].rename(tmp_path / "third.gguf")
    shards[0].rename(shards[2])  # the first shard's bytes where the third belongs
    (tmp_path / "third.gguf").rename(shards[0])
    with pytest.raises(ConfigError, match="one shard of a GGUF file split in 3; name its first shard"):
        neuron_gguf.GGUFFile(first)
    shards[0].unlink()
    with pytest.raises(ConfigError, match=r"the first shard of its split GGUF file, model-00001-of-00003\.gguf, "
                                          r"is missing"):
        neuron_gguf.find_gguf(first.parent)


QWEN35 = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-6,
              linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
              initializer_range=0.25, tie_word_embeddings=False, eos_token_id=None, bos_token_id=None,
              rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25,
                               "mrope_section": [2, 1, 1], "mrope_interleaved": True})


def _qwen35(tmp_path, value_dim: int, moe: bool = False):
    """A tiny Qwen3.5 text model (`moe`: Qwen3.5-MoE's, 6 experts, top 3, beside a shared one) with
    the default checkpoint's tokenizer (transformers' GGUF reader sizes the vocabulary by the file's
    tokens)."""
    import transformers

    from neuron.utils.default_checkpoint import default_model_dir

    shape = {**QWEN35, "vocab_size": Tokenizer.from_dir(default_model_dir()).vocab_size,
             "linear_value_head_dim": value_dim}
    if moe:
        shape.update(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=64, shared_expert_intermediate_size=64)
        shape.pop("intermediate_size")
    name = "Qwen3_5Moe" if moe else "Qwen3_5"
    torch.manual_seed(value_dim)
    model = getattr(transformers, f"{name}ForCausalLM")(getattr(transformers, f"{name}TextConfig")(**shape)).eval()
    with torch.no_grad():  # norms, decays, steps and the shared expert's gate away from their initial values
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "A_log", "dt_bias", "shared_expert_gate.weight")):
                p.normal_(0, 0.3)
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "hf" / name).write_bytes((default_model_dir() / name).read_bytes())
    return tmp_path / "hf"


@pytest.mark.parametrize("value_dim, types, tp, moe, quantized", [
    (16, "F32", 1, False, False),  # the file's weights are the checkpoint's: transformers on the checkpoint itself
    # out_proj's share of value heads in whole blocks at tp 2 (heads of 32, Q8_0's blocks of 32)
    (32, {"ssm_out.weight": "Q8_0", "attn_qkv.weight": "Q4_0", "default": "Q8_0"}, 2, False, True),
    (128, {"ssm_out.weight": "Q4_K", "default": "Q8_0"}, 1, False, True),  # two heads of 128 a K-quant block
    (64, {"ssm_out.weight": "Q4_K", "default": "F16"}, 2, False, False),  # a rank's heads part blocks: dequantized
    (16, "F32", 2, True, False),  # Qwen3.5-MoE (`qwen35moe`): experts stacked, a shared expert and its gate
    (32, {"ffn_gate_exps.weight": "Q4_1", "ffn_up_exps.weight": "Q4_1", "ffn_down_exps.weight": "Q4_0",
          "default": "Q8_0"}, 1, True, True),
])
def test_a_qwen3_5_gguf_file_matches_transformers(tmp_path, value_dim, types, tp, moe, quantized):
    """Qwen3.5 as llama.cpp's converter writes it (`qwen35`: norms stored plus one, A as -exp(A_log),
    the depthwise kernel squeezed, the linear attention's value heads tiled rather than grouped by
    key head; the tests' writer makes the converter's tensors byte for byte): the same tokens and
    logprobs as transformers, split across ranks by value heads."""
    from transformers import AutoModelForCausalLM

    hf = _qwen35(tmp_path, value_dim, moe)
    (tmp_path / "gguf").mkdir()
    path = write_gguf(hf, tmp_path / "gguf" / "qwen35.gguf", types)
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5, ignore_eos=True)
    with LLM(str(path), tensor_parallel_size=tp, device="cpu", dtype="float32") as llm:
        assert llm.engine.model.hf_config["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
        out_proj = llm.engine.executor.rank0.models["model"].model.layers[0].mixer.out_proj.weight
        assert isinstance(out_proj, QuantizedWeight) == quantized  # its value heads reordered as whole blocks
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    if types == "F32":
        reference = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    else:
        reference = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                         dtype=torch.float32).eval()
    for prompt, out in zip(PROMPTS, outs):
        assert_matches_reference(out.outputs[0], *greedy_with_logprobs(reference, prompt, 8))
