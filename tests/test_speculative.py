"""Speculative decoding with n-gram proposals: output equal to decoding without it (greedy, seeded
sampling, stop strings, structured output, at tp 1 and 2), sampled distributions that agree, no
speculation in large batches, and the proposer and config on their own."""

from __future__ import annotations

import json

import pytest
from checkpoints import build_checkpoint

from neuron import LLM, SamplingParams
from neuron.engine.sampling_params import GuidedDecodingParams
from neuron.engine.speculative import Acceptance, SpeculativeConfig, ngram_proposal
from neuron.errors import ConfigError

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# Unequal prompts; repeated spans give the proposer something to find.
PROMPTS = [[5, 17, 20, 3], list(range(10, 40)), [7, 8, 9, 7, 8, 9, 7, 8], [250, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]


@pytest.fixture(scope="module")
def repetitive(tmp_path_factory):
    """A random model with narrow weights: its greedy output falls into repeated spans, which
    n-gram proposals find (about half of them are taken)."""
    return build_checkpoint(tmp_path_factory.mktemp("spec"), seed=4, vocab_size=301, initializer_range=0.02,
                            tie_word_embeddings=False)


def _run(path, params, spec=None, tp=1, prompts=PROMPTS, **kwargs):
    with LLM(None if path is None else str(path), tensor_parallel_size=tp, device="cpu", dtype="float32",
             speculative_config=spec, **kwargs) as llm:
        outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
        return outs, list(llm.engine.spec_counts)


def _assert_same(a, b) -> None:
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        assert x.finish_reason == y.finish_reason
        for lx, ly in zip(x.logprobs or [], y.logprobs or []):
            assert lx.keys() == ly.keys() and max(abs(lx[t] - ly[t]) for t in lx) < 1e-4


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("temperature,seed,penalty", [(0.0, None, 1.0), (0.02, 11, 1.0), (0.9, 12, 1.1)])
def test_output_equals_decoding_without_speculation(repetitive, tp, temperature, seed, penalty):
    """Greedy, and seeded sampling (with a repetition penalty, which counts the tokens kept before
    each position): the same tokens and logprobs with and without speculation."""
    params = SamplingParams(temperature=temperature, seed=seed, max_tokens=40, logprobs=2, ignore_eos=True,
                            repetition_penalty=penalty)
    plain, _ = _run(repetitive, params, tp=tp)
    spec, (proposed, accepted, drafts) = _run(repetitive, params, SPEC, tp=tp)
    assert proposed > 0 and drafts > 0 and accepted <= proposed
    if penalty == 1.0:
        assert accepted > 0  # some proposals were kept: the accepting path ran
    _assert_same(spec, plain)


def test_stop_strings_and_structured_output_cut_inside_an_accepted_run():
    """The default model (a tokenizer): a stop string met mid-run ends the output where it ends
    without speculation, and JSON output stays inside its schema."""
    stop = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    texts, _ = _run(None, stop, prompts=[[5, 6, 7, 5, 6, 7]])
    word = texts[0].text[len(texts[0].text) // 2:][:3]
    cut = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True, stop=[word])
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    guided = SamplingParams(temperature=0.0, max_tokens=40, guided_decoding=GuidedDecodingParams(json=schema))
    results = {}
    for name, params in (("stop", cut), ("json", guided)):
        plain, _ = _run(None, params, prompts=[[5, 6, 7, 5, 6, 7], [9, 9, 9]])
        spec, counts = _run(None, params, SPEC, prompts=[[5, 6, 7, 5, 6, 7], [9, 9, 9]])
        assert counts[0] > 0
        _assert_same(spec, plain)
        assert [o.text for o in spec] == [o.text for o in plain]
        results[name] = spec
    assert results["stop"][0].finish_reason == "stop" and word not in results["stop"][0].text
    assert all(o.text.startswith('{"a":"') for o in results["json"])


def test_sampled_distributions_agree(repetitive):
    """Unseeded sampling: the second token's distribution (the first a proposal can change), over
    many draws with and without speculation, passes a chi-square test of equality."""
    prompt = list(range(301))  # every token appears: a proposal always exists
    params = SamplingParams(temperature=1.0, top_k=4, max_tokens=2, ignore_eos=True)
    spec = dict(SPEC, disable_by_batch_size=64)
    counts = []
    for config in (None, spec):
        outs, _ = _run(repetitive, params, config, prompts=[prompt] * 400, max_num_seqs=64, max_model_len=512)
        hist: dict[tuple, int] = {}
        for o in outs:
            hist[tuple(o.token_ids)] = hist.get(tuple(o.token_ids), 0) + 1
        counts.append(hist)
    keys = [k for k in set(counts[0]) | set(counts[1]) if counts[0].get(k, 0) + counts[1].get(k, 0) >= 10]
    chi2 = sum((counts[0].get(k, 0) - counts[1].get(k, 0)) ** 2 / (counts[0].get(k, 0) + counts[1].get(k, 0))
               for k in keys)
    # two samples of equal size: chi2 ~ chi-square with len(keys) - 1 degrees of freedom; p = 0.001
    critical = {d: c for d, c in zip(range(1, 31), (10.8, 13.8, 16.3, 18.5, 20.5, 22.5, 24.3, 26.1, 27.9, 29.6,
                                                    31.3, 32.9, 34.5, 36.1, 37.7, 39.3, 40.8, 42.3, 43.8, 45.3,
                                                    46.8, 48.3, 49.7, 51.2, 52.6, 54.1, 55.5, 56.9, 58.3, 59.7))}
    assert 2 <= len(keys) <= 31
    assert chi2 < critical[len(keys) - 1], (chi2, len(keys))


def test_no_speculation_in_a_step_past_the_batch_bound(repetitive):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    _, counts = _run(repetitive, params, dict(SPEC, disable_by_batch_size=2))  # 4 sequences decode together
    _, alone = _run(repetitive, params, dict(SPEC, disable_by_batch_size=2), prompts=PROMPTS[:2])
    assert counts[0] == 0 and alone[0] > 0


def test_ngram_proposals():
    assert ngram_proposal([1, 2, 3, 9, 1, 2, 3], 2, 1, 3) == [9, 1]  # the 3-gram 1 2 3 was followed by 9
    assert ngram_proposal([1, 2, 3, 9, 5, 2, 3], 3, 1, 3) == [9, 5, 2]  # 2 3 (a 2-gram) was followed by 9
    assert ngram_proposal([4, 4, 4], 3, 1, 3) == [4, 4, 4]  # a run continues
    assert ngram_proposal([8, 1, 2, 1, 2], 5, 1, 2) == [1, 2, 1, 2, 1]  # so does a period of two
    assert ngram_proposal([1, 2, 3, 4], 3, 1, 3) == []  # nothing repeats
    assert ngram_proposal([1, 2, 1], 3, 2, 3) == []  # below prompt_lookup_min


def test_acceptance_sets_the_proposal_length():
    a = Acceptance()
    assert a.length(3) == 3
    for _ in range(12):
        a.record(3, 0)
    lengths = [a.length(3) for _ in range(16)]
    assert lengths.count(0) >= 14 and 1 in lengths  # rests, with a retry now and then
    for _ in range(12):
        a.record(1, 1)
    assert a.length(3) == 3


@pytest.mark.parametrize("value,message", [
    ('{"method": "eagle"}', "method 'eagle' is not available"),
    ('{"num_speculative_tokens": 0}', "1..16"),
    ('{"prompt_lookup_min": 3, "prompt_lookup_max": 2}', "prompt_lookup_min <= prompt_lookup_max"),
    ('{"k": 3}', "unknown key"),
    ("[1]", "JSON object"),
])
def test_bad_configs_are_refused(value, message):
    with pytest.raises(ConfigError, match=message):
        SpeculativeConfig.parse(value)


def test_models_with_recurrent_state_are_refused(tmp_path):
    config = {"model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"], "vocab_size": 64,
              "max_position_embeddings": 512}
    (tmp_path / "config.json").write_text(json.dumps(config))
    from neuron.engine.engine_config import EngineConfig
    from neuron.engine.llm_engine import LLMEngine

    with pytest.raises(ConfigError, match="recurrent layers' state cannot be rolled back"):
        LLMEngine(EngineConfig(model=str(tmp_path), device="cpu", speculative_config=SPEC))
