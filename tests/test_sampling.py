import math
import warnings

import numpy as np
import pytest
import torch

from neuron.engine import draw, sampling
from neuron.engine.sampling import SequenceSampler, TokenBitmask, sample
from neuron.engine.sampling_params import InvalidParams, SamplingParams

V = 64


def _sampler(prompt: list[int] | None = None, vocab: int = V, device: str = "cpu", **kw) -> SequenceSampler:
    return SequenceSampler(SamplingParams(**kw), prompt or [], vocab, device)


def _row(*values: float) -> torch.Tensor:
    return torch.tensor([values], dtype=torch.float32)


def _generate(sampler: SequenceSampler, steps: list[torch.Tensor]) -> list[int]:
    out = []
    for logits in steps:
        token = sample(logits, [sampler]).token_ids[0]
        sampler.append(token)
        out.append(token)
    return out


# ---- validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"n": 0}, "n"),
        ({"temperature": -1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"presence_penalty": -2.5}, "presence_penalty"),
        ({"frequency_penalty": 3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"seed": 2**64}, "seed"),
        ({"max_tokens": -1}, "max_tokens"),  # 0 is allowed: the prompt scored, nothing generated
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop_token_ids": [3, -1]}, "stop_token_ids"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ],
)
def test_invalid_params_name_the_parameter(kwargs, param):
    with pytest.raises(InvalidParams) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param
    assert isinstance(info.value, ValueError)
    assert param in str(info.value)


def test_message_states_the_allowed_range():
    with pytest.raises(InvalidParams, match=r"temperature must be >= 0, got -1"):
        SamplingParams(temperature=-1)


def test_edge_values_are_accepted():
    p = SamplingParams(
        temperature=0, top_p=1.0, top_k=-1, min_p=1.0, presence_penalty=-2, frequency_penalty=2,
        max_tokens=None, min_tokens=100, logprobs=20, seed=0,
    )
    assert p.max_tokens is None and p.top_k == -1


def test_stop_string_is_normalised_to_a_list():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=["a", "b"]).stop == ["a", "b"]
    assert SamplingParams().stop is None


def test_greedy_property():
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=0.8, top_k=1).greedy
    assert not SamplingParams().greedy
    assert not SamplingParams(temperature=0.5, top_k=2).greedy


# ---- greedy and logprobs ------------------------------------------------------------------------


def test_greedy_is_argmax():
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(0))
    result = sample(logits, [_sampler(temperature=0) for _ in range(5)])
    assert result.token_ids == logits.argmax(-1).tolist()
    assert result.logprobs == [None] * 5


def test_plain_greedy_batch_takes_the_single_argmax_path(monkeypatch):
    def fail(*_):
        raise AssertionError("plain greedy batch left the argmax path")

    monkeypatch.setattr(sampling, "_choose", fail)
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1)).bfloat16()
    assert sample(logits, [_sampler(temperature=0)] * 3).token_ids == logits.argmax(-1).tolist()


def test_logits_shape_must_match_samplers():
    with pytest.raises(ValueError, match="one row per sampler"):
        sample(torch.zeros(2, V), [_sampler(temperature=0)])


def test_logprobs_are_raw_log_softmax_with_sampled_and_top_ids():
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(2))
    # Row 1 is sampled with a penalty and a temperature: its logprobs must still be the raw ones.
    samplers = [
        _sampler(temperature=0, logprobs=3),
        _sampler([1, 2, 3], temperature=0.7, repetition_penalty=1.5, logprobs=5, seed=3),
    ]
    before = logits.clone()
    result = sample(logits, samplers)
    assert torch.equal(logits, before)
    expected = torch.log_softmax(logits, dim=-1)
    for row, n in ((0, 3), (1, 5)):
        entry = result.logprobs[row]
        token = result.token_ids[row]
        top = expected[row].topk(n).indices.tolist()
        assert token in entry and set(top) <= set(entry)
        assert len(entry) == n + (token not in top)  # the sampled token joins the top n
        for tid, lp in entry.items():
            assert lp == pytest.approx(expected[row, tid].item(), abs=1e-6)


def test_logprobs_zero_holds_only_the_sampled_token():
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(4))
    result = sample(logits, [_sampler(temperature=1.0, seed=5, logprobs=0)])
    token = result.token_ids[0]
    assert list(result.logprobs[0]) == [token]
    assert result.logprobs[0][token] == pytest.approx(torch.log_softmax(logits, -1)[0, token].item())


def test_logprobs_of_bfloat16_logits_are_float32_and_unpenalised():
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(6)).bfloat16()
    best = int(logits.argmax())
    s = _sampler([best], temperature=0, repetition_penalty=1.9, presence_penalty=2.0, logprobs=2)
    s.append(best)
    before = logits.clone()
    result = sample(logits, [s])
    assert torch.equal(logits, before)
    token = result.token_ids[0]
    assert token != best
    raw = torch.log_softmax(logits.float(), -1)[0]
    assert result.logprobs[0][token] == pytest.approx(raw[token].item(), abs=1e-6)
    assert result.logprobs[0][best] == pytest.approx(raw[best].item(), abs=1e-6)


# ---- filters ------------------------------------------------------------------------------------

# Probabilities 0.4, 0.3, 0.2, 0.1: flat enough that an unfiltered draw often misses token 0.
_FOUR = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()


def _draws(n: int, vocab: int = 4, logits: torch.Tensor = _FOUR, **kw) -> set[int]:
    return {sample(logits, [_sampler(vocab=vocab, seed=seed, **kw)]).token_ids[0] for seed in range(n)}


def test_unfiltered_draws_reach_every_token():
    assert _draws(200) == {0, 1, 2, 3}


def test_top_k_one_is_greedy_even_with_temperature():
    assert _draws(50, temperature=5.0, top_k=1) == {0}


def test_top_k_keeps_the_k_best():
    assert _draws(200, temperature=3.0, top_k=2) == {0, 1}


def test_tiny_top_p_keeps_only_the_top_token():
    assert _draws(50, top_p=1e-6) == {0}


@pytest.mark.parametrize(
    ("top_p", "kept"), [(0.35, {0}), (0.5, {0, 1}), (0.8, {0, 1, 2}), (0.95, {0, 1, 2, 3})]
)
def test_top_p_keeps_the_nucleus(top_p, kept):
    # Mass ahead of each token: 0, 0.4, 0.7, 0.9; a token stays while that is below top_p.
    assert _draws(300, top_p=top_p) == kept


def test_top_p_is_relative_to_the_top_k_survivors():
    # After top_k=2 the survivors renormalise to 0.57 and 0.43; token 1 has 0.57 ahead of it,
    # which is not below 0.55, so only token 0 remains (raw mass ahead would be 0.4 < 0.55).
    assert _draws(200, top_k=2, top_p=0.55) == {0}
    assert _draws(200, top_k=2, top_p=0.6) == {0, 1}


def test_allowed_token_ids_are_the_only_draws():
    assert _draws(200, allowed_token_ids=[1, 3]) == {1, 3}
    assert _draws(50, allowed_token_ids=[3], temperature=0) == {3}


def test_logit_bias_moves_greedy_and_draws_but_not_the_logprobs():
    biased = sample(_FOUR, [_sampler(vocab=4, temperature=0, logit_bias={2: 1.0}, logprobs=1)])
    assert biased.token_ids == [2]  # log 0.2 + 1 > log 0.4
    assert biased.logprobs[0][2] == pytest.approx(math.log(0.2), abs=1e-6)  # reported from the raw logits
    assert _draws(200, logit_bias={0: -100.0, 1: -100.0}) == {2, 3}
    # added before the penalties, as vLLM: the repetition penalty divides the biased logit
    s = _sampler(vocab=4, temperature=0, logit_bias={1: 2.0}, repetition_penalty=4.0)
    s.append(1)
    assert sample(_row(1.0, 1.1, 0.0, 0.0), [s]).token_ids == [0]  # (1.1 + 2) / 4 < 1


def test_bad_words_ban_the_token_that_would_complete_one():
    s = SequenceSampler(SamplingParams(temperature=0, bad_words=["x"]), [], 4, "cpu", [[0], [2, 1]])
    row = _row(3.0, 2.0, 1.0, 0.0)
    assert sample(row, [s]).token_ids == [1]  # 0 is a bad word alone
    s.append(2)
    assert sample(row, [s]).token_ids == [2]  # after 2, 1 would complete [2, 1]
    s.append(3)
    assert sample(row, [s]).token_ids == [1]


def test_bad_words_cover_both_forms_of_a_word(default_tokenizer):
    from neuron.engine.sampling import bad_words_token_ids

    forms = bad_words_token_ids(default_tokenizer, ["hello", " world"])
    assert default_tokenizer.encode("hello") in forms and default_tokenizer.encode(" hello") in forms
    assert default_tokenizer.encode("world") in forms and default_tokenizer.encode(" world") in forms


@pytest.mark.parametrize("kw, says", [
    ({"bad_words": [" "]}, "non-blank"),
    ({"bad_words": "word"}, "a list"),
    ({"logit_bias": {1: 101}}, "in [-100, 100]"),
    ({"logit_bias": {1: float("nan")}}, "in [-100, 100]"),
    ({"logit_bias": {"1": 1.0}}, "token id"),
    ({"logit_bias": [1]}, "must map"),
    ({"allowed_token_ids": []}, "non-empty"),
    ({"allowed_token_ids": [1.5]}, "token id"),
])
def test_bad_logit_bias_and_allowed_token_ids_are_refused(kw, says):
    with pytest.raises(InvalidParams) as e:
        SamplingParams(**kw)
    assert e.value.param == next(iter(kw)) and says in str(e.value)


def test_min_p_drops_tokens_below_the_fraction_of_the_best():
    # Floor 0.3 * 0.4 = 0.12: token 3 (0.1) goes, token 2 (0.2) stays.
    assert _draws(300, min_p=0.3) == {0, 1, 2}
    assert _draws(300, min_p=0.6) == {0, 1}


def test_top_p_is_relative_to_the_min_p_survivors():
    # min_p 0.3 leaves 0.4, 0.3 and 0.2 (0.9 in all); top_p 0.75 of that is 0.675, which the 0.7
    # ahead of token 2 is not below, so it goes too (of the whole, 0.75 would have kept it).
    assert _draws(300, min_p=0.3, top_p=0.75) == {0, 1}
    assert _draws(300, min_p=0.3, top_p=0.8) == {0, 1, 2}


# ---- penalties ----------------------------------------------------------------------------------


def _greedy_pick(logits: torch.Tensor, sampler: SequenceSampler) -> int:
    return sample(logits, [sampler]).token_ids[0]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    s = _sampler([0, 2], vocab=4, repetition_penalty=2.0)
    s.append(3)
    row = torch.tensor([2.0, 1.5, -1.0, 0.5])
    s.adjust(row, ())
    assert row.tolist() == [1.0, 1.5, -2.0, 0.25]


def test_a_windowed_repetition_penalty_sees_only_the_last_tokens():
    """llama.cpp's repeat_last_n: the tokens of the prompt and output within the window are
    penalised, those that left it no longer, whatever the frequency and presence penalties count."""
    rng = np.random.default_rng(0)
    prompt = [1, 2, 3, 4, 5, 1]
    window = 4
    s = _sampler(prompt, vocab=8, repetition_penalty=2.0, repetition_window=window, presence_penalty=0.5)
    history = list(prompt)
    for token in (6, 6, 7, 0, 2, 2, 3):
        row = torch.tensor(rng.standard_normal(8), dtype=torch.float32)
        want = row.clone()
        seen = set(history[-window:])
        for t in seen:
            want[t] = want[t] / 2.0 if want[t] > 0 else want[t] * 2.0
        outputs = history[len(prompt):]
        want -= 0.5 * torch.tensor([t in outputs for t in range(8)], dtype=torch.float32)
        s.adjust(row, ())
        assert torch.equal(row, want), (history, row, want)
        s.append(token)
        history.append(token)


@pytest.mark.parametrize("window", [0, -1, 2.5])
def test_a_repetition_window_is_a_count_of_tokens(window):
    with pytest.raises(InvalidParams, match="repetition_window"):
        SamplingParams(repetition_penalty=1.1, repetition_window=window)


@pytest.mark.parametrize(
    ("logits", "penalty", "expected"),
    [
        ((2.0, 1.5, 0.0), 1.0, 0),
        ((2.0, 1.5, 0.0), 2.0, 1),  # 2.0 / 2 = 1.0 < 1.5
        ((2.0, 1.5, 0.0), 1.2, 0),  # 2.0 / 1.2 = 1.67 still beats 1.5
        ((-1.0, -1.5, -3.0), 2.0, 1),  # negative logits are pushed down: -1 * 2 = -2 < -1.5
    ],
)
def test_repetition_penalty_changes_the_greedy_choice(logits, penalty, expected):
    s = _sampler([0], vocab=3, temperature=0, repetition_penalty=penalty)
    assert _greedy_pick(_row(*logits), s) == expected


def test_presence_and_frequency_penalties_follow_the_openai_formula():
    s = _sampler(vocab=4, presence_penalty=0.5, frequency_penalty=0.25)
    for token in (1, 1, 1, 2):
        s.append(token)
    row = torch.tensor([1.0, 1.0, 1.0, 1.0])
    s.adjust(row, ())
    assert row.tolist() == [1.0, 1.0 - 0.5 - 0.75, 1.0 - 0.5 - 0.25, 1.0]


def test_presence_penalty_applies_to_output_not_prompt():
    logits = _row(3.0, 2.5, 0.0)
    in_prompt = _sampler([0, 0, 0], vocab=3, temperature=0, presence_penalty=1.0)
    assert _greedy_pick(logits, in_prompt) == 0
    in_output = _sampler(vocab=3, temperature=0, presence_penalty=1.0)
    in_output.append(0)
    assert _greedy_pick(logits, in_output) == 1


@pytest.mark.parametrize(("repeats", "expected"), [(2, 0), (3, 1)])
def test_frequency_penalty_scales_with_count(repeats, expected):
    # 3.0 - 0.2 * repeats against 2.5: 2.6 keeps token 0, 2.4 loses it.
    s = _sampler(vocab=3, temperature=0, frequency_penalty=0.2)
    for _ in range(repeats):
        s.append(0)
    assert _greedy_pick(_row(3.0, 2.5, 0.0), s) == expected


# ---- seeds --------------------------------------------------------------------------------------


def _steps(n: int, batch: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, V, generator=g) for _ in range(n)]


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 1.3, "top_p": 0.9},
        {"temperature": 0.8},
        {"top_k": 5},
        {"min_p": 0.05, "repetition_penalty": 1.3},
    ],
)
def test_same_seed_same_tokens_whatever_the_batch(params):
    params = {**params, "seed": 1234}
    alone_steps = _steps(12, 1, seed=7)
    alone = _generate(_sampler(**params), alone_steps)

    # Same row, now at index 2 of a batch whose other rows use other filters, seeded or not.
    target = _sampler(**params)
    others = [
        _sampler(seed=99, top_k=3),
        _sampler(temperature=0.5, top_p=0.8, min_p=0.1),
        _sampler(temperature=0, logprobs=1),
    ]
    noise = _steps(12, 4, seed=8)
    batched = []
    samplers = [others[0], others[1], target, others[2]]
    for own, rest in zip(alone_steps, noise):
        tokens = sample(torch.cat([rest[:2], own, rest[2:3]]), samplers).token_ids
        for s, t in zip(samplers, tokens):
            s.append(t)
        batched.append(tokens[2])
    assert batched == alone


def test_different_seeds_usually_differ():
    steps = _steps(10, 1, seed=11)
    sequences = {tuple(_generate(_sampler(seed=seed), steps)) for seed in range(10)}
    assert len(sequences) >= 8


def test_unseeded_draws_vary():
    logits = torch.zeros(1, V)
    assert len({sample(logits, [_sampler()]).token_ids[0] for _ in range(50)}) > 1


# ---- min_tokens ---------------------------------------------------------------------------------

EOS = 5


def test_min_tokens_blocks_eos_until_reached():
    logits = torch.zeros(1, V)
    logits[0, EOS] = 10.0
    logits[0, 7] = 1.0
    s = _sampler(temperature=0, min_tokens=2)
    picks = []
    for _ in range(3):
        picks.append(sample(logits, [s], eos_token_ids=[EOS]).token_ids[0])
        s.append(picks[-1])
    assert picks == [7, 7, EOS]


def test_min_tokens_blocks_stop_token_ids_when_sampling():
    logits = torch.zeros(1, V)
    logits[0, [EOS, 9]] = 30.0  # almost all the mass
    s = _sampler(seed=0, min_tokens=1, stop_token_ids=[9])
    token = sample(logits, [s], eos_token_ids=[EOS]).token_ids[0]
    assert token not in (EOS, 9)
    s.append(token)
    assert sample(logits, [s], eos_token_ids=[EOS]).token_ids[0] in (EOS, 9)


# ---- mixed batch --------------------------------------------------------------------------------


def test_mixed_batch():
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(21))
    prompt = [int(logits[1].argmax())]
    samplers = [
        _sampler(temperature=0),
        _sampler(prompt, temperature=0, repetition_penalty=10.0),
        _sampler(temperature=0.9, seed=42, logprobs=2),
        _sampler(temperature=0.8, top_k=1),
        _sampler(temperature=0, min_tokens=1),
    ]
    eos = int(logits[4].argmax())
    result = sample(logits, samplers, eos_token_ids=[eos])
    argmax = logits.argmax(-1).tolist()
    assert result.token_ids[0] == argmax[0]
    assert result.token_ids[1] != argmax[1]  # the prompt's token is penalised away
    alone = sample(logits[2:3], [_sampler(temperature=0.9, seed=42, logprobs=2)])
    assert result.token_ids[2] == alone.token_ids[0]
    assert result.logprobs[2] == alone.logprobs[0]
    assert result.token_ids[3] == argmax[3]
    assert result.token_ids[4] != eos
    assert [lp is None for lp in result.logprobs] == [True, True, False, True, True]


def test_extreme_repetition_penalty_stays_finite():
    """A penalty near zero multiplies positive logits past float32's range; sampling must still
    return a valid token instead of failing the whole step on NaN probabilities."""
    logits = torch.tensor([[3.0, 1.0, -2.0, 0.5]])
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, repetition_penalty=1e-40, seed=0)
        s = SequenceSampler(params, [0, 1], vocab_size=4)
        out = sample(logits.clone(), [s])
        assert out.token_ids[0] in (0, 1)  # the penalised-up tokens dominate, as the formula says


@pytest.mark.parametrize("params", [dict(top_p=1e-50), dict(top_k=2**63), dict(top_k=2**40, top_p=1e-50)])
def test_extreme_filters_keep_the_top_token(params):
    """Values far outside float32 or the vocabulary still sample the most likely token."""
    logits = torch.tensor([[0.5, 4.0, 1.0, -1.0]])
    s = SequenceSampler(SamplingParams(temperature=1.0, seed=1, **params), [], vocab_size=4)
    assert sample(logits.clone(), [s]).token_ids == [1]


# ---- the draw -----------------------------------------------------------------------------------

# A distribution sorted high to low, so top_k keeps a prefix; the last token can never be drawn.
_P = torch.tensor([0.3, 0.2, 0.15, 0.12, 0.1, 0.08, 0.05, 0.0], dtype=torch.float64)
# Chi-square at p = 0.001 by degrees of freedom: the seed is fixed, so this is a bound, not a flake.
_CHI2_CRITICAL = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46}


def _expected(params: dict) -> torch.Tensor:
    """What `params` ask for over _P, in float64 and from their definitions (vLLM's order):
    temperature, then min_p relative to the best token, top_k, and top_p relative to the
    survivors of both."""
    p = _P ** (1 / params.get("temperature", 1.0))
    p = p / p.sum()
    if "min_p" in params:
        p[p < params["min_p"] * p.max()] = 0
    if params.get("top_k", 0) > 0:
        p[params["top_k"]:] = 0
    if "top_p" in params:
        p[(p.cumsum(0) - p) >= params["top_p"] * p.sum()] = 0
    return p / p.sum()


@pytest.mark.parametrize("cases", [
    # Every row has a top_k: the batch ranks only its best max(k) tokens.
    [{"top_k": 4}, {"top_k": 2, "temperature": 2.0}, {"top_k": 5, "top_p": 0.6}, {"top_k": 6, "min_p": 0.45}],
    # Some row has none: the batch sorts the whole vocabulary.
    [{}, {"top_p": 0.6}, {"min_p": 0.45, "temperature": 0.7}, {"top_k": 3}, {"min_p": 0.3, "top_p": 0.7}],
    # No top_k or top_p: the batch draws over the vocabulary in order.
    [{}, {"min_p": 0.45}, {"temperature": 0.5}],
], ids=["top_k", "sorted", "vocabulary"])
def test_unseeded_rows_draw_from_their_filtered_distribution(cases):
    """One call, rows of several filters interleaved, all drawing together from the global
    generator: each row's tokens follow its own distribution, and no filtered token appears."""
    draws = 4000
    torch.manual_seed(0)
    samplers = [_sampler(vocab=len(_P), **cases[r % len(cases)]) for r in range(draws * len(cases))]
    logits = _P.float().log().expand(len(samplers), -1)
    tokens = torch.tensor(sample(logits, samplers).token_ids).view(draws, len(cases))
    for c, params in enumerate(cases):
        expected = _expected(params)
        counts = torch.bincount(tokens[:, c], minlength=len(_P)).double()
        kept = expected > 0
        assert counts[~kept].sum() == 0, (params, counts.tolist())
        chi2 = ((counts[kept] - draws * expected[kept]) ** 2 / (draws * expected[kept])).sum().item()
        assert chi2 < _CHI2_CRITICAL[int(kept.sum()) - 1], (params, counts.tolist(), expected.tolist())


@pytest.mark.parametrize("params", [{}, {"top_k": 3}, {"top_p": 0.5}, {"seed": 1}, {"seed": 2, "top_k": 2}])
def test_a_token_alone_with_probability_is_always_drawn(params):
    """Row 0 leaves one token finite; row 1 gives the others logits whose softmax underflows to 0."""
    logits = torch.full((2, V), float("-inf"))
    logits[0, 9] = 0.0
    logits[1] = -200.0
    logits[1, 9] = 0.0
    for _ in range(20):
        assert sample(logits, [_sampler(**params), _sampler(**params)]).token_ids == [9, 9]


def test_a_zero_probability_never_wins_even_against_zero_noise():
    probs = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.0, 0.0, 0.0, 1e-30]])
    noise = torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 50.0]])
    assert draw.race(probs, None, noise).tolist() == [1, 3]


def test_failed_rows_do_not_disturb_the_draws_of_the_others():
    logits = torch.log(torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]])).expand(4, -1).clone()
    logits[0] = float("nan")
    logits[2] = float("-inf")
    samplers = [_sampler(vocab=8, top_k=3), _sampler(vocab=8, top_k=2), _sampler(vocab=8, top_k=3, seed=4),
                _sampler(vocab=8, top_k=2, seed=5, logprobs=1)]
    result = sample(logits, samplers)
    assert result.token_ids == [-1, 4, -1, 4]
    assert sorted(result.failed) == [0, 2] and not any(f.by_request for f in result.failed.values())
    assert result.logprobs == [None, None, None, {4: 0.0}]


@pytest.mark.parametrize("params", [
    {"top_k": 5},  # the batch ranks 40 tokens, the row keeps its 5
    {"top_k": 12, "top_p": 0.8, "temperature": 1.4},
    {"min_p": 0.02, "presence_penalty": 0.4, "logprobs": 2},  # the batch sorts, the row draws over all
])
def test_seeded_rows_draw_alike_alone_and_in_any_batch(params):
    params = {**params, "seed": 77}
    steps = _steps(10, 1, seed=3)
    alone = _generate(_sampler(**params), steps)
    for others in (
        [_sampler(top_k=40), _sampler(top_k=20, seed=1), _sampler(top_k=1)],
        [_sampler(top_p=0.5), _sampler(temperature=0), _sampler(seed=2, logprobs=3, repetition_penalty=1.2)],
    ):
        target = _sampler(**params)
        samplers = [others[0], target, *others[1:]]
        batched = []
        for own, rest in zip(steps, _steps(10, len(others), seed=4)):
            tokens = sample(torch.cat([rest[:1], own, rest[1:]]), samplers).token_ids
            for s, t in zip(samplers, tokens):
                s.append(t)
            batched.append(tokens[1])
        assert batched == alone


# ---- one transfer per step ----------------------------------------------------------------------


def _mixed_batch(device: str = "cpu") -> list[SequenceSampler]:
    """Greedy, sampled, seeded, logprobs, penalties and min_tokens rows in one batch."""
    samplers = [
        _sampler(temperature=0, device=device),
        _sampler(temperature=0.8, top_p=0.9, device=device),
        _sampler(temperature=1.2, top_k=7, seed=5, device=device),
        _sampler(temperature=0, logprobs=3, device=device),
        _sampler([3, 4], min_p=0.05, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2,
                 logprobs=0, seed=6, device=device),
        _sampler(temperature=0.7, min_tokens=2, stop_token_ids=[8], device=device),
    ]
    for token in (3, 11, 11):
        samplers[4].append(token)
    return samplers


def _transfers(monkeypatch) -> list[int]:
    """The calls of sampling's one device-to-host transfer (each: how many tensors it moved).
    Any other read of a tensor's values by the host fails the test."""
    calls, inside = [], [False]

    def counted(*tensors):
        calls.append(len(tensors))
        inside[0] = True
        try:
            return real(*tensors)
        finally:
            inside[0] = False

    def guarded(name):
        method = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            assert inside[0], f"Tensor.{name} read a tensor outside sampling._to_host"
            return method(self, *args, **kwargs)

        return read

    real = sampling._to_host
    for name in ("tolist", "item", "__bool__", "__int__", "__float__", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, guarded(name))
    monkeypatch.setattr(sampling, "_to_host", counted)
    return calls


@pytest.mark.parametrize("batch", ["greedy", "mixed", "mixed with a grammar", "all sampled"])
def test_a_step_moves_its_results_to_the_host_once(monkeypatch, batch):
    if batch == "greedy":
        samplers = [_sampler(temperature=0) for _ in range(3)]
    elif batch == "all sampled":
        samplers = [_sampler(top_k=50, top_p=0.9), _sampler(top_k=20, seed=3, logprobs=2)]
    else:
        samplers = _mixed_batch()
    allowed = None
    if batch == "mixed with a grammar":
        allowed = TokenBitmask([1, 4], np.array([[-1, 0], [0x7FFF0000, 0]], dtype=np.int32))
    logits = torch.randn(len(samplers), V, generator=torch.Generator().manual_seed(5))
    calls = _transfers(monkeypatch)
    result = sample(logits, samplers, eos_token_ids=[EOS], allowed=allowed)
    # One call: the chosen ids alone, or with the logprob rows' chosen logprob, top ids and values,
    # and the chosen token's rank.
    assert calls == ([1] if batch == "greedy" else [5])
    assert -1 not in result.token_ids and not result.failed
    if batch.startswith("mixed"):
        assert result.token_ids[5] not in (EOS, 8)  # min_tokens
        assert [lp is not None for lp in result.logprobs] == [False, False, False, True, True, False]
    if allowed is not None:
        assert result.token_ids[1] < 32 and 16 <= result.token_ids[4] < 31


@pytest.mark.gpu
@pytest.mark.parametrize("batch", ["greedy", "mixed"])
def test_a_cuda_step_synchronises_once(batch):
    """CUDA's sync debug mode warns at every operation that makes the host wait for the device:
    the step's one transfer is the only one."""
    if batch == "greedy":
        samplers = [_sampler(temperature=0, device="cuda") for _ in range(3)]
    else:
        samplers = _mixed_batch("cuda")
    logits = torch.randn(len(samplers), V, generator=torch.Generator().manual_seed(5)).cuda()
    expected = sample(logits, samplers, eos_token_ids=[EOS])  # warm: pinned buffers, generators, kernels
    for s in samplers:
        if s.generator is not None:
            s.generator.manual_seed(s.params.seed)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = sample(logits, samplers, eos_token_ids=[EOS])
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "called a synchronizing CUDA operation" in str(w.message)]
    assert len(syncs) == 1, syncs
    fixed = [i for i, s in enumerate(samplers) if s.generator is not None or s.params.greedy]
    assert [result.token_ids[i] for i in fixed] == [expected.token_ids[i] for i in fixed]


@pytest.mark.parametrize("u", [0.0, 0.5, 1.0 - 2**-24])  # the lowest, a middle and the highest uniform
def test_inverse_cdf_never_lands_on_a_zero_probability_token(monkeypatch, u):
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0], [0.0, 0.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0, 0.0],
                          [0.0, 1e-30, 0.0, 0.0, 0.0]])
    monkeypatch.setattr(torch, "rand_like", lambda t: torch.full_like(t, u))
    picks = draw.inverse_cdf(probs, None).tolist()
    assert all(probs[row, pick] > 0 for row, pick in enumerate(picks))
    assert picks[0] == (1 if u < 0.25 else 3)
    ids = torch.tensor([[7, 3, 9, 1, 0]]).expand(4, -1)
    assert draw.inverse_cdf(probs, ids).tolist() == [ids[0, p].item() for p in picks]


def test_inverse_cdf_keeps_a_tiny_probability_after_a_large_one(monkeypatch):
    """In float32 the 1e-9 after 0.5 vanishes from the running sum and could never be drawn; the
    sums are float64, so a uniform that falls in its sliver picks it."""
    probs = torch.tensor([[0.5, 1e-9, 0.5]])
    total = probs.double().sum().item()
    monkeypatch.setattr(torch, "rand_like", lambda t: torch.full_like(t, (0.5 + 0.5e-9) / total))
    assert draw.inverse_cdf(probs, None).tolist() == [1]


# ---- generation_config.json's defaults ----


def test_generation_config_defaults_are_sampling_params_fields():
    from neuron.engine.model_config import sampling_defaults

    generation = {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.05,
                  "repetition_penalty": 1.1, "max_new_tokens": 64, "eos_token_id": [1, 2], "top_a": None}
    defaults = sampling_defaults(generation)
    assert defaults == {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.05, "repetition_penalty": 1.1,
                        "max_tokens": 64}
    assert SamplingParams(**defaults).max_tokens == 64
    assert sampling_defaults({"temperature": None}) == {}


def test_generation_config_max_new_tokens_applies_where_a_request_is_silent():
    from neuron.entrypoints.openai.api_types import ChatCompletionRequest
    from neuron.entrypoints.openai.common import sampling_params

    req = ChatCompletionRequest(messages=[])
    defaults = {"max_tokens": 5, "min_p": 0.1}
    silent = sampling_params(req, defaults, max_tokens=None, logprobs=None, renames={})
    assert (silent.max_tokens, silent.min_p) == (5, 0.1)
    asked = sampling_params(ChatCompletionRequest(messages=[], min_p=0.0), defaults, max_tokens=50, logprobs=None,
                            renames={})
    assert (asked.max_tokens, asked.min_p) == (50, 0.0)  # what a request says wins, beyond the default too
