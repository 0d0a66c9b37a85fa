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

from neuron.errors import ConfigError
from neuron.models.qwen3 import Qwen3Config

NEW_TOKENS = 6
PROMPTS = [[5, 17, 200, 3], list(range(10, 50)), [7]]
ODD = dict(vocab_size=301, num_key_value_heads=1, head_dim=24, rope_theta=1e6)


def _build(path, family: str, **overrides):
    import transformers

    names = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
             "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}
    config_cls, model_cls = (getattr(transformers, n) for n in names[family])
    torch.manual_seed(len(family))
    config = config_cls(**{**BASE, **overrides})
    model_cls(config).eval().save_pretrained(path, safe_serialization=True)
    return path, model_cls


CASES = {
    "llama-odd-bias-untied": ("llama", dict(ODD, attention_bias=True, tie_word_embeddings=False)),
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
    (dict(model_type="llama", mlp_bias=True), "mlp_bias"),
    (dict(model_type="llama", rope_scaling={"rope_type": "llama3", "factor": 8.0}), "rope type 'llama3'"),
])
def test_what_the_decoder_does_not_run_is_refused_by_name(config, message):
    with pytest.raises(ConfigError, match=message):
        Qwen3Config.from_dict(dict(BASE, **config))
