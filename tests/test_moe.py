"""Qwen3-MoE: parity with transformers through the offline API at tp 1 and 2, in both expert layouts
(per-expert tensors, as transformers writes them, and fused [E, ...] tensors), plus the routing rule
and the refusals a parity run cannot reach."""

from __future__ import annotations

import pytest
import torch
from checkpoints import assert_matches_reference, assert_same_outputs, cached_model, greedy_with_logprobs
from safetensors.torch import load_file, save_file

from neuron import LLM, SamplingParams
from neuron.distributed.comm import Communicator, SingleRank
from neuron.errors import ConfigError
from neuron.layers.moe import SparseMoE
from neuron.models import build_model
from neuron.models.qwen3_moe import Qwen3MoeConfig

NEW_TOKENS = 8
LONG = [(i * 37 + 11) % 301 for i in range(40)]  # several 16-token prefill chunks
PROMPTS = [[5, 17, 200, 3], LONG, [7], [250, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]

pytestmark = pytest.mark.usefixtures("small_prefill_chunks")

# An odd expert count (every rank still holds every expert), one dense layer among MoE ones, an
# untied head and a vocabulary no tp divides.
MOE = dict(
    vocab_size=301,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_experts=5,
    num_experts_per_tok=2,
    num_hidden_layers=3,
    mlp_only_layers=[1],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    # Wide, as in checkpoints.py: well-separated logits and router scores, so neither greedy
    # tokens nor expert choices tie for reasons unrelated to correctness.
    initializer_range=0.25,
    eos_token_id=None,
    bos_token_id=None,
)


def _build(path, seed: int, **overrides):
    from transformers import Qwen3MoeConfig as HFConfig
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    Qwen3MoeForCausalLM(HFConfig(**{**MOE, **overrides})).eval().save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module", params=[True, False], ids=["norm_topk", "raw_topk"])
def moe_checkpoint(request, tmp_path_factory):
    return _build(tmp_path_factory.mktemp("moe"), seed=3, norm_topk_prob=request.param)


@pytest.fixture(scope="module")
def fused_checkpoint(tmp_path_factory):
    """The same weights as a per-expert checkpoint, experts stacked into transformers' in-memory
    layout: gate_up_proj [E, 2 * inter, hidden] and down_proj [E, hidden, inter]."""
    src = _build(tmp_path_factory.mktemp("moe_src"), seed=4, norm_topk_prob=True)
    dst = tmp_path_factory.mktemp("moe_fused")
    tensors = load_file(src / "model.safetensors")
    for i in (0, 2):
        p = f"model.layers.{i}.mlp.experts"
        per = [{w: tensors.pop(f"{p}.{e}.{w}.weight") for w in ("gate_proj", "up_proj", "down_proj")}
               for e in range(MOE["num_experts"])]
        tensors[f"{p}.gate_up_proj"] = torch.stack([torch.cat([x["gate_proj"], x["up_proj"]]) for x in per])
        tensors[f"{p}.down_proj"] = torch.stack([x["down_proj"] for x in per])
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    (dst / "config.json").write_text((src / "config.json").read_text())
    return src, dst


def _generate(path, tp: int = 1):
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=5, ignore_eos=True)
    with LLM(str(path), tensor_parallel_size=tp, device="cpu", dtype="float32") as llm:
        return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]


def _check(outs, reference_path) -> None:
    from transformers import Qwen3MoeForCausalLM

    model = cached_model(Qwen3MoeForCausalLM, reference_path)
    for prompt, got in zip(PROMPTS, outs):
        assert_matches_reference(got, *greedy_with_logprobs(model, prompt, NEW_TOKENS), f"prompt {prompt[:5]}...")
        assert len(got.logprobs) == NEW_TOKENS


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_parity(moe_checkpoint, tp):
    """Unequal prompts in one batch, the long one prefilled over several chunks."""
    _check(_generate(moe_checkpoint, tp), moe_checkpoint)


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_fused_layout_parity(fused_checkpoint, tp):
    src, fused = fused_checkpoint
    _check(_generate(fused, tp), src)


def test_chunked_prefill_equals_single_shot(moe_checkpoint, monkeypatch):
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, ignore_eos=True)
    results = []
    for chunk in ("3", "512"):
        monkeypatch.setenv("NEURON_PREFILL_CHUNK_TOKENS", chunk)
        with LLM(str(moe_checkpoint), device="cpu", dtype="float32") as llm:
            results.append(llm.generate({"prompt_token_ids": LONG}, params)[0].outputs[0])
    assert_same_outputs(*results)


def test_sparse_layers_follow_transformers_rule():
    cfg = Qwen3MoeConfig.from_dict(dict(MOE, num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3]))
    assert [cfg.is_sparse(i) for i in range(6)] == [False, True, False, False, False, True]


def test_grouped_experts_equal_a_per_token_loop(moe_checkpoint):
    """Tokens sorted by expert, one matmul per expert hit, equal each token's own experts summed."""
    from neuron.models.loader import CheckpointReader, safetensors_files

    model = build_model({**MOE, "model_type": "qwen3_moe"}, SingleRank(), torch.float32, torch.device("cpu"))
    with CheckpointReader(safetensors_files(moe_checkpoint)) as r:
        block = model._load_mlp(r, 0)
    assert isinstance(block, SparseMoE)
    x = torch.randn(7, MOE["hidden_size"])
    ids, weights = block.router(x)
    expected = torch.zeros_like(x)
    for t in range(7):
        for e, w in zip(ids[t].tolist(), weights[t]):
            gate, up = (block.w_gate_up[e] @ x[t]).split(block.local_inter)
            expected[t] += w * (block.w_down[e] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(block(x), expected, atol=1e-5, rtol=1e-5)


class _SecondOfTwo(Communicator):
    """Rank 1 of 2, for refusals raised while the model is built, before any collective runs."""

    def __init__(self):
        super().__init__(1, 2)


def test_indivisible_moe_intermediate_size_is_refused():
    config = {**MOE, "model_type": "qwen3_moe", "moe_intermediate_size": 33}
    with pytest.raises(ConfigError, match=r"moe_intermediate_size \(33\) is not divisible by the tensor-parallel size 2"):
        build_model(config, _SecondOfTwo(), torch.float32, torch.device("cpu"))
    build_model(config, SingleRank(), torch.float32, torch.device("cpu"))  # tp 1 divides everything


def test_missing_expert_fields_are_refused():
    config = {k: v for k, v in MOE.items() if k != "num_experts"}
    with pytest.raises(ConfigError, match="num_local_experts"):
        Qwen3MoeConfig.from_dict(config)
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        Qwen3MoeConfig.from_dict(dict(MOE, num_experts_per_tok=6))
