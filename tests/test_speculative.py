"""Speculative decoding with n-gram, suffix and draft-model proposals: output equal to decoding
without it (greedy, seeded sampling, stop strings, structured output, at tp 1 and 2, through
preemption and recovery), sampled distributions that agree, no speculation in large batches, and
the proposers and config on their own."""

from __future__ import annotations

import json
import sys

import pytest
from checkpoints import build_checkpoint, truncated_copy
from server_harness import LiveServer, ServeProcess, health, real_engine

from neuron import LLM, SamplingParams
from neuron.engine.sampling_params import GuidedDecodingParams
from neuron.engine.spec_decode import SpeculativeConfig
from neuron.engine.spec_decode.acceptance import Acceptance
from neuron.engine.spec_decode.ngram import ngram_proposal
from neuron.engine.spec_decode.suffix import CATCH_UP_VISITS, ROOT, OutputCache, SuffixIndex, propose_from_text
from neuron.errors import ConfigError

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 3}
METHODS = ("ngram", "suffix", "draft")
# Unequal prompts; repeated spans give the proposer something to find.
PROMPTS = [[5, 17, 20, 3], list(range(10, 40)), [7, 8, 9, 7, 8, 9, 7, 8], [250, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]


@pytest.fixture(scope="module")
def repetitive(tmp_path_factory):
    """A random model with narrow weights: its greedy output falls into repeated spans, which
    n-gram proposals find (about half of them are taken)."""
    return build_checkpoint(tmp_path_factory.mktemp("spec"), seed=4, vocab_size=301, initializer_range=0.02,
                            tie_word_embeddings=False)


@pytest.fixture(scope="module")
def draft(repetitive, tmp_path_factory):
    """The repetitive model's first layer alone: a draft that agrees with it often, not always."""
    return truncated_copy(repetitive, tmp_path_factory.mktemp("draft"), 1)


def _counts(llm) -> list[int]:
    """The engine's cumulative speculative counts: proposed, accepted, sequence-steps."""
    if llm.engine.spec is None:
        return [0, 0, 0]
    c = llm.engine.spec.counts
    return [c.proposed, c.accepted, c.steps]


def _spec(method: str, draft_path=None) -> dict:
    return {"ngram": SPEC, "suffix": SUFFIX,
            "draft": {"method": "draft", "model": str(draft_path), "num_speculative_tokens": 3}}[method]


def _run(path, params, spec=None, tp=1, prompts=PROMPTS, **kwargs):
    with LLM(None if path is None else str(path), tensor_parallel_size=tp, device="cpu", dtype="float32",
             speculative_config=spec, **kwargs) as llm:
        outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
        return outs, _counts(llm)


def _assert_same(a, b) -> None:
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        assert x.finish_reason == y.finish_reason
        for lx, ly in zip(x.logprobs or [], y.logprobs or []):
            assert lx.keys() == ly.keys() and max(abs(lx[t] - ly[t]) for t in lx) < 1e-4


@pytest.fixture(scope="module")
def plain_runs() -> dict:
    """Outputs without speculation by (tp, temperature, seed, penalty), each run once for the module."""
    return {}


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("temperature,seed,penalty,window", [(0.0, None, 1.0, None), (0.02, 11, 1.0, None),
                                                              (0.9, 12, 1.1, None), (0.0, None, 1.3, 4)])
def test_output_equals_decoding_without_speculation(repetitive, draft, plain_runs, method, tp, temperature, seed,
                                                   penalty, window):
    """Greedy, and seeded sampling (with a repetition penalty, which counts the tokens kept before
    each position, over the whole context or a window): the same tokens and logprobs with and
    without speculation, for each proposer."""
    params = SamplingParams(temperature=temperature, seed=seed, max_tokens=40, logprobs=2, ignore_eos=True,
                            repetition_penalty=penalty, repetition_window=window)
    key = (tp, temperature, seed, penalty, window)  # the three proposers compare with one run without speculation
    if key not in plain_runs:
        plain_runs[key] = _run(repetitive, params, tp=tp)[0]
    plain = plain_runs[key]
    spec, (proposed, accepted, drafts) = _run(repetitive, params, _spec(method, draft), tp=tp)
    assert proposed > 0 and drafts > 0 and accepted <= proposed
    if penalty == 1.0:
        assert accepted > 0  # some proposals were kept: the accepting path ran
    _assert_same(spec, plain)


@pytest.mark.parametrize("method", METHODS)
def test_stop_strings_and_structured_output_cut_inside_an_accepted_run(method):
    """The default model (a tokenizer; its own draft, so every proposal is kept): a stop string
    met mid-run ends the output where it ends without speculation, and JSON output stays inside
    its schema."""
    from neuron.utils.default_checkpoint import default_model_dir

    spec = _spec(method, default_model_dir())
    stop = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    texts, _ = _run(None, stop, prompts=[[5, 6, 7, 5, 6, 7]])
    word = texts[0].text[len(texts[0].text) // 2:][:3]
    cut = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True, stop=[word])
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    guided = SamplingParams(temperature=0.0, max_tokens=40, guided_decoding=GuidedDecodingParams(json=schema))
    results = {}
    for name, params in (("stop", cut), ("json", guided)):
        plain, _ = _run(None, params, prompts=[[5, 6, 7, 5, 6, 7], [9, 9, 9]])
        got, counts = _run(None, params, spec, prompts=[[5, 6, 7, 5, 6, 7], [9, 9, 9]])
        assert counts[0] > 0
        if method == "draft":
            # the target drafting for itself: every proposal is kept, but for those cut by the stop
            # string (the end of a run) or past the grammar (none: proposals are checked against it)
            assert counts[1] == counts[0] if name == "json" else counts[0] - counts[1] <= 2 * 3
        _assert_same(got, plain)
        assert [o.text for o in got] == [o.text for o in plain]
        results[name] = got
    assert results["stop"][0].finish_reason == "stop" and word not in results["stop"][0].text
    assert all(o.text.startswith('{"a":"') for o in results["json"])


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_sampled_distributions_agree(repetitive, draft, method):
    """Unseeded sampling: the second token's distribution (the first a proposal can change), over
    many draws with and without speculation, passes a chi-square test of equality."""
    prompt = list(range(301))  # every token appears: an n-gram proposal always exists
    params = SamplingParams(temperature=1.0, top_k=4, max_tokens=2, ignore_eos=True)
    spec = dict(_spec(method, draft), disable_by_batch_size=64)
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


def test_a_costly_proposer_proposes_what_pays():
    """A draft whose token costs a quarter of a target step: 3 tokens at 82 % acceptance, 1 at 30 %,
    none (but a retry now and then) at 10 %, where no proposal beats a plain step."""
    a = Acceptance()
    for rate, k in ((0.82, 3), (0.3, 1)):
        a.rate = rate
        assert a.length(3, cost=0.25) == k
    a.rate = 0.1
    lengths = [a.length(3, cost=0.25) for _ in range(16)]
    assert lengths.count(0) == 14 and lengths.count(1) == 2


@pytest.mark.parametrize("value,message", [
    ('{"method": "eagle"}', "method 'eagle' is not available"),
    ('{"num_speculative_tokens": 0}', "1..16"),
    ('{"prompt_lookup_min": 3, "prompt_lookup_max": 2}', "prompt_lookup_min <= prompt_lookup_max"),
    ('{"k": 3}', "unknown key"),
    ("[1]", "JSON object"),
    ('{"method": "draft"}', "method draft needs model"),
    ('{"method": "ngram", "model": "x"}', "for method draft, not 'ngram'"),
    ('{"method": "draft", "model": "x", "draft_tensor_parallel_size": 2}', "draft_tensor_parallel_size must be 1"),
    ('{"method": "suffix", "suffix_decoding_min_token_prob": 1.5}', "min_token_prob must be in"),
    ('{"method": "suffix", "suffix_decoding_max_tree_depth": "deep"}', "must be an integer"),
    ('{"num_speculative_tokens": 2.5}', "must be an integer"),
    ('{"method": "suffix", "suffix_decoding_max_cache_bytes": 0}', "max_cache_bytes must be at least 1"),
    ('{"method": "suffix", "suffix_decoding_max_cache_bytes": "lots"}', "byte count such as"),
    ('{"method": "suffix", "suffix_decoding_max_cache_bytes": true}', "must be an integer"),
])
def test_bad_configs_are_refused(value, message):
    with pytest.raises(ConfigError, match=message):
        SpeculativeConfig.parse(value)


def test_models_with_recurrent_state_are_refused(tmp_path):
    config = {"model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"], "vocab_size": 64,
              "max_position_embeddings": 512, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "linear_num_key_heads": 2,
              "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16}
    (tmp_path / "config.json").write_text(json.dumps(config))
    from neuron.engine.engine_config import EngineConfig
    from neuron.engine.llm_engine import LLMEngine

    with pytest.raises(ConfigError, match="recurrent layers' state cannot be rolled back"):
        LLMEngine(EngineConfig(model=str(tmp_path), device="cpu", speculative_config=SPEC))


def test_vllm_spellings_are_taken():
    assert SpeculativeConfig.parse({"method": "draft_model", "model": "m"}).method == "draft"
    cfg = SpeculativeConfig.parse('{"method": "suffix", "suffix_decoding_max_spec_factor": 2}')
    assert cfg.suffix_decoding_max_spec_factor == 2.0 and isinstance(cfg.suffix_decoding_max_spec_factor, float)
    assert cfg.suffix_decoding_max_cache_bytes == 64 * 2**20  # the default
    cfg = SpeculativeConfig.parse('{"method": "suffix", "suffix_decoding_max_cache_bytes": "16MiB"}')
    assert cfg.suffix_decoding_max_cache_bytes == 16 * 2**20


def test_suffix_index_proposes_the_most_frequent_likely_continuation():
    index = SuffixIndex(depth=8)
    text = [1, 2, 3, 4, 9, 1, 2, 3, 4, 9, 1, 2, 3, 5, 1, 2, 3]
    index.add(text)
    # after 1 2 3, 4 followed twice and 5 once: 4 (prob 2/3), then 9 (2/3 along the path)
    assert index.propose(text, 4, 0.1, 2.0) == ([4, 9, 1, 2], pytest.approx(4 * 2 / 3))
    assert index.propose(text, 4, 0.7, 2.0) == ([], 0.0)  # 2/3 is below min_prob 0.7
    assert index.propose(text, 4, 0.1, 1.0)[0] == [4, 9, 1]  # 3 tokens matched earn 3 at 1 per token
    assert index.propose(text, 4, 0.1, 0.5)[0] == [4, 9]
    assert index.propose([7, 7], 3, 0.1, 1.0) == ([], 0.0)  # 7 never occurred
    assert SuffixIndex(depth=8).propose([1, 2], 3, 0.1, 1.0) == ([], 0.0)


@pytest.mark.parametrize("seed", range(20))
def test_searching_a_text_proposes_what_its_index_would(seed):
    """A request's own tokens are searched where they lie; the proposal is the one a trie of them
    makes (periodic and random texts over small vocabularies, so spans recur)."""
    import random

    rng = random.Random(seed)
    vocab, n = rng.choice([2, 3, 5]), rng.randrange(2, 80)
    text = [rng.randrange(vocab) for _ in range(n)] if seed % 2 else [i % vocab for i in range(n)]
    index = SuffixIndex(depth=10)
    index.add(text)
    for k, min_prob, factor in ((4, 0.1, 1.0), (6, 0.3, 2.0), (1, 0.0, 0.5)):
        got, expected = propose_from_text(text, k, 10, min_prob, factor)
        want, want_expected = index.propose(text, k, min_prob, factor)
        assert got == want and expected == pytest.approx(want_expected)


def test_the_shared_index_forgets_the_oldest_outputs():
    cache = OutputCache(depth=6, max_texts=2)
    cache.add([1, 2, 3, 4])
    assert cache.index.propose([8, 1, 2], 2, 0.1, 1.0)[0] == [3, 4]
    cache.add([5, 6, 7])
    cache.add([5, 6, 8])  # the first output leaves
    assert cache.index.propose([8, 1, 2], 2, 0.1, 1.0)[0] == []
    assert cache.index.propose([5, 6], 1, 0.1, 1.0)[0] in ([7], [8])
    assert cache.index.find(ROOT, 1) < 0  # its nodes are gone, not left at count 0


@pytest.mark.parametrize("vocab", [3, 40, 5000])
def test_a_forgetting_index_proposes_what_a_fresh_one_of_its_texts_would(vocab):
    """Texts forgotten (the oldest, past max_texts) leave nothing behind: the index holds the nodes
    and makes the proposals of an index built from the texts kept alone (vocabularies small enough
    for spans to recur, and large enough for nodes with many children)."""
    import random

    rng = random.Random(vocab)
    cache = OutputCache(depth=8, max_texts=3)
    for _ in range(10):
        cache.add([rng.randrange(vocab) for _ in range(rng.randrange(1, 300))])
    fresh = SuffixIndex(depth=8)
    for text in cache.texts:
        fresh.add(text)
    assert len(cache.texts) == 3 and cache.index.num_nodes == fresh.num_nodes
    for _ in range(50):
        context = [rng.randrange(vocab) for _ in range(rng.randrange(1, 12))]
        assert cache.index.propose(context, 5, 0.05, 2.0) == fresh.propose(context, 5, 0.05, 2.0)


def _outputs(n: int, length: int = 2000) -> list[list[int]]:
    """Outputs that repeat nothing (a 32,000-token vocabulary): the most nodes per token."""
    import random

    rng = random.Random(0)
    return [[rng.randrange(32000) for _ in range(length)] for _ in range(n)]


def test_a_finished_output_is_indexed_a_part_between_steps():
    """A finished output waits and is indexed at most CATCH_UP_VISITS node visits (depth a token) a
    call, so no step stalls for a long output; once done the index is the one a single add builds."""
    text = _outputs(1, 2000)[0]
    now, later = OutputCache(depth=24, max_texts=10), OutputCache(depth=24, max_texts=10)
    now.add(text)
    later.add_later(text)
    assert later.index.num_nodes == 1 and not later.texts  # nothing indexed until a catch-up
    done, calls = 0, 0
    while later.adding is not None or later.waiting:
        later.catch_up(CATCH_UP_VISITS)
        indexed = len(text) if later.adding is None else later.adding[1]
        assert 0 < indexed - done <= CATCH_UP_VISITS // 24
        done, calls = indexed, calls + 1
    assert calls == -(-len(text) // (CATCH_UP_VISITS // 24))
    assert list(later.texts[0]) == text and later.index.num_nodes == now.index.num_nodes
    assert later.index.count == now.index.count and later.index.propose(text[:40], 3, 0.1, 1.0)[0] == text[40:43]


def test_an_output_forgotten_for_room_is_forgotten_a_part_between_steps(monkeypatch):
    """A cache of one text: the next output forgets the first, both a part a call, together at most
    CATCH_UP_VISITS node visits a call; the index then holds the second alone, as if only it came."""
    first, second = _outputs(2, 2000)
    cache, alone = OutputCache(depth=24, max_texts=1), OutputCache(depth=24, max_texts=1)
    alone.add(second)
    cache.add(first)
    walked = []
    for name in ("add_part", "remove_part"):
        real = getattr(SuffixIndex, name)

        def counted(index, tokens, start, stop, ends, real=real):
            walked[-1] += stop - start
            return real(index, tokens, start, stop, ends)

        monkeypatch.setattr(SuffixIndex, name, counted)
    cache.add_later(second)
    while cache.waiting or cache.adding is not None or cache.forgetting is not None:
        walked.append(0)
        cache.catch_up(CATCH_UP_VISITS)
        assert 0 < walked[-1] <= CATCH_UP_VISITS // 24
    assert sum(walked) == 2 * 2000
    assert [list(t) for t in cache.texts] == [second] and cache.index.num_nodes == alone.index.num_nodes
    assert cache.index.propose(second[:40], 3, 0.1, 1.0)[0] == second[40:43]
    assert cache.index.propose(first[:40], 3, 0.1, 1.0)[0] == []


def test_at_most_max_texts_wait_and_the_oldest_is_dropped():
    cache = OutputCache(depth=4, max_texts=3)
    for i in range(5):
        cache.add_later([i, i + 1, i + 2])
    assert [list(t) for t in cache.waiting] == [[2, 3, 4], [3, 4, 5], [4, 5, 6]]
    assert cache.waiting_bytes == sum(map(sys.getsizeof, cache.waiting))
    cache.catch_up(None)
    assert [list(t) for t in cache.texts] == [[2, 3, 4], [3, 4, 5], [4, 5, 6]] and cache.waiting_bytes == 0


def test_the_shared_index_counts_its_bytes():
    """What the cache says it holds is what it allocated (traced by tracemalloc), within its bound
    while it forgets: a node is 16 bytes (four int32s), plus the arrays' spare room."""
    import tracemalloc

    bound, outputs = 2 * 2**20, _outputs(6)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        cache = OutputCache(depth=24, max_texts=1000, max_bytes=bound)
        for text in outputs:
            cache.add(text)
        traced = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(cache.texts) == 2  # 2,000 tokens of new spans: about 45,000 nodes each
    assert cache.nbytes <= traced <= cache.nbytes + 1024 and traced <= bound
    assert cache.nbytes / cache.index.num_nodes < 24  # where objects in dictionaries took 264


@pytest.mark.slow
def test_the_shared_index_stays_within_its_bytes():
    """100 outputs of 2,000 tokens against a 4 MiB bound: the cache never holds more, and keeps the
    newest outputs, whose continuations it proposes."""
    bound = 4 * 2**20
    cache = OutputCache(depth=24, max_texts=1000, max_bytes=bound)
    for text in _outputs(100):
        cache.add(text)
        assert cache.nbytes <= bound
    assert len(cache.texts) >= 4 and list(cache.texts[-1]) == text
    assert cache.index.propose(text[:50], 3, 0.1, 1.0)[0] == text[50:53]


def test_suffix_proposals_learn_from_earlier_outputs(repetitive):
    """A request whose output repeats an earlier request's output is proposed that output's
    continuation from the shared index; the outputs stay equal to decoding without it."""
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    prompt = [[250, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
    with LLM(str(repetitive), device="cpu", dtype="float32", speculative_config=SUFFIX) as llm:
        first = llm.generate([{"prompt_token_ids": p} for p in prompt], params)[0].outputs[0]
        before = _counts(llm)
        again = llm.generate([{"prompt_token_ids": p} for p in prompt], params)[0].outputs[0]
        second = [b - a for a, b in zip(before, _counts(llm))]
    plain, _ = _run(repetitive, params, prompts=prompt)
    assert first.token_ids == again.token_ids == plain[0].token_ids
    assert second[1] / second[0] > before[1] / before[0]  # the second run is proposed its own output


@pytest.mark.parametrize("method", METHODS)
def test_preempted_sequences_speculate_again_unchanged(repetitive, draft, method):
    """Under a KV pool too small for the batch, sequences are preempted and recomputed while they
    speculate (a draft's pool mirrors the target's blocks): outputs as without speculation."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
    block_bytes = 2 * 2 * 2 * 16 * 4 * 4  # K and V, 2 layers, 2 KV heads of 16, 4 tokens, fp32
    kwargs = dict(max_model_len=64, block_size=4, kv_cache_memory=16 * block_bytes)
    plain, _ = _run(repetitive, params, **kwargs)
    with LLM(str(repetitive), device="cpu", dtype="float32", speculative_config=_spec(method, draft), **kwargs) as llm:
        assert llm.engine.executor.num_kv_blocks == 16
        outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.spec.counts.accepted > 0
        assert llm.engine.kv_cache_usage() == 0.0
    _assert_same(outs, plain)


@pytest.mark.slow
def test_speculation_survives_recovery(repetitive, draft):
    """tp 2 with a draft: after a worker is killed and the ranks are rebuilt, the same requests
    give the same tokens as before, still speculating."""
    import os
    import signal

    from server_harness import wait_until

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    with LLM(str(repetitive), tensor_parallel_size=2, device="cpu", dtype="float32",
             speculative_config=_spec("draft", draft)) as llm:
        first = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        victim = llm.engine.executor.pool.workers[0].proc
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(timeout=30)
        wait_until(lambda: llm.engine.failure is not None, 10, "the dead rank was not noticed")
        before = llm.engine.spec.counts.proposed
        again = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert llm.engine.spec.counts.proposed > before
    assert again == first


def test_a_failing_proposer_costs_only_the_speculation(repetitive, draft, monkeypatch):
    """A draft whose step fails (a bug, memory) leaves those steps without proposals: every request
    still completes, with the tokens it would have had."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain, _ = _run(repetitive, params)
    with LLM(str(repetitive), device="cpu", dtype="float32", speculative_config=_spec("draft", draft)) as llm:
        proposer, calls = llm.engine.spec.proposer, []
        propose = proposer.propose

        def flaky(seqs, ks):
            calls.append(len(seqs))
            if len(calls) % 2:
                raise RuntimeError("draft step failed")
            return propose(seqs, ks)

        monkeypatch.setattr(proposer, "propose", flaky)
        outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]
        assert len(calls) > 2 and llm.engine.spec.counts.accepted > 0
    _assert_same(outs, plain)


def test_a_proposal_failing_for_one_sequence_costs_only_its_own(repetitive, draft, monkeypatch):
    """A proposer that fails whenever one request is among those it proposes for: the others are
    proposed for again alone and keep speculating, the failing one rests between its retries, and
    every output is as without speculation."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain, _ = _run(repetitive, params)
    with LLM(str(repetitive), device="cpu", dtype="float32", speculative_config=_spec("draft", draft)) as llm:
        spec, proposer = llm.engine.spec, llm.engine.spec.proposer
        propose, proposed_to, failed_alone = proposer.propose, set(), []

        def failing_for_the_first(seqs, ks):
            if any(seq.prompt_token_ids == PROMPTS[0] for seq in seqs):
                failed_alone.append(len(seqs) == 1)
                raise RuntimeError("draft step failed")
            made = propose(seqs, ks)
            proposed_to.update(PROMPTS.index(seq.prompt_token_ids) for seq, tokens in zip(seqs, made) if tokens)
            return made

        monkeypatch.setattr(proposer, "propose", failing_for_the_first)
        outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]
        assert proposed_to == {1, 2, 3} and spec.counts.accepted > 0
        # in the batch, then alone: at its first step, and after each rest of 8 steps
        assert failed_alone == [False, True] * 3 and spec.failures == 6
    _assert_same(outs, plain)


def test_sequences_that_share_cached_blocks_are_drafted_for(repetitive, draft, monkeypatch):
    """Two samples each of two prompts with three blocks in common: the four sequences share those
    blocks in the prefix cache, and a draft step may write a block for one sequence only. The
    draft writes them once and the others start after them: every sequence is proposed tokens,
    nothing fails, and the outputs are those without speculation."""
    params = SamplingParams(n=2, temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)
    prefix = list(range(10, 22))  # three blocks of 4
    prompts = [{"prompt_token_ids": prefix + [12, 13]}, {"prompt_token_ids": prefix + [20, 3, 5]}]

    def outputs(llm) -> list:
        return [o for r in llm.generate(prompts, params) for o in r.outputs]

    with LLM(str(repetitive), device="cpu", dtype="float32", block_size=4) as llm:
        plain = outputs(llm)
    with LLM(str(repetitive), device="cpu", dtype="float32", block_size=4,
             speculative_config=_spec("draft", draft)) as llm:
        spec, proposer = llm.engine.spec, llm.engine.spec.proposer
        propose, step = proposer.propose, proposer.executor.step
        proposed_to, fresh_offsets = set(), []

        def recording_propose(seqs, ks):
            made = propose(seqs, ks)
            proposed_to.update(id(seq) for seq, tokens in zip(seqs, made) if tokens)
            return made

        def recording_step(steps):
            fresh_offsets.extend(s.offset for s in steps if s.fresh)
            return step(steps)

        monkeypatch.setattr(proposer, "propose", recording_propose)
        monkeypatch.setattr(proposer.executor, "step", recording_step)
        outs = outputs(llm)
        assert spec.failures == 0
        assert len(proposed_to) == 4 and spec.counts.accepted > 0
        assert sorted(fresh_offsets) == [0, 12, 12, 12]  # one draft wrote the shared blocks
    _assert_same(outs, plain)


def test_a_draft_with_another_vocabulary_is_refused(repetitive, tmp_path):
    other = build_checkpoint(tmp_path / "other", vocab_size=256)
    from neuron.engine.engine_config import EngineConfig
    from neuron.engine.llm_engine import LLMEngine

    with pytest.raises(ConfigError, match="vocab_size 256, the target 301"):
        LLMEngine(EngineConfig(model=str(repetitive), device="cpu",
                               speculative_config={"method": "draft", "model": str(other)}))


def test_health_says_when_speculation_is_on_and_how():
    spec = {"method": "suffix", "num_speculative_tokens": 4}
    with LiveServer(real_engine(None, 1, speculative_config=spec)) as server:
        assert health(server.wait_ready())["speculative"] == {
            "method": "suffix", "num_speculative_tokens": 4, "disable_by_batch_size": 8,
            "suffix_decoding_max_tree_depth": 24, "suffix_decoding_max_cached_requests": 1000,
            "suffix_decoding_max_cache_bytes": 64 * 2**20,
            "suffix_decoding_max_spec_factor": 1.0, "suffix_decoding_min_token_prob": 0.1}
    # Off: no such field (tests/test_server.py pins the whole /health of a server without it).


@pytest.mark.slow
def test_the_start_up_log_says_when_speculation_is_on():
    with ServeProcess("--speculative-config", json.dumps(SPEC)) as server:
        ready = next(line for line in server.lines if "ready: serving" in line)
        assert ready.rstrip().endswith(
            f"{server.base_url} with speculative decoding (method=ngram, num_speculative_tokens=3, "
            "disable_by_batch_size=8, prompt_lookup_min=1, prompt_lookup_max=3)")
        assert health(server)["speculative"]["method"] == "ngram"
