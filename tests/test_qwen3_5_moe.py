"""Qwen3.5 MoE: parity with transformers through the offline API at tp 1, 2 and 4 in both checkpoint
layouts (multimodal `qwen3_5_moe`, text-only `qwen3_5_moe_text`) and both expert layouts (per-expert
tensors, as transformers writes them, and fused [E, ...] tensors), image prefill, and the MoE block
itself: its split across ranks against transformers' block, and the refusals a parity run cannot reach."""

from __future__ import annotations

import json
import re

import pytest
import torch
from checkpoints import (
    assert_chunking_changes_nothing,
    assert_matches_reference,
    cached_model,
    generate_greedy,
    greedy_with_logprobs,
)
from safetensors.torch import load_file, save_file
from server_harness import wait_until
from test_qwen3_5 import LONG, MULTIMODAL_TEXT, PROMPTS
from vision_checkpoint import (
    assert_image_parity,
    build_vision_checkpoint,
    image_data_uri,
    image_prompt,
    image_reference,
)

from neuron import LLM, SamplingParams
from neuron.distributed.comm import Communicator, SingleRank
from neuron.errors import ConfigError
from neuron.layers.kernels import Kernels
from neuron.models import build_model, supports_prefix_caching
from neuron.models.loader import CheckpointReader, safetensors_files
from neuron.models.qwen3_5_moe import Qwen35MoeConfig, SharedExpertMoE

NEW_TOKENS = 8

pytestmark = pytest.mark.usefixtures("small_prefill_chunks")

# Qwen3.5's multimodal test shapes (one KV head, 2 linear key heads over 4 value heads, M-RoPE,
# untied head: tp 4 divides every split) with a dense MLP replaced by 8 experts, top 2, beside a
# shared expert.
MOE = dict(
    {k: v for k, v in MULTIMODAL_TEXT.items() if k != "intermediate_size"},
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
)
# Text-only layout: two KV heads, one linear key head shared by two value heads, the default
# layer pattern (three linear layers, then full attention), tied embeddings, wider experts.
MOE_TEXT_ONLY = dict(
    {k: v for k, v in MOE.items() if k != "layer_types"},
    num_key_value_heads=2, linear_num_key_heads=1, linear_num_value_heads=2, tie_word_embeddings=True,
    moe_intermediate_size=48, shared_expert_intermediate_size=64, num_experts=6, num_experts_per_tok=3,
)
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, temporal_patch_size=2,
              spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=16)
EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def _perturb(model) -> None:
    """Random norms (transformers starts them at zero offsets or ones) and a wider shared-expert
    gate, so that every path, the gate's sigmoid included, moves the outputs."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "shared_expert_gate" in name:
                p.add_(torch.randn_like(p) * 0.5)


@pytest.fixture(scope="module")
def multimodal_checkpoint(tmp_path_factory):
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    torch.manual_seed(5)
    model = Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(text_config=MOE, vision_config=VISION,
                                                                tie_word_embeddings=False))
    _perturb(model.model.language_model)
    path = tmp_path_factory.mktemp("qwen3_5_moe")
    model.eval().save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def text_checkpoint(tmp_path_factory):
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    torch.manual_seed(6)
    model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**MOE_TEXT_ONLY))
    _perturb(model)
    path = tmp_path_factory.mktemp("qwen3_5_moe_text")
    model.eval().save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def fused_checkpoint(multimodal_checkpoint, tmp_path_factory):
    """The multimodal checkpoint with its experts stacked into transformers' in-memory layout:
    gate_up_proj [E, 2 * inter, hidden] (gate rows first) and down_proj [E, hidden, inter]."""
    tensors = load_file(multimodal_checkpoint / "model.safetensors")
    experts: dict[str, dict] = {}
    for name in [n for n in tensors if EXPERT.match(n)]:
        prefix, e, proj = EXPERT.match(name).groups()
        experts.setdefault(prefix, {}).setdefault(int(e), {})[proj] = tensors.pop(name)
    assert len(experts) == MOE["num_hidden_layers"]
    for prefix, per in experts.items():
        rows = [per[e] for e in sorted(per)]
        tensors[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([x["gate_proj"], x["up_proj"]]) for x in rows])
        tensors[f"{prefix}.down_proj"] = torch.stack([x["down_proj"] for x in rows])
    dst = tmp_path_factory.mktemp("qwen3_5_moe_fused")
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    (dst / "config.json").write_text((multimodal_checkpoint / "config.json").read_text())
    return dst


def _hf_model(path):
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeForConditionalGeneration

    multimodal = json.loads((path / "config.json").read_text())["model_type"] == "qwen3_5_moe"
    return cached_model(Qwen3_5MoeForConditionalGeneration if multimodal else Qwen3_5MoeForCausalLM, path)


def _params(max_tokens=NEW_TOKENS, logprobs=5) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=logprobs, ignore_eos=True)


def _check_parity(path, tp: int, reference_path=None) -> None:
    """All prompts in one batch of unequal lengths (the long one over several prefill chunks,
    beside decodes), each against transformers' greedy decode of it alone."""
    model = _hf_model(reference_path or path)
    for prompt, got in zip(PROMPTS, generate_greedy(path, tp, PROMPTS, NEW_TOKENS)):
        assert_matches_reference(got, *greedy_with_logprobs(model, prompt, NEW_TOKENS), f"prompt {prompt[:5]}...")
        assert len(got.logprobs) == NEW_TOKENS


@pytest.mark.slow
def test_preemption_and_recovery_at_tp2(multimodal_checkpoint):
    """A KV pool too small for the batch preempts sequences, whose recurrent state starts over; a
    worker killed afterwards is rebuilt and the same prompts give the same tokens."""
    import os
    import signal

    block_bytes = 2 * 2 * 32 * 16 * 4  # K and V, 2 full-attention layers, one KV head of 32, 16 tokens
    with LLM(str(multimodal_checkpoint), tensor_parallel_size=2, device="cpu", dtype="float32",
             max_model_len=192, kv_cache_memory=12 * block_bytes) as llm:
        first = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _params())]
        assert llm.engine.scheduler.num_preemptions > 0
        victim = llm.engine.executor.pool.workers[0].proc
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(timeout=30)
        # the liveness monitor notices (within seconds); generate() then rebuilds the ranks first
        wait_until(lambda: llm.engine.failure is not None, 10, "the dead rank was not noticed")
        again = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _params())]
    model = _hf_model(multimodal_checkpoint)
    for prompt, got, rerun in zip(PROMPTS, first, again):
        assert_matches_reference(got, *greedy_with_logprobs(model, prompt, NEW_TOKENS), f"prompt {prompt[:5]}...")
        assert rerun.token_ids == got.token_ids


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)])
def test_multimodal_layout_parity(multimodal_checkpoint, tp):
    _check_parity(multimodal_checkpoint, tp)


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_text_only_layout_parity(text_checkpoint, tp):
    _check_parity(text_checkpoint, tp)


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_fused_expert_layout_parity(fused_checkpoint, multimodal_checkpoint, tp):
    """Fused experts load to the same model as per-expert ones: transformers' outputs on the latter."""
    _check_parity(fused_checkpoint, tp, reference_path=multimodal_checkpoint)


def test_chunked_prefill_equals_single_shot(multimodal_checkpoint, monkeypatch):
    """The 150-token prompt in 16-token steps and in one step give the same logprobs."""
    assert_chunking_changes_nothing(multimodal_checkpoint, LONG, 16, monkeypatch)


class _Recording(Communicator):
    """One rank of `world` whose all-reduce only counts: each rank's block output stays its partial."""

    def __init__(self, rank: int, world: int):
        super().__init__(rank, world)
        self.reduces = 0

    def all_reduce(self, tensor: torch.Tensor) -> None:
        self.reduces += 1


def _block(path, comm: Communicator, layer: int) -> SharedExpertMoE:
    config = json.loads((path / "config.json").read_text())
    model = build_model(config, comm, torch.float32, torch.device("cpu"), Kernels())
    with CheckpointReader(safetensors_files(path)) as r:
        return model.load_mlp(r, f"model.language_model.layers.{layer}.mlp")


@pytest.mark.parametrize("world", [1, 2, 4])
def test_block_partials_sum_to_transformers_block(multimodal_checkpoint, world):
    """Each rank's routed and gated shared-expert partials, reduced once, equal transformers'
    Qwen3_5MoeSparseMoeBlock on the same inputs."""
    torch.manual_seed(0)
    x = torch.randn(1, 9, MOE["hidden_size"])
    for layer in (0, 3):
        expected = _hf_model(multimodal_checkpoint).model.language_model.layers[layer].mlp(x)[0]
        comms = [_Recording(rank, world) for rank in range(world)]
        total = sum(_block(multimodal_checkpoint, comm, layer)(x[0]) for comm in comms)
        torch.testing.assert_close(total, expected, atol=1e-5, rtol=1e-5)
        assert [c.reduces for c in comms] == [1] * world  # one all-reduce per block on every rank


def _config(**text) -> dict:
    return {"model_type": "qwen3_5_moe_text", **MOE, **text}


@pytest.mark.parametrize("field,size", [("moe_intermediate_size", 33), ("shared_expert_intermediate_size", 33)])
def test_indivisible_expert_widths_are_refused(field, size):
    """Refused when the model is built, before any weight is read, under config.json's own name."""
    config = _config(**{field: size})
    with pytest.raises(ConfigError, match=rf"{field} \({size}\) is not divisible by the tensor-parallel size 2"):
        build_model(config, Communicator(1, 2), torch.float32, torch.device("cpu"), Kernels())
    build_model(config, SingleRank(), torch.float32, torch.device("cpu"), Kernels())  # tp 1 divides everything


def test_bad_expert_fields_are_refused():
    with pytest.raises(ConfigError, match="'num_experts'"):
        Qwen35MoeConfig.from_dict({k: v for k, v in _config().items() if k != "num_experts"})
    with pytest.raises(ConfigError, match="'shared_expert_intermediate_size'"):
        Qwen35MoeConfig.from_dict({k: v for k, v in _config().items() if k != "shared_expert_intermediate_size"})
    with pytest.raises(ConfigError, match=r"num_experts_per_tok \(9\) must be in 1..num_experts \(8\)"):
        Qwen35MoeConfig.from_dict(_config(num_experts_per_tok=9))
    with pytest.raises(ConfigError, match="a qwen3_5_moe config.json needs its text_config"):
        Qwen35MoeConfig.from_dict({"model_type": "qwen3_5_moe"})


def test_prefix_caching_is_off_for_both_layouts():
    assert not supports_prefix_caching({"model_type": "qwen3_5_moe"})
    assert not supports_prefix_caching({"model_type": "qwen3_5_moe_text"})


# ---- images ----


@pytest.fixture(scope="module")
def vl_checkpoint(tmp_path_factory):
    return build_vision_checkpoint(tmp_path_factory.mktemp("vision_moe"), seed=12, text=MOE, vision=VISION,
                                   model_type="qwen3_5_moe")


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)])
def test_image_parity(vl_checkpoint, tp):
    """Text, one image and two images in one batch, prefilled in 16-token chunks (the first image,
    8 tokens from position 13, straddles a chunk boundary), against transformers'
    Qwen3_5MoeForConditionalGeneration."""
    cases = [(image_prompt(vl_checkpoint, [10, 20, 30, 40]), []),
             (image_prompt(vl_checkpoint, list(range(40, 52)), None, [13, 14, 15]), [image_data_uri(20, 28, 1)]),
             (image_prompt(vl_checkpoint, [16], None, [17, 18], None, [19]),
              [image_data_uri(36, 24, 2), image_data_uri(12, 12, 3)])]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
    with LLM(str(vl_checkpoint), tensor_parallel_size=tp, max_model_len=256, max_num_seqs=4) as llm:
        assert llm.engine.model.vision is not None
        outs = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": u}} for ids, u in cases], params)
    for out, (ids, uris) in zip(outs, cases):
        assert_image_parity(out, *image_reference(vl_checkpoint, ids, uris, NEW_TOKENS))
        assert len(out.prompt_token_ids) > len(ids) or not uris  # placeholders were expanded
