"""Rank faults seen through HTTP: a live server on a real tp=2 engine, a worker killed (SIGKILL) or
frozen (SIGSTOP) while a request runs. The request ends at once with an error naming the rank (a
final SSE error event, or a 503 with Retry-After), /health reports `recovering` and then `ready`,
requests that arrive meanwhile get 503 with Retry-After, and greedy output after the recovery equals
the output before the fault. When every recovery attempt fails the server stays `failed`."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import openai
import pytest
from caches import fresh_cache
from server_harness import RAISE, LiveServer, ScriptedEngine, client, metric, real_engine, scripted_engine, wait_until

STEP_TIMEOUT_S = 3.0
MODEL = "neuron-default"
PROMPT = "The morning train"


@pytest.fixture(scope="module")
def fault_env(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("NEURON_CACHE_DIR", str(fresh_cache(tmp_path_factory.mktemp("neuron-cache"))))
    mp.setenv("NEURON_TP_STEP_TIMEOUT_S", str(STEP_TIMEOUT_S))
    mp.setenv("NEURON_COLLECTIVE_TIMEOUT_S", "30")
    mp.setenv("NEURON_PREFILL_CHUNK_TOKENS", "8")
    mp.setenv("NEURON_RECOVERY_BACKOFF_S", "0.05")
    mp.setenv("NEURON_RECOVERY_ATTEMPTS", "3")
    yield
    mp.undo()


@pytest.fixture(scope="module")
def tp2_server(fault_env):
    """A live server on a real tp=2 engine, with the greedy answer it gives before any fault."""
    engine = real_engine(None, 2, max_model_len=4096, max_num_seqs=4)
    states: list[str] = []
    engine.on_state_change(lambda state: states.append(state.value))
    with LiveServer(engine) as s:
        s.wait_ready()
        s.states = states
        s.baseline = greedy(s)
        yield s


def greedy(server) -> list[int]:
    out = client(server).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=0,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    assert out.choices[0].finish_reason == "length"
    return [int(t.removeprefix("token_id:")) for t in out.choices[0].logprobs.tokens]


def victim(server):
    """The last worker's process (rank tp-1)."""
    return server.engine.engine.executor.pool.workers[-1].proc


def health(server) -> tuple[int, str]:
    r = httpx.get(f"{server.url}/health")
    return r.status_code, r.json()["status"]


def wait_ready(server, timeout_s: float = 120) -> list[str]:
    """Poll /health until ready; the statuses seen on the way."""
    seen, deadline = [], time.monotonic() + timeout_s
    while True:
        code, status = health(server)
        if not seen or seen[-1] != status:
            seen.append(status)
        if status == "ready":
            assert code == 200
            return seen
        assert code == 503, (code, status)
        assert status == "recovering", f"expected recovering, got {status}"
        assert time.monotonic() < deadline, "the server did not recover in time"
        time.sleep(0.02)


def recoveries(server) -> float:
    return metric(server, "neuron_recoveries_total")


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["sigkill", "sigstop"])
def test_stream_ends_with_an_error_then_the_server_recovers(tp2_server, sig):
    proc = victim(tp2_server)
    before = recoveries(tp2_server)
    stream = client(tp2_server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me a long story."}], max_tokens=3000,
        temperature=0, stream=True, logprobs=True, extra_body={"ignore_eos": True})  # logprobs: a chunk per token
    chunks, hit_at = 0, None
    with pytest.raises(openai.APIError) as e:
        for _ in stream:
            chunks += 1
            if chunks == 5:
                os.kill(proc.pid, sig)
                hit_at = time.monotonic()
    noticed = time.monotonic() - hit_at
    assert noticed < (STEP_TIMEOUT_S + 7 if sig == signal.SIGSTOP else 10), f"the stream hung for {noticed:.1f} s"
    assert "rank 1" in e.value.message and ("timeout" if sig == signal.SIGSTOP else "exited") in e.value.message
    assert chunks < 100, "the stream ran on after the fault"

    # The state is `recovering` before the stream's error is sent, and rebuilding takes ~1 s.
    seen = wait_ready(tp2_server)
    assert seen[0] == "recovering" and seen[-1] == "ready"
    assert tp2_server.states[-2:] == ["recovering", "ready"]
    assert recoveries(tp2_server) == before + 1
    assert proc.poll() is not None, "the faulty rank was not reaped"
    assert victim(tp2_server).pid != proc.pid

    started = time.monotonic()
    assert greedy(tp2_server) == tp2_server.baseline
    assert time.monotonic() - started < 120


@pytest.mark.slow
def test_non_streaming_request_gets_a_503_naming_the_rank(tp2_server):
    proc = victim(tp2_server)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3000, "temperature": 0, "ignore_eos": True}
    result: list[httpx.Response] = []
    poster = threading.Thread(target=lambda: result.append(
        httpx.post(f"{tp2_server.base_url}/completions", json=body, timeout=60)))
    poster.start()
    wait_until(lambda: any(s.num_output_tokens >= 5 for s in tp2_server.engine.open_streams), 30,
               "the request never started generating")
    os.kill(proc.pid, signal.SIGKILL)
    poster.join(15)
    assert not poster.is_alive(), "the in-flight request hung"
    [r] = result
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert error["code"] == "generation_failed" and "rank 1" in error["message"]
    assert int(r.headers["retry-after"]) >= 1
    wait_ready(tp2_server)
    assert greedy(tp2_server) == tp2_server.baseline


@pytest.mark.slow
def test_requests_during_recovery_get_503_with_retry_after(tp2_server):
    """Hold the rebuild open to look at every endpoint while the server recovers."""
    llm = tp2_server.engine.engine
    release, entered = threading.Event(), threading.Event()
    real_restart = llm.restart

    def held_restart():
        entered.set()
        assert release.wait(60)
        real_restart()

    llm.restart = held_restart
    try:
        os.kill(victim(tp2_server).pid, signal.SIGKILL)
        assert entered.wait(10), "the engine did not start recovering"
        r = httpx.get(f"{tp2_server.url}/health")
        assert r.status_code == 503 and r.json()["status"] == "recovering" and "rank 1" in r.json()["error"]
        r = httpx.get(f"{tp2_server.base_url}/models")
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_recovering"
        assert int(r.headers["retry-after"]) >= 1
        for path, body in [("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
                           ("completions", {"model": MODEL, "prompt": "hi", "stream": True})]:
            r = httpx.post(f"{tp2_server.base_url}/{path}", json=body)
            assert r.status_code == 503 and r.json()["error"]["code"] == "model_recovering", r.text
            assert r.json()["error"]["type"] == "server_error" and int(r.headers["retry-after"]) >= 1
        # The openai client retries a 503 by itself, honouring Retry-After.
        retrying = openai.OpenAI(base_url=tp2_server.base_url, api_key="unused", max_retries=10, timeout=60)
        threading.Timer(0.3, release.set).start()
        out = retrying.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 3
    finally:
        release.set()
        del llm.restart
    wait_ready(tp2_server)
    assert [m.id for m in client(tp2_server).models.list().data] == [MODEL]
    assert greedy(tp2_server) == tp2_server.baseline


@pytest.mark.slow
def test_failed_recovery_leaves_the_server_failed(fault_env):
    """Every rebuild fails: after NEURON_RECOVERY_ATTEMPTS tries the server reports `failed` for good
    (readiness stays 503, no restart loop) and refuses requests without Retry-After."""
    with LiveServer(real_engine(None, 2, max_model_len=256)) as s:
        s.wait_ready()
        llm = s.engine.engine
        attempts: list[float] = []

        def broken_restart():
            attempts.append(time.monotonic())
            raise RuntimeError("no device left")

        llm.restart = broken_restart
        os.kill(victim(s).pid, signal.SIGKILL)
        wait_until(lambda: health(s)[1] == "failed", 30, "the server never gave up")
        r = httpx.get(f"{s.url}/health")
        assert r.status_code == 503
        assert "recovery failed after 3 attempts" in r.json()["error"] and "rank 1" in r.json()["error"]
        time.sleep(1.0)
        assert len(attempts) == 3, "the server kept restarting"
        assert health(s) == (503, "failed")
        r = httpx.post(f"{s.base_url}/completions", json={"model": MODEL, "prompt": "hi"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_failed"
        assert "retry-after" not in r.headers
        assert httpx.get(f"{s.base_url}/models").status_code == 503
        assert recoveries(s) == 1


def test_a_bug_in_a_step_fails_the_requests_not_the_server(fault_env, default_tokenizer):
    """An exception on the leader's side of a step (sampling, detokenising) ends the requests in
    flight with a 500 and leaves the server ready for the next one."""
    stub = ScriptedEngine(default_tokenizer, {"crash": ["Hello", 0.2, RAISE], "slow": ["a", 0.3, "b", "c", "d"]})
    with LiveServer(scripted_engine(stub)) as s:
        s.wait_ready(10)
        results: list[httpx.Response] = []
        bystander = threading.Thread(target=lambda: results.append(httpx.post(
            f"{s.base_url}/completions", json={"model": "stub", "prompt": "slow"}, timeout=30)))
        bystander.start()
        with pytest.raises(openai.InternalServerError) as e:
            client(s).completions.create(model="stub", prompt="crash")
        assert e.value.code == "internal_error" and "RuntimeError" in e.value.message
        bystander.join(10)
        assert results[0].status_code == 500 and results[0].json()["error"]["code"] == "internal_error"
        stream = client(s).chat.completions.create(model="stub", messages=[{"role": "user", "content": "crash"}],
                                                   stream=True)
        with pytest.raises(openai.APIError) as e:
            list(stream)
        assert e.value.body["code"] == "internal_error"
        assert health(s) == (200, "ready")
        out = httpx.post(f"{s.base_url}/completions", json={"model": "stub", "prompt": "slow"})
        assert out.status_code == 200 and out.json()["choices"][0]["text"] == "abcd"
