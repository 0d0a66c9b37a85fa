"""The dense families that share Qwen3's decoder (Llama, Mistral, Qwen2 / Qwen2.5): greedy tokens
and logprobs equal transformers' on tiny random checkpoints built here, at several tp sizes, with
the shapes that break easy assumptions (a vocabulary no tp divides, one KV head, biases on, tied
and untied embeddings), and chunked prefill equal to single-shot."""

from __future__ import annotations

import pytest
import torch
from checkpoints import (
    BASE,
    assert_chunking_changes_nothing,
    assert_matches_reference,
    cached_model,
    generate_greedy,
    greedy_with_logprobs,
)

from neuron.engine.engine_config import EngineConfig
from neuron.errors import ConfigError
from neuron.models import context_length, merged
from neuron.models.qwen3 import Qwen3Config

NEW_TOKENS = 6
PROMPTS = [[5, 17, 200, 3], list(range(10, 50)), [7]]
ODD = dict(vocab_size=301, num_key_value_heads=1, head_dim=24, rope_theta=1e6)


def _build(path, family: str, **overrides):
    import transformers

    names = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
             "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "qwen3_plain": ("Qwen3Config", "Qwen3ForCausalLM")}
    config_cls, model_cls = (getattr(transformers, n) for n in names[family])
    torch.manual_seed(len(family))
    config = config_cls(**{**BASE, **overrides})
    model_cls(config).eval().save_pretrained(path, safe_serialization=True)
    return path, model_cls


CASES = {
    "llama-odd-bias-untied": ("llama", dict(ODD, attention_bias=True, mlp_bias=True, tie_word_embeddings=False)),
    "mistral-tied": ("mistral", dict(sliding_window=None)),
    "qwen2-odd-untied": ("qwen2", dict(ODD, tie_word_embeddings=False)),
}


@pytest.fixture(scope="module", params=list(CASES))
def family_checkpoint(request, tmp_path_factory):
    family, overrides = CASES[request.param]
    return _build(tmp_path_factory.mktemp(request.param), family, **overrides)


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)])
def test_family_matches_transformers(family_checkpoint, tp, small_prefill_chunks):
    path, model_cls = family_checkpoint
    outs = generate_greedy(path, tp, PROMPTS, NEW_TOKENS)
    for prompt, got in zip(PROMPTS, outs):
        assert_matches_reference(got, *greedy_with_logprobs(cached_model(model_cls, path), prompt, NEW_TOKENS),
                                 f"prompt {prompt[:5]}...")


def test_family_chunked_prefill_equals_single_shot(family_checkpoint, monkeypatch):
    assert_chunking_changes_nothing(family_checkpoint[0], PROMPTS[1], 3, monkeypatch)


def test_the_switches_each_family_sets():
    base = dict(BASE, num_hidden_layers=2)
    llama = Qwen3Config.from_dict(dict(base, model_type="llama", attention_bias=True))
    qwen2 = Qwen3Config.from_dict(dict(base, model_type="qwen2"))
    qwen3 = Qwen3Config.from_dict(dict(base, model_type="qwen3"))
    assert (llama.qk_norm, llama.attention_bias, llama.o_bias) == (False, True, True)
    assert (qwen2.qk_norm, qwen2.attention_bias, qwen2.o_bias) == (False, True, False)
    assert (qwen3.qk_norm, qwen3.attention_bias, qwen3.o_bias) == (True, False, False)


@pytest.mark.parametrize("config, message", [
    (dict(model_type="mistral", sliding_window=64), "sliding-window attention"),
    (dict(model_type="qwen2", mlp_bias=True), "mlp_bias"),
    (dict(model_type="llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "rope type 'dynamic'"),
    (dict(model_type="llama", rope_scaling={"type": "longrope", "factor": 2.0}), "rope type 'longrope'"),
    (dict(model_type="qwen3", rope_parameters={"rope_type": "su"}), "rope type 'su'"),
    (dict(model_type="llama", rope_scaling={"rope_type": "llama3", "factor": 8.0}), "low_freq_factor"),
])
def test_what_the_decoder_does_not_run_is_refused_by_name(config, message):
    with pytest.raises(ConfigError, match=message):
        Qwen3Config.from_dict(dict(BASE, **config))


# Rope scaling: a pretraining length of 64 stretched four times, and prompts that run well past it.
LONG_PROMPT = [(7 * i + 3) % 250 for i in range(200)]
ROPE_CASES = {
    "llama-linear": ("llama", dict(max_position_embeddings=64, rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "llama-llama3": ("llama", dict(max_position_embeddings=256, rope_scaling={
        "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})),
    "qwen2-yarn": ("qwen2", dict(max_position_embeddings=64, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})),
    "mistral-yarn-mscale-untruncated": ("mistral", dict(sliding_window=None, max_position_embeddings=64, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 16.0,
        "beta_slow": 2.0, "mscale": 1.2, "mscale_all_dim": 0.8, "truncate": False})),
}


@pytest.fixture(scope="module", params=list(ROPE_CASES))
def rope_checkpoint(request, tmp_path_factory):
    family, overrides = ROPE_CASES[request.param]
    return _build(tmp_path_factory.mktemp(request.param), family, **overrides)


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_rope_scaling_matches_transformers_past_the_original_length(rope_checkpoint, tp):
    path, model_cls = rope_checkpoint
    [got] = generate_greedy(path, tp, [LONG_PROMPT], NEW_TOKENS)
    assert_matches_reference(got, *greedy_with_logprobs(cached_model(model_cls, path), LONG_PROMPT, NEW_TOKENS),
                             "a 200-token prompt")


def test_rope_scaling_stretches_the_default_context():
    base = dict(BASE, max_position_embeddings=64)
    cases = [({}, 64), ({"rope_type": "linear", "factor": 4.0}, 256),
             ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}, 128),
             ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}, 64)]
    for scaling, expected in cases:
        assert context_length(dict(base, model_type="llama", rope_scaling=scaling or None)) == expected, scaling


def test_yarn_turned_on_by_hf_overrides(tmp_path):
    """A checkpoint whose config has no rope scaling runs past its length once `hf_overrides` adds
    YaRN, as transformers does with the same setting."""
    import transformers

    path = _build(tmp_path / "qwen3", "qwen3_plain", max_position_embeddings=64)[0]
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0}
    from neuron import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=5, ignore_eos=True)
    with pytest.raises(ConfigError, match="max_model_len"):
        LLM(str(path), device="cpu", dtype="float32", max_model_len=256)
    # at tp 2, so the workers build their shards from the overridden config the leader sends
    with LLM(str(path), tensor_parallel_size=2, device="cpu", dtype="float32",
             hf_overrides={"rope_scaling": yarn}) as llm:
        assert llm.engine.max_model_len == 256
        [out] = llm.generate([{"prompt_token_ids": LONG_PROMPT}], params)
    config = transformers.AutoConfig.from_pretrained(path)
    config.rope_parameters = yarn
    reference = transformers.Qwen3ForCausalLM.from_pretrained(path, config=config, dtype=torch.float32).eval()
    assert_matches_reference(out.outputs[0], *greedy_with_logprobs(reference, LONG_PROMPT, NEW_TOKENS), "yarn override")


@pytest.mark.parametrize("value, message", [("[1, 2]", "JSON object"), ("{not json", "JSON object"),
                                            (3, "JSON object")])
def test_malformed_hf_overrides_are_refused(value, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig(hf_overrides=value)


def test_overrides_merge_key_by_key():
    base = {"a": 1, "rope_parameters": {"rope_theta": 5.0, "rope_type": "default"}, "text_config": {"x": 1}}
    out = merged(base, {"rope_parameters": {"rope_type": "linear", "factor": 2.0}, "a": None})
    assert out == {"a": None, "rope_parameters": {"rope_theta": 5.0, "rope_type": "linear", "factor": 2.0},
                   "text_config": {"x": 1}}
    assert base["rope_parameters"] == {"rope_theta": 5.0, "rope_type": "default"}  # not changed in place
