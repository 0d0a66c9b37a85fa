"""One request can only end itself: constraints that leave no token to sample are refused at
admission, a distribution that empties at run time ends that sequence alone, and a fault in one
sequence's output processing fails it alone, while the rest of the batch goes on unchanged and the
server stays ready. On the embedded default model, tp=1, in this process."""

from __future__ import annotations

import threading

import httpx
import pytest
import torch
from server_harness import LiveServer, client, real_engine

from neuron.engine.llm_engine import RequestError
from neuron.engine.sampling import SampleFailure, SequenceSampler, sample
from neuron.engine.sampling_params import SamplingParams
from neuron.entrypoints.llm import LLM
from neuron.errors import NeuronError

VOCAB = 1408  # the default model's vocab_size
EOS = 1380  # its only EOS id
PROMPT = [1, 2, 3, 4, 5]
OTHER_PROMPT = [40, 41, 42]
BAD_PROMPT = [7, 8, 9]
COVERING = {"min_tokens": 1, "stop_token_ids": [t for t in range(VOCAB) if t != EOS]}
REFUSAL = ("min_tokens (1) blocks EOS and stop_token_ids, and together they cover all 1408 tokens of the "
           "vocabulary, so no token could be sampled: lower min_tokens to 0 or leave some ids out of stop_token_ids")
MASKED = "no token can be sampled: min_tokens (8) blocks EOS and stop_token_ids, and the model allows no other token"
NAN = "no token can be sampled: the model's logits contain NaN"
PROCESSING = "internal error while processing the output: RuntimeError: detokenizer exploded"


@pytest.fixture(scope="module")
def offline():
    with LLM(device="cpu", dtype="float32", max_num_seqs=4) as llm:
        yield llm


@pytest.fixture(scope="module")
def live():
    with LiveServer(real_engine(None, 1, max_num_seqs=4)) as server:
        yield server.wait_ready()


def _params(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 8, "ignore_eos": True, **kw})


GOOD = {"greedy": (PROMPT, _params()),
        "seeded": (OTHER_PROMPT, _params(temperature=0.8, top_p=0.9, seed=7, repetition_penalty=1.3, logprobs=2))}


def _run(engine, requests: dict) -> dict:
    """Every request's tokens and final update, stepping the engine until all have ended."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    tokens, final = {rid: [] for rid in requests}, {}
    while len(final) < len(requests):
        for u in engine.step():
            tokens[u.request_id] += u.token_ids
            if u.finished:
                final[u.request_id] = u
    return {rid: (tokens[rid], final[rid]) for rid in requests}


def _alone(engine) -> dict:
    return {rid: _run(engine, {rid: req})[rid][0] for rid, req in GOOD.items()}


def _poison_logits(engine, monkeypatch, request_id: str, after: int, fill) -> None:
    """From the step that samples `request_id`'s token number `after` on, its logits row is `fill(row)`,
    as a model that rules every token out (or overflows) would give."""
    forward = engine.executor.step

    def step(seqs):
        logits = forward(seqs).clone()
        seq = engine.outputs.sequence(request_id)
        for i, s in enumerate(seqs):
            if seq is not None and s.slot == seq.slot and len(seq.output_token_ids) >= after:
                logits[i] = fill(logits[i])
        return logits

    monkeypatch.setattr(engine.executor, "step", step)


def _only_stops_allowed(row: torch.Tensor) -> torch.Tensor:
    allowed = torch.full_like(row, float("-inf"))
    allowed[[EOS, 10, 11]] = row[[EOS, 10, 11]]
    return allowed


def _fail_processing(engine, monkeypatch, prompt: list[int], at: int, running: list) -> None:
    """`process` raises for the sequence of `prompt` on its output token number `at`, noting which
    requests were running then."""
    process = engine.outputs.process

    def faulty(seq, token, *rest):
        if seq.prompt_token_ids == prompt and len(seq.output_token_ids) == at:
            running.append(sorted(s.request_id for s in engine.scheduler.running))
            raise RuntimeError("detokenizer exploded")
        return process(seq, token, *rest)

    monkeypatch.setattr(engine.outputs, "process", faulty)


# ---- admission ----


@pytest.mark.parametrize("path, body", [
    ("/completions", {"prompt": "Hello"}),
    ("/chat/completions", {"messages": [{"role": "user", "content": "Hello"}]}),
])
def test_stops_covering_the_vocabulary_are_a_400(live, path, body):
    r = httpx.post(f"{live.base_url}{path}", json={"model": "neuron-default", **body, **COVERING}, timeout=30)
    assert r.status_code == 400
    assert r.json() == {"error": {"message": REFUSAL, "type": "invalid_request_error",
                                  "param": "stop_token_ids", "code": "invalid_request"}}


def test_stops_short_of_the_vocabulary_run(live):
    body = {"model": "neuron-default", "prompt": "Hello", "max_tokens": 3, "temperature": 0.0, "min_tokens": 1,
            "stop_token_ids": list(range(VOCAB - 1)), "logprobs": 0, "return_tokens_as_token_ids": True}
    r = httpx.post(f"{live.base_url}/completions", json=body, timeout=30)
    assert r.status_code == 200
    choice = r.json()["choices"][0]
    # The one id left is the first token; after it this model keeps choosing it over every stop id.
    assert (choice["logprobs"]["tokens"], choice["finish_reason"]) == ([f"token_id:{VOCAB - 1}"] * 3, "length")


def test_n_below_one_says_what_is_allowed(live):
    body = {"model": "neuron-default", "prompt": "Hello", "n": 0}
    r = httpx.post(f"{live.base_url}/completions", json=body, timeout=30)
    assert (r.status_code, r.json()["error"]) == (400, {
        "message": "n must be >= 1, got 0", "type": "invalid_request_error", "param": "n", "code": None})
    with pytest.raises(ValueError, match=r"^n must be >= 1, got -1$"):
        SamplingParams(n=-1)


def test_offline_api_refuses_before_queueing(offline):
    with pytest.raises(RequestError) as e:
        offline.generate([PROMPT, OTHER_PROMPT], [_params(), _params(**COVERING)])
    assert (str(e.value), e.value.code, e.value.param) == (REFUSAL, "invalid_request", "stop_token_ids")
    assert not offline.engine.has_unfinished()  # the first prompt was not queued either


# ---- the sampler ----


def test_sampler_fails_only_the_empty_rows():
    logits = torch.tensor([[0.0, 2.0, 1.0], [float("-inf")] * 3, [1.0, float("nan"), 0.0], [3.0, 1.0, 2.0]])
    samplers = [SequenceSampler(SamplingParams(temperature=t, seed=1), [], 3) for t in (0.0, 1.0, 0.0, 0.0)]
    result = sample(logits, samplers)
    assert result.token_ids == [1, -1, -1, 0]
    assert result.failed == {
        1: SampleFailure("no token can be sampled: the model gives every token a logit of -inf", False),
        2: SampleFailure(NAN, False)}
    greedy = sample(logits[[2, 3]], [samplers[2], samplers[3]])  # the argmax-only path
    assert (greedy.token_ids, greedy.failed) == ([-1, 0], {0: SampleFailure(NAN, False)})


def test_sampler_names_min_tokens_when_it_masked_everything():
    sampler = SequenceSampler(SamplingParams(temperature=0.5, min_tokens=2, stop_token_ids=[0, 1], logprobs=1), [], 3)
    result = sample(torch.tensor([[1.0, 2.0, float("-inf")]]), [sampler], eos_token_ids=[])
    assert (result.token_ids, result.logprobs) == ([-1], [None])
    assert result.failed == {0: SampleFailure(
        "no token can be sampled: min_tokens (2) blocks EOS and stop_token_ids, and the model allows no other token",
        True)}


# ---- the engine ----


@pytest.mark.parametrize("fill, params, message, kind", [
    (_only_stops_allowed, _params(min_tokens=8, stop_token_ids=[10, 11], max_tokens=12), MASKED, "invalid_request"),
    (lambda row: torch.full_like(row, float("nan")), _params(temperature=1.0, seed=3), NAN, "internal_error"),
])
def test_an_empty_distribution_ends_that_sequence_alone(offline, monkeypatch, fill, params, message, kind):
    engine = offline.engine
    alone = _alone(engine)
    _poison_logits(engine, monkeypatch, "bad", 2, fill)
    out = _run(engine, {**GOOD, "bad": (BAD_PROMPT, params)})
    tokens, final = out["bad"]
    assert (len(tokens), final.finish_reason, final.error, final.failure_kind) == (2, "error", message, kind)
    assert {rid: out[rid][0] for rid in GOOD} == alone
    assert [len(t) for t in alone.values()] == [8, 8]
    assert {out[rid][1].finish_reason for rid in GOOD} == {"length"}
    assert engine.num_running() == engine.num_waiting() == 0  # its slot and blocks came back


def test_an_output_processing_fault_ends_that_sequence_alone(offline, monkeypatch):
    engine = offline.engine
    alone = _alone(engine)
    running: list = []
    _fail_processing(engine, monkeypatch, BAD_PROMPT, 3, running)
    out = _run(engine, {**GOOD, "bad": (BAD_PROMPT, _params())})
    tokens, final = out["bad"]
    assert (len(tokens), final.finish_reason, final.error, final.failure_kind) == (
        2, "error", PROCESSING, "internal_error")
    assert running == [["bad", "greedy", "seeded"]]
    assert {rid: out[rid][0] for rid in GOOD} == alone
    monkeypatch.undo()
    assert _run(engine, {"after": (BAD_PROMPT, _params())})["after"][1].finish_reason == "length"


def test_a_failed_forward_ends_its_batch_not_the_queue(offline, monkeypatch):
    engine = offline.engine
    forward, calls = engine.executor.step, []

    def step(seqs):
        calls.append(len(seqs))
        if len(calls) == 1:
            raise RuntimeError("boom")
        return forward(seqs)

    monkeypatch.setattr(engine.executor, "step", step)
    out = _run(engine, {f"r{i}": (PROMPT, _params()) for i in range(5)})  # four places, one waits
    failed = {rid for rid, (_, u) in out.items() if u.finish_reason == "error"}
    assert failed == {"r0", "r1", "r2", "r3"} and calls[0] == 4
    assert {(out[rid][1].error, out[rid][1].failure_kind) for rid in failed} == {
        ("internal error while running the model: RuntimeError: boom", "internal_error")}
    assert (len(out["r4"][0]), out["r4"][1].finish_reason) == (8, "length")
    assert engine.failure is None


# ---- over HTTP ----


def test_a_fault_in_one_request_leaves_the_others_and_the_server(live, monkeypatch):
    engine = live.engine.engine
    api = client(live)
    good = {"model": "neuron-default", "prompt": PROMPT, "max_tokens": 256, "temperature": 0.0,
            "extra_body": {"ignore_eos": True}}
    alone = api.completions.create(**good).choices[0].text
    running: list = []
    _fail_processing(engine, monkeypatch, BAD_PROMPT, 2, running)
    stream = api.completions.create(**good, stream=True)
    text = next(iter(stream)).choices[0].text
    failed = {}

    def bad():
        r = httpx.post(f"{live.base_url}/completions", timeout=30,
                       json={"model": "neuron-default", "prompt": BAD_PROMPT, "max_tokens": 8})
        failed.update(r.json()["error"])

    thread = threading.Thread(target=bad)
    thread.start()
    text += "".join(chunk.choices[0].text for chunk in stream)
    thread.join(30)
    assert len(running) == 1 and len(running[0]) == 2  # the two were in one batch when it failed
    assert text == alone
    # The status and code follow `Update.failure_kind` once the server reports it; the text is the engine's.
    assert PROCESSING in failed["message"]
    health = httpx.get(f"{live.url}/health").json()
    assert health.pop("memory") and health == {"status": "ready", "kernels": {"paged_attention": "cpu"}}
    monkeypatch.undo()
    after = api.completions.create(model="neuron-default", prompt=BAD_PROMPT, max_tokens=8,
                                   extra_body={"ignore_eos": True})
    assert (after.choices[0].finish_reason, after.usage.completion_tokens) == ("length", 8)


def test_offline_call_with_a_failed_request_raises_and_leaves_nothing_running(offline, monkeypatch):
    """`LLM.generate` raises for the call, but first aborts the call's other prompts, so none keeps
    running unseen in the engine, and the next call runs normally."""
    running: list = []
    _fail_processing(offline.engine, monkeypatch, BAD_PROMPT, 1, running)
    prompts = [{"prompt_token_ids": p} for p in (BAD_PROMPT, PROMPT, OTHER_PROMPT)]
    with pytest.raises(NeuronError, match="generation failed: " + PROCESSING):
        offline.generate(prompts, _params(max_tokens=32))
    assert offline.engine.num_running() == offline.engine.num_waiting() == 0
    monkeypatch.undo()
    outs = offline.generate(prompts, _params())
    assert [o.outputs[0].finish_reason for o in outs] == ["length"] * 3
