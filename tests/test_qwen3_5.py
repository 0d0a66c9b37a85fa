"""Qwen3.5 hybrid text model: parity with transformers through the offline API at tp 1 and 2, in
both checkpoint layouts, plus the pieces a parity run cannot isolate (the chunked delta rule, the
multimodal rotary tables, the recurrent state's refusal to rewind)."""

from __future__ import annotations

import json

import pytest
import torch
from checkpoints import assert_chunking_changes_nothing, assert_matches_reference, cached_model, greedy_with_logprobs

from neuron import LLM, SamplingParams
from neuron.distributed.comm import SingleRank
from neuron.errors import ConfigError
from neuron.layers.kernels import Kernels
from neuron.layers.tensor_parallel import Shard
from neuron.models import build_model
from neuron.models.gated_deltanet import DeltaNetHeads, delta_chunked, delta_step
from neuron.models.inputs import StepRejected
from neuron.models.loader import CheckpointReader, safetensors_files
from neuron.models.qwen3_5 import MRotary, Qwen35Config
from neuron.step import SeqStep
from neuron.worker.step_input import BlockTables

NEW_TOKENS = 8
LONG = [(i * 37 + 11) % 301 for i in range(150)]  # many 16-token prefill chunks; 3 delta-rule chunks in one shot
PROMPTS = [[5, 17, 200, 3], LONG, [7], [250, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]

pytestmark = pytest.mark.usefixtures("small_prefill_chunks")

TEXT = dict(
    vocab_size=301,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    head_dim=32,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    # Wide enough that random logits are well separated (no greedy ties), as in checkpoints.py.
    initializer_range=0.25,
    eos_token_id=None,
    bos_token_id=None,
)
# Multimodal layout: key heads split across 2 ranks, one KV head replicated, untied head,
# interleaved M-RoPE sections over a quarter of the head.
MULTIMODAL_TEXT = dict(
    TEXT,
    num_key_value_heads=1,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25,
                     "mrope_section": [2, 1, 1], "mrope_interleaved": True},
    tie_word_embeddings=False,
)
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, temporal_patch_size=2,
              spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=16)
# Text-only layout: one key head shared by the value heads of both ranks, default layer pattern, tied.
TEXT_ONLY = dict(TEXT, num_key_value_heads=2, linear_num_key_heads=1, linear_num_value_heads=2,
                 tie_word_embeddings=True)


@pytest.fixture(scope="module")
def multimodal_checkpoint(tmp_path_factory):
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    torch.manual_seed(3)
    config = Qwen3_5Config(text_config=MULTIMODAL_TEXT, vision_config=VISION, tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("qwen3_5")
    Qwen3_5ForConditionalGeneration(config).eval().save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def text_checkpoint(tmp_path_factory):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(4)
    path = tmp_path_factory.mktemp("qwen3_5_text")
    Qwen3_5ForCausalLM(Qwen3_5TextConfig(**TEXT_ONLY)).eval().save_pretrained(path, safe_serialization=True)
    return path


def _reference(path) -> torch.nn.Module:
    from transformers import Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration

    model_type = json.loads((path / "config.json").read_text())["model_type"]
    return cached_model(Qwen3_5ForConditionalGeneration if model_type == "qwen3_5" else Qwen3_5ForCausalLM, path)


def reference_greedy(path, prompt: list[int]) -> tuple[list[int], list[torch.Tensor]]:
    return greedy_with_logprobs(_reference(path), prompt, NEW_TOKENS)


def _params(max_tokens=NEW_TOKENS, logprobs=5) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=logprobs, ignore_eos=True)


def _check_against_reference(path, prompts, outs) -> None:
    for prompt, got in zip(prompts, outs):
        assert_matches_reference(got, *reference_greedy(path, prompt), f"prompt {prompt[:5]}...")


def _check_parity(path, tp: int) -> None:
    """All prompts in one batch of unequal lengths (decodes and prefill chunks share steps), then
    the long one again: its blocks are still cached, but a prefix cannot restore recurrent state."""
    with LLM(str(path), tensor_parallel_size=tp, device="cpu", dtype="float32") as llm:
        outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _params())]
        again = llm.generate({"prompt_token_ids": LONG}, _params())[0].outputs[0]
    _check_against_reference(path, PROMPTS, outs)
    assert again.token_ids == outs[1].token_ids


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_multimodal_layout_parity(multimodal_checkpoint, tp):
    _check_parity(multimodal_checkpoint, tp)


def test_parity_with_gather_attention(multimodal_checkpoint, monkeypatch):
    """The gated full-attention layers over the gather reference path (NEURON_ATTENTION=gather);
    the other parity tests run the default, which reads KV blocks in place."""
    monkeypatch.setenv("NEURON_ATTENTION", "gather")
    _check_parity(multimodal_checkpoint, 1)


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_text_only_layout_parity(text_checkpoint, tp):
    _check_parity(text_checkpoint, tp)


def test_chunked_prefill_equals_single_shot(multimodal_checkpoint, monkeypatch):
    """The long prompt in 16-token steps and in one 150-token step give the same logprobs."""
    assert_chunking_changes_nothing(multimodal_checkpoint, LONG, 16, monkeypatch)


def test_preempted_sequences_start_over(multimodal_checkpoint):
    """A KV pool too small for the batch preempts sequences; their recurrent state is rebuilt."""
    block_bytes = 2 * 2 * 32 * 16 * 4  # K and V, 2 full-attention layers, one KV head of 32, 16 tokens
    with LLM(str(multimodal_checkpoint), device="cpu", dtype="float32", max_model_len=192,
             kv_cache_memory=12 * block_bytes) as llm:
        outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _params())]
        assert llm.engine.scheduler.num_preemptions > 0
    _check_against_reference(multimodal_checkpoint, PROMPTS, outs)


def _recurrent(s, q, k, v, g, beta):
    outs = []
    for i in range(q.shape[0]):
        s, o = delta_step(s[None], q[i : i + 1], k[i : i + 1], v[i : i + 1], g[i : i + 1], beta[i : i + 1])
        s = s[0]
        outs.append(o)
    return s, torch.cat(outs)


def test_delta_rule_chunks_equal_token_by_token():
    torch.manual_seed(0)
    t, h, dk, dv = 150, 3, 8, 5
    q = torch.nn.functional.normalize(torch.randn(t, h, dk), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(t, h, dk), dim=-1)
    v, beta = torch.randn(t, h, dv), torch.rand(t, h)
    g = -torch.rand(t, h) * 3  # strong decay too: exp(-3) per token
    s0 = torch.randn(h, dk, dv)
    s_ref, o_ref = _recurrent(s0, q, k, v, g, beta)
    for chunk in (64, 16, 7):
        s, o = delta_chunked(s0, q, k, v, g, beta, chunk=chunk)
        assert torch.allclose(o, o_ref, atol=1e-4) and torch.allclose(s, s_ref, atol=1e-4)
    s_mid, o_head = delta_chunked(s0, q[:70], k[:70], v[:70], g[:70], beta[:70])
    s, o_tail = delta_chunked(s_mid, q[70:], k[70:], v[70:], g[70:], beta[70:])
    assert torch.allclose(torch.cat([o_head, o_tail]), o_ref, atol=1e-4) and torch.allclose(s, s_ref, atol=1e-4)


def test_the_fused_decode_update_is_the_delta_rules_step():
    """The kernel library's one-token update (csrc/delta_step.h): in place on the slots' rows of the
    state, a fresh sequence's row zeroed first, the other rows untouched; state and output as
    delta_step computes them. Value heads wider than its buffer are left to PyTorch."""
    from neuron.layers import cpu_ops

    if cpu_ops.library() is None:
        pytest.skip("the kernel library cannot be built here (no C++ compiler): decode runs PyTorch's step")
    torch.manual_seed(1)
    slots, b, h, dk, dv = 6, 3, 4, 16, 40
    state = torch.randn(slots, h, dk, dv)
    rows, fresh = torch.tensor([4, 0, 2]), torch.tensor([0, 1, 0], dtype=torch.uint8)
    q = torch.nn.functional.normalize(torch.randn(b, h, dk), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(b, h, dk), dim=-1)
    v, g, beta = torch.randn(b, h, dv), -torch.rand(b, h) * 3, torch.rand(b, h)
    before = state[rows].clone()
    before[1] = 0
    s_ref, o_ref = delta_step(before, q, k, v, g, beta)
    updated = state.clone()
    o = cpu_ops.delta_step(updated, rows, fresh, q, k, v, g, beta)
    assert torch.allclose(o, o_ref, atol=1e-5) and torch.allclose(updated[rows], s_ref, atol=1e-5)
    assert torch.equal(updated[[1, 3, 5]], state[[1, 3, 5]])
    wide = torch.randn(1, 1, 2, 1025)
    assert cpu_ops.delta_step(wide, torch.tensor([0]), torch.tensor([0], dtype=torch.uint8), q[:1, :1, :2],
                              k[:1, :1, :2], torch.randn(1, 1, 1025), g[:1, :1], beta[:1, :1]) is None


def test_mrope_tables_follow_the_reference_sections():
    """Image positions differ per axis; the tables interleave them as transformers does."""
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    config = Qwen3_5TextConfig(head_dim=64, rope_parameters={
        "rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5, "mrope_section": [6, 5, 5]})
    ref = Qwen3_5TextRotaryEmbedding(config)
    pos = torch.stack([torch.arange(20), torch.arange(20) // 4 + 3, torch.arange(20) % 4 + 3])
    ref_cos, ref_sin = ref(torch.zeros(1, dtype=torch.float32), pos[:, None, :])
    rot = MRotary(32, 1e4, [6, 5, 5], 64, torch.float32, torch.device("cpu"))
    cos, sin = rot.tables(pos)
    assert torch.allclose(cos[:, 0], ref_cos[0]) and torch.allclose(sin[:, 0], ref_sin[0])
    text_cos, _ = rot.tables(pos[0])
    assert torch.equal(text_cos, rot.tables(pos[0].expand(3, -1))[0])


def test_recurrent_state_cannot_rewind(multimodal_checkpoint):
    config = json.loads((multimodal_checkpoint / "config.json").read_text())
    model = build_model(config, SingleRank(), torch.float32, torch.device("cpu"), Kernels())
    with CheckpointReader(safetensors_files(multimodal_checkpoint)) as r:
        model.load(r)
    model.allocate(8, 4, 2, 64)
    cache, tables = model.cache, BlockTables(2, 8, 4, 64, torch.device("cpu"))

    def check(step):
        tables.check(step, 301)
        cache.check(step, 301)

    def start(step):
        batch = tables.prepare(step)
        cache.begin(step)
        return batch

    first = [SeqStep(0, [1, 2, 3], 0, [0], True)]
    check(first)
    batch = start(first)
    model.forward(batch)
    tables.commit(batch)
    cache.commit(batch)
    check([SeqStep(0, [4], 3)])
    with pytest.raises(StepRejected, match="recurrent state"):
        check([SeqStep(0, [3], 2)])
    with pytest.raises(StepRejected, match="cached prefix"):
        check([SeqStep(1, [5], 4, [1, 2], True)])
    check([SeqStep(0, [9, 9], 0, [3], True)])  # a new sequence in a reused slot starts afresh
    start([SeqStep(0, [4], 3)])  # a step that never commits
    with pytest.raises(StepRejected, match="failed step"):
        cache.check([SeqStep(0, [4], 3)], 301)


def test_head_sharding_layouts():
    """Value heads split evenly; key heads either split with them or repeat within their group."""
    split = [DeltaNetHeads(4, 8, 16, 16, Shard(r, 2)) for r in range(2)]
    assert [(h.k_range(), h.v_range()) for h in split] == [((0, 2), (0, 4)), ((2, 4), (4, 8))]
    shared = [DeltaNetHeads(1, 4, 16, 16, Shard(r, 4)) for r in range(4)]
    assert {h.k_range() for h in shared} == {(0, 1)}
    with pytest.raises(ConfigError):
        DeltaNetHeads(2, 6, 16, 16, Shard(0, 4)).validate()
    with pytest.raises(ConfigError):
        DeltaNetHeads(3, 6, 16, 16, Shard(0, 2)).validate()  # 3 value heads per rank straddle groups of 2


def test_rope_scaling_laid_over_the_rope_parameters_is_refused():
    """An override given as rope_scaling (--hf-overrides) wins over the config's rope_parameters,
    as it does for the dense decoder: Qwen3.5 refuses it rather than run at the stretched length
    with its plain rope."""
    text = dict(MULTIMODAL_TEXT, model_type="qwen3_5_text")
    assert Qwen35Config.from_dict(text).mrope_section == [2, 1, 1]
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    with pytest.raises(ConfigError, match="rope type 'yarn'"):
        Qwen35Config.from_dict(dict(text, rope_scaling=yarn))
