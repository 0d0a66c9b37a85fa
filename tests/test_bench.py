"""`neuron bench` against a fake OpenAI-compatible server that streams known tokens at known times."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import pytest
import uvicorn
from server_harness import wait_until
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from neuron.bench import BenchConfig, BenchError, RequestRecord, describe, result_summary, run_benchmark, summarize
from neuron.bench import cli as bench_cli
from neuron.bench.prompts import TOKEN_ID_RANGE, build_requests
from neuron.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Behaviour:
    first_delay: float = 0.0  # seconds before the first token
    token_delay: float = 0.0  # seconds between tokens
    tokens_per_chunk: int = 1
    send_usage: bool = True
    fail_every: int = 0  # every n-th request answers 500
    error_every: int = 0  # every n-th request sends an error event after one token
    speculates: bool = False  # /metrics counts speculative decoding: per request 2 drafts, 6 tokens, 3 kept


@dataclass
class FakeServer:
    url: str = ""
    b: Behaviour = field(default_factory=Behaviour)
    count: int = 0
    epoch: int = 0  # streams cut off in an earlier test must not change this test's counts
    in_flight: int = 0
    max_in_flight: int = 0
    arrivals: list[float] = field(default_factory=list)
    bodies: list[dict] = field(default_factory=list)
    headers: list[dict] = field(default_factory=list)

    def reset(self, **behaviour) -> None:
        self.b = Behaviour(**behaviour)
        self.epoch += 1
        self.count = self.in_flight = self.max_in_flight = 0
        self.arrivals, self.bodies, self.headers = [], [], []

    async def metrics(self, request: Request) -> PlainTextResponse:
        """Prometheus text: speculative decoding's counters (vLLM's names) when it speculates."""
        if not self.b.speculates:
            return PlainTextResponse("# no speculation\n")
        n = self.count + 100  # counted since before the run
        lines = []
        for name, per in (("drafts", 2), ("draft_tokens", 6), ("accepted_tokens", 3)):
            lines += [f"# TYPE vllm:spec_decode_num_{name} counter",
                      f'vllm:spec_decode_num_{name}_total{{model_name="fake-model"}} {per * n}']
        return PlainTextResponse("\n".join(lines) + "\n")

    async def models(self, request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def generate(self, request: Request):
        body = await request.json()
        self.count += 1
        n = self.count
        self.arrivals.append(time.perf_counter())
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        if self.b.fail_every and n % self.b.fail_every == 0:
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        chat = request.url.path.endswith("/chat/completions")
        if not body.get("stream"):
            return await self._whole(body, chat)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        return StreamingResponse(self._stream(body, chat, n, self.epoch), media_type="text/event-stream")

    async def _whole(self, body: dict, chat: bool) -> JSONResponse:
        total = body["max_tokens"]
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.b.first_delay + self.b.token_delay * (total - 1))
        finally:
            self.in_flight -= 1
        choice = {"index": 0, "message": {"content": "x " * total}} if chat else {"index": 0, "text": "x " * total}
        return JSONResponse({"choices": [choice], "usage": {"prompt_tokens": 7, "completion_tokens": total}})

    async def _stream(self, body: dict, chat: bool, n: int, epoch: int):
        total, per = body["max_tokens"], self.b.tokens_per_chunk
        try:
            await asyncio.sleep(self.b.first_delay)
            for i in range(0, total, per):
                if i:
                    await asyncio.sleep(self.b.token_delay)
                k = min(per, total - i)
                choice = {"index": 0, "delta": {"content": "x " * k}} if chat else {"index": 0, "text": "x " * k}
                yield _event({"choices": [choice]})
                if self.b.error_every and n % self.b.error_every == 0:
                    yield _event({"error": {"message": "engine failed"}})
                    return
        finally:
            self.in_flight -= epoch == self.epoch
        if self.b.send_usage:
            yield _event({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": total}})
        yield "data: [DONE]\n\n"


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


@pytest.fixture(scope="module")
def fake_openai_server():
    """An OpenAI-compatible stand-in (Uvicorn in a thread) that streams what its Behaviour says."""
    yield from _serve_fake()


@pytest.fixture(scope="module")
def second_fake_server():
    yield from _serve_fake()


def _serve_fake():
    fake = FakeServer()
    app = Starlette(routes=[Route("/v1/models", fake.models), Route("/metrics", fake.metrics),
                            Route("/v1/completions", fake.generate, methods=["POST"]),
                            Route("/v1/chat/completions", fake.generate, methods=["POST"])])
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    fake.url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_until(lambda: srv.started, 10, "fake server did not start")
    yield fake
    srv.should_exit = True
    thread.join(5)
    sock.close()


@pytest.fixture
def fake(fake_openai_server):
    """The fake server with default behaviour and empty records, for one test."""
    fake_openai_server.reset()
    return fake_openai_server


def _config(fake: FakeServer, **kw) -> BenchConfig:
    kw.setdefault("input_len", (16, 16))
    kw.setdefault("output_len", (5, 5))
    return BenchConfig(fake.url, **kw)


def _cli(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="neuron")
    bench_cli.add_parser(ap.add_subparsers())
    args = ap.parse_args(["bench", *argv])
    return args.run(args)


# ---- statistics on known data


def test_describe_exact_percentiles():
    s = describe([float(v) for v in range(1, 101)])
    assert (s.mean, s.p50) == (50.5, 50.5)
    assert s.p90 == pytest.approx(90.1) and s.p99 == pytest.approx(99.01)
    assert describe([4.0]) == describe([4.0, 4.0])
    assert describe([]).p99 is None


def test_summarize_known_records():
    ok = RequestRecord(0, 0.0, 10, ok=True, ttft_s=0.1, itl_s=[0.02, 0.04], e2e_s=0.4, output_tokens=4)
    one = RequestRecord(1, 0.0, 20, ok=True, ttft_s=0.3, itl_s=[], e2e_s=0.3, output_tokens=1)
    bad = RequestRecord(2, 0.0, 30, error="HTTP 500: boom", e2e_s=0.01)
    s = summarize([ok, one, bad, RequestRecord(3, 0.0, 5, error="HTTP 500: boom")], duration_s=2.0)
    assert (s.completed, s.failed, s.errors) == (2, 2, {"HTTP 500: boom": 2})
    assert (s.input_tokens, s.output_tokens) == (30, 5)
    assert s.request_throughput == 1.0 and s.output_throughput == 2.5 and s.total_token_throughput == 17.5
    assert s.ttft_ms.mean == pytest.approx(200.0) and s.e2e_ms.p50 == pytest.approx(350.0)
    assert s.tpot_ms.mean == pytest.approx(100.0)  # (400 - 100) / 3; a one-token output has no TPOT
    assert s.itl_ms.mean == pytest.approx(30.0) and s.itl_ms.p50 == pytest.approx(30.0)


# ---- prompts


def test_prompts_are_seeded_token_ids_or_words():
    a = build_requests(4, seed=1, input_len=(8, 12), output_len=(3, 3), token_ids=True)
    assert a == build_requests(4, seed=1, input_len=(8, 12), output_len=(3, 3), token_ids=True)
    assert a != build_requests(4, seed=2, input_len=(8, 12), output_len=(3, 3), token_ids=True)
    lo, hi = TOKEN_ID_RANGE
    assert all(8 <= len(r.prompt) == r.prompt_len <= 12 and all(lo <= t <= hi for t in r.prompt) for r in a)
    words = build_requests(2, seed=1, input_len=(6, 6), output_len=(3, 3), token_ids=False)
    assert all(isinstance(r.prompt, str) and len(r.prompt.split()) == 6 for r in words)


def test_prompts_file_cycles_and_validates(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hello there", "max_tokens": 3}\n\n{"prompt": [5, 6, 7]}\n')
    reqs = build_requests(3, seed=0, input_len=(1, 1), output_len=(9, 9), token_ids=True, prompts_file=str(f))
    assert [(r.prompt, r.prompt_len, r.max_tokens) for r in reqs] == \
        [("hello there", 2, 3), ([5, 6, 7], 3, 9), ("hello there", 2, 3)]
    f.write_text('{"text": "no prompt key"}\n')
    with pytest.raises(ConfigError, match=r"p.jsonl:1: needs \"prompt\""):
        build_requests(1, seed=0, input_len=(1, 1), output_len=(1, 1), token_ids=True, prompts_file=str(f))
    with pytest.raises(ConfigError, match="cannot read prompts file"):
        build_requests(1, seed=0, input_len=(1, 1), output_len=(1, 1), token_ids=True,
                       prompts_file=str(tmp_path / "missing.jsonl"))


def test_config_validation():
    with pytest.raises(ConfigError, match="num_requests"):
        BenchConfig("http://127.0.0.1:1/v1", num_requests=0)
    with pytest.raises(ConfigError, match="endpoint"):
        BenchConfig("http://127.0.0.1:1/v1", endpoint="embeddings")
    with pytest.raises(ConfigError, match="input_len"):
        BenchConfig("http://127.0.0.1:1/v1", input_len=(5, 2))
    with pytest.raises(SystemExit):
        _cli(["--random-input-len", "5:2"])
    with pytest.raises(SystemExit):
        _cli(["--concurrency", "2", "--request-rate", "3"])


# ---- the load generator against the fake server


async def test_streaming_timings_and_request_body(fake):
    fake.reset(first_delay=0.05, token_delay=0.02)
    result = await run_benchmark(_config(fake, num_requests=6, concurrency=3, ignore_eos=True, api_key="k"))
    s = result_summary(result)
    assert (result.model, s.completed, s.failed, s.output_tokens, s.input_tokens) == ("fake-model", 6, 0, 30, 42)
    body = fake.bodies[0]
    assert body["model"] == "fake-model" and body["max_tokens"] == 5 and body["ignore_eos"] is True
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert len(body["prompt"]) == 16 and all(isinstance(t, int) for t in body["prompt"])
    assert fake.headers[0]["authorization"] == "Bearer k"
    for r in result.records:
        assert 45 <= r.ttft_s * 1e3 < 400 and len(r.itl_s) == 4
        # a gap may be short where the client read two chunks late together (a loaded machine): the
        # median below bounds them from below
        assert all(0 <= g * 1e3 < 300 for g in r.itl_s)
        assert 125 <= r.e2e_s * 1e3 < 1000 and 15 <= r.tpot_s * 1e3 < 300
    assert 45 <= s.ttft_ms.p50 <= s.ttft_ms.p99 < 400 and 15 <= s.itl_ms.p50 < 300
    assert s.duration_s >= 2 * 0.125 and s.request_throughput == pytest.approx(6 / s.duration_s)


async def test_text_prompts_and_chat(fake):
    await run_benchmark(_config(fake, num_requests=2, text_prompts=True, model="m"))
    await run_benchmark(_config(fake, num_requests=2, endpoint="chat", model="m"))
    text, chat = fake.bodies[0], fake.bodies[2]
    assert isinstance(text["prompt"], str) and len(text["prompt"].split()) == 16
    assert chat["messages"][0]["role"] == "user" and len(chat["messages"][0]["content"].split()) == 16
    assert "prompt" not in chat and fake.count == 4


async def test_output_tokens_from_usage_else_chunks(fake):
    fake.reset(tokens_per_chunk=2)
    with_usage = await run_benchmark(_config(fake, num_requests=2, output_len=(6, 6)))
    assert [(r.output_tokens, len(r.itl_s), r.prompt_tokens) for r in with_usage.records] == [(6, 2, 7)] * 2
    fake.reset(tokens_per_chunk=2, send_usage=False)
    without = await run_benchmark(_config(fake, num_requests=2, output_len=(6, 6)))
    assert [(r.output_tokens, r.prompt_tokens) for r in without.records] == [(3, 16)] * 2


async def test_failures_are_counted_with_their_reason(fake):
    fake.reset(fail_every=3, error_every=4)
    result = await run_benchmark(_config(fake, num_requests=12, concurrency=1))
    s = result_summary(result)
    assert (s.completed, s.failed) == (6, 6)  # 500 for 3, 6, 9, 12; an error event for 4 and 8
    assert s.errors == {'HTTP 500: {"error":{"message":"boom"}}': 4, "server error: engine failed": 2}


async def test_request_timeout_fails_the_request(fake):
    fake.reset(first_delay=5.0)
    t = time.perf_counter()
    result = await run_benchmark(_config(fake, num_requests=2, timeout=0.2))
    assert time.perf_counter() - t < 2
    assert [r.error for r in result.records] == ["timed out after 0.2 s"] * 2


async def test_concurrency_limit_is_respected(fake):
    fake.reset(token_delay=0.01)
    result = await run_benchmark(_config(fake, num_requests=12, concurrency=3))
    assert result_summary(result).completed == 12 and fake.max_in_flight == 3


async def test_unlimited_rate_sends_everything_at_once(fake):
    # Each reply is held long enough for all eight to be open at once even when the first
    # connections are slow to set up on a loaded machine; one at a time would give 1.
    fake.reset(first_delay=0.5)
    await run_benchmark(_config(fake, num_requests=8))
    assert fake.max_in_flight == 8 and max(fake.arrivals) - min(fake.arrivals) < 0.4


async def test_request_rate_spreads_arrivals(fake):
    rate, n = 40.0, 20
    result = await run_benchmark(_config(fake, num_requests=n, request_rate=rate, output_len=(1, 1)))
    span = max(fake.arrivals) - min(fake.arrivals)
    expected = (n - 1) / rate  # Poisson arrivals: the span is this on average; the seed fixes the draw
    assert 0.4 * expected < span < 2 * expected and result.duration_s >= span
    starts = [r.start_s for r in result.records]
    assert starts == sorted(starts) and fake.max_in_flight < n


async def test_warmup_requests_are_not_recorded(fake):
    result = await run_benchmark(_config(fake, num_requests=3, warmup=2))
    assert fake.count == 5 and [r.index for r in result.records] == [0, 1, 2]


async def test_stop_event_ends_the_run_with_what_finished(fake):
    fake.reset(token_delay=0.2)
    stop = anyio.Event()

    async def press_stop():
        await anyio.sleep(0.5)
        stop.set()

    t = time.perf_counter()
    async with anyio.create_task_group() as tg:
        tg.start_soon(press_stop)
        result = await run_benchmark(_config(fake, num_requests=8, concurrency=2, output_len=(2, 2)), stop)
    assert time.perf_counter() - t < 1.5 and result.interrupted
    assert 2 <= len(result.records) < 8 and all(r.ok for r in result.records)
    assert 0.4 < result.duration_s < 1.0


async def test_model_discovery_failure_says_what_to_do(fake):
    with pytest.raises(BenchError, match="pass --model"):
        await run_benchmark(BenchConfig(fake.url.removesuffix("/v1") + "/nope", num_requests=1))


async def test_chat_rejects_token_id_prompts(fake, tmp_path):
    f = tmp_path / "ids.jsonl"
    f.write_text('{"prompt": [1, 2, 3]}\n')
    with pytest.raises(ConfigError, match="chat endpoint takes text"):
        await run_benchmark(_config(fake, endpoint="chat", prompts_file=str(f), input_len=(1, 1)))


# ---- the command line


def test_cli_prints_table_and_writes_json(fake, tmp_path, capsys):
    fake.reset(token_delay=0.005)
    out = tmp_path / "run.json"
    rc = _cli(["--base-url", fake.url, "-n", "5", "-c", "2", "--input-len", "8", "--random-output-len", "3:6",
               "--json-out", str(out)])
    table = capsys.readouterr().out
    assert rc == 0
    for text in ("fake-model", "Completed / failed", "5 / 0", "Request throughput (req/s)",
                 "Output token throughput (tok/s)", "TTFT", "TPOT", "ITL", "E2E", "p99"):
        assert text in table
    doc = json.loads(out.read_text())
    assert set(doc) == {"model", "interrupted", "config", "summary", "speculation", "requests"}
    assert doc["speculation"] is None and "Speculative" not in table  # the server did not speculate
    assert doc["config"]["concurrency"] == 2 and doc["config"]["request_rate"] is None
    assert "api_key" not in doc["config"]
    summary = doc["summary"]
    assert summary["completed"] == 5 and summary["failed"] == 0 and summary["errors"] == {}
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(summary[key]) == {"mean", "p50", "p90", "p99"} and summary[key]["p50"] > 0
    assert len(doc["requests"]) == 5 and doc["requests"][0]["ok"] is True
    fields = {"index", "start_s", "ttft_s", "itl_s", "e2e_s", "tpot_s", "output_tokens", "prompt_tokens", "error"}
    assert fields <= set(doc["requests"][0])
    assert sorted(r["output_tokens"] for r in doc["requests"]) == sorted(b["max_tokens"] for b in fake.bodies)


def test_speculative_decoding_is_reported_when_the_server_speculates(fake, tmp_path, capsys):
    """The server's speculative counters over the run (read from /metrics before and after)."""
    fake.reset(speculates=True)
    out = tmp_path / "run.json"
    assert _cli(["--base-url", fake.url, "-n", "4", "--input-len", "8", "--output-len", "3",
                 "--json-out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "Speculative acceptance" in table and "50.0% (12 of 24 proposed tokens)" in table
    assert "2.50 tokens per speculative step" in table  # 1 + 12 kept / 8 drafts
    spec = json.loads(out.read_text())["speculation"]
    assert spec["drafts"] == 8 and spec["acceptance_rate"] == 0.5 and spec["mean_accepted_length"] == 2.5


def test_cli_reports_failures_and_exit_code(fake, capsys):
    fake.reset(fail_every=1)
    assert _cli(["--base-url", fake.url, "--model", "m", "-n", "2", "--output-len", "2"]) == 1
    table = capsys.readouterr().out
    assert "0 / 2" in table and "HTTP 500" in table


def test_cli_unreachable_server_is_a_clear_error(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert _cli(["--base-url", f"http://127.0.0.1:{port}/v1", "-n", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"neuron bench: cannot connect to http://127.0.0.1:{port}/v1") and "--model" not in err


def test_cli_plot(fake, tmp_path, capsys):
    png = tmp_path / "lat.png"
    rc = _cli(["--base-url", fake.url, "-n", "3", "--output-len", "3", "--plot", str(png)])
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert rc == 2 and fake.count == 0 and not png.exists()
        assert "pip install matplotlib" in capsys.readouterr().err
    else:
        assert rc == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT to a child process")
def test_ctrl_c_stops_and_still_reports(fake, tmp_path):
    fake.reset(token_delay=0.1)
    out = tmp_path / "run.json"
    code = ("import argparse, sys; from neuron.bench import cli; ap = argparse.ArgumentParser(); "
            "cli.add_parser(ap.add_subparsers()); a = ap.parse_args(sys.argv[1:]); sys.exit(a.run(a))")
    argv = ["bench", "--base-url", fake.url, "-n", "50", "-c", "2", "--output-len", "3", "--json-out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", code, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    try:
        deadline = time.monotonic() + 10
        while fake.count < 4:  # two finished, two more in flight
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.01)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=10)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr
    assert "interrupted" in stdout and "interrupted" in stderr and "TTFT" in stdout
    doc = json.loads(out.read_text())
    assert doc["interrupted"] is True and 2 <= doc["summary"]["completed"] < 50
    assert not math.isnan(doc["summary"]["duration_s"])


# ---- scenarios (neuron bench --scenario)


def _scenario_file(tmp_path, a: FakeServer, b: FakeServer, saturation_limit_ms: float) -> Path:
    """The seed scenarios: one provider streaming and not, three providers (two servers, one named
    twice) at high concurrency, and a queue saturated by more users than the limit allows."""
    doc = {
        "providers": {"a": a.url, "b": b.url, "c": a.url},
        "scenarios": [
            {"name": "one-streaming", "providers": ["a"], "users": 2, "requests": 6, "output_len": 4,
             "input_len": 8, "assert": {"error_rate": 0, "p99_ttft_ms": 2000, "min_output_throughput": 1}},
            {"name": "one-not-streaming", "providers": ["b"], "users": 2, "requests": 6, "output_len": 4,
             "input_len": 8, "stream": False, "assert": {"error_rate": 0, "p99_e2e_ms": 2000}},
            {"name": "three-high-concurrency", "users": 24, "requests": 48, "output_len": [2, 6], "input_len": 8,
             "assert": {"error_rate": 0, "min_request_throughput": 1}},
            {"name": "queue-saturation", "providers": ["a"], "users": 1, "requests": 6, "output_len": 3,
             "input_len": 8, "assert": {"p99_queue_ms": saturation_limit_ms}},
        ],
    }
    path = tmp_path / "scenarios.yaml"
    path.write_text(json.dumps(doc))  # JSON is YAML too
    return path


def test_scenarios_report_pass_and_fail_per_scenario(fake, second_fake_server, tmp_path, capsys):
    """Against two servers: every scenario runs, requests spread over its providers in turn, and
    the report says PASS or FAIL per scenario and per assertion; an unmet one exits 1."""
    b = second_fake_server
    b.reset(token_delay=0.01)
    fake.reset(token_delay=0.01)
    out = tmp_path / "report.json"
    rc = _cli(["--scenario", str(_scenario_file(tmp_path, fake, b, 100_000)), "--json-out", str(out)])
    report = capsys.readouterr().out
    assert rc == 0, report
    for name in ("one-streaming", "one-not-streaming", "three-high-concurrency", "queue-saturation"):
        assert f"== {name}: PASS" in report
    assert "4 scenario(s): 4 passed, 0 failed" in report
    doc = {d["name"]: d for d in json.loads(out.read_text())}
    assert doc["one-not-streaming"]["stages_ms"]["ttft"]["p99"] is None  # no first token without streaming
    assert doc["one-streaming"]["stages_ms"]["decode"]["p50"] > 0
    assert not any(body.get("stream") for body in b.bodies[:6]) and all(body["stream"] for body in fake.bodies[:6])
    # three providers over two servers, in turn: a, b, a, a, b, a, ... -> a gets two thirds
    assert len(fake.bodies) == 6 + 32 + 6 and len(b.bodies) == 6 + 16
    assert doc["queue-saturation"]["stages_ms"]["queue"]["p99"] > 20  # one user: the others wait

    fake.reset(token_delay=0.01)
    b.reset(token_delay=0.01)
    rc = _cli(["--scenario", str(_scenario_file(tmp_path, fake, b, 1.0))])
    report = capsys.readouterr().out
    assert rc == 1
    assert "== queue-saturation: FAIL" in report and "FAIL  p99_queue_ms" in report
    assert "4 scenario(s): 3 passed, 1 failed (queue-saturation)" in report


def test_scenarios_use_the_base_urls_when_they_name_no_providers(fake, second_fake_server, tmp_path, capsys):
    second_fake_server.reset()
    path = tmp_path / "s.yaml"
    path.write_text("scenarios:\n  - name: spread\n    users: 4\n    requests: 8\n    output_len: 2\n"
                    "    input_len: 4\n    assert: {error_rate: 0}\n")
    assert _cli(["--scenario", str(path), "--base-url", fake.url, "--base-url", second_fake_server.url]) == 0
    assert "== spread: PASS" in capsys.readouterr().out
    assert len(fake.bodies) == len(second_fake_server.bodies) == 4


BILLION_LAUGHS = "l0: &l0 [lol]\n" + "".join(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]\n" for i in range(1, 10))


@pytest.mark.parametrize("text,message", [
    ("scenarios: []", "needs a list of scenarios"),
    ("scenario:\n  - {name: x}", "unknown key(s) scenario (known: providers, scenarios)"),
    ("[1, 2]", "a scenario file is a mapping with scenarios"),
    ("scenarios:\n  - {name: x, providers: [nope]}",
     "scenario 'x': providers must be a non-empty list of names under providers, got ['nope']"),
    ("scenarios:\n  - {name: x, assert: {p95_ttft_ms: 1}}", "scenario 'x': assert: 'p95_ttft_ms' is not a check"),
    ("scenarios:\n  - {name: x, assert: {error_rate: 2}}", "assert: error_rate must be a number in 0..1, got 2"),
    ("scenarios:\n  - {name: x, assert: [p99_ttft_ms]}", "scenario 'x': assert must be a mapping of checks"),
    ("scenarios:\n  - {name: x, users: many}", "scenario 'x': users must be an integer in 1..10,000, got 'many'"),
    ("scenarios:\n  - {name: x, stream: 'no'}", "scenario 'x': stream must be true or false, got 'no'"),
    ("scenarios:\n  - {name: x, input_len: [1, 2, 3]}",
     "scenario 'x': input_len must be tokens, an integer or a range"),
    ("scenarios:\n  - {name: x, 1: 2, colour: red}", "scenario 'x': unknown key(s) 1, colour (known: name,"),
    ("scenarios:\n  - [x]", "scenario 1: must be a mapping of keys"),
    ("providers: {a: 5}\nscenarios:\n  - {name: x}", "providers: 'a' must name an http:// or https:// URL, got 5"),
    # numbers past what the run could hold, refused before anything is built (it was gigabytes)
    ("scenarios:\n  - {name: x, requests: 1000000000000}",
     "scenario 'x': requests must be an integer in 1..1,000,000, got 1000000000000"),
    ('{"scenarios": [{"name": "x", "requests": 1e12}]}', "scenario 'x': requests must be an integer in 1..1,000,000"),
    ("scenarios:\n  - {name: x, users: 100000000}", "scenario 'x': users must be an integer in 1..10,000"),
    ("scenarios:\n  - {name: x, input_len: 10000000000}", "input_len must be tokens, an integer or a range [A, B] "
     "with 1 <= A <= B <= 1,048,576, got 10000000000"),
    ("scenarios:\n  - {name: x, requests: 100000, input_len: [8, 1000]}",
     "scenario 'x': requests x input_len (100,000 x 1,000 tokens) must be at most 16,777,216 prompt tokens"),
    ("scenarios:\n  - {name: x, timeout: .inf}", "scenario 'x': timeout must be a number of seconds"),
    ("scenarios:\n  - {name: x, seed: " + "9" * 5000 + "}", "not a scenario file: Exceeds the limit"),
    # malformed YAML: aliases (a billion laughs), deep nesting, too many values, bad bytes, syntax
    (BILLION_LAUGHS + "scenarios: [*l9]", "not a scenario file: aliases (*name) are not accepted at line 2"),
    ("scenarios: " + "[" * 5000 + "]" * 5000, "not a scenario file: nested deeper than 16 levels at line 1"),
    ("scenarios:\n" + "".join(" " * i + "- \n" for i in range(40)), "nested deeper than 16 levels at line 17"),
    ("scenarios: [" + "1, " * 10_001 + "1]", "not a scenario file: more than 10,000 values"),
    ("scenarios: !!python/object/apply:os.system [echo]", "could not determine a constructor"),
    ("scenarios:\n  - {name: x",
     "not a scenario file: expected ',' or '}', but got '<stream end>' at line 2, column 13"),
    ("scenarios: [\udcff]", "not a scenario file: unacceptable character"),
    ("# " + "x" * 70_000, "larger than 64 KiB"),
])
def test_bad_scenario_files_are_refused_in_one_line(fake, tmp_path, capsys, text, message):
    """Wrong types, numbers out of range and malformed YAML: exit status 2 and one line naming the
    file, the scenario and the key and what it takes, before any request is sent."""
    path = tmp_path / "bad.yaml"
    path.write_bytes(text.encode(errors="surrogateescape"))
    assert _cli(["--scenario", str(path), "--base-url", fake.url]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"neuron bench: {path}: ") and err.count("\n") == 1, err
    assert message in err and "Traceback" not in err
    assert fake.count == 0


@pytest.mark.parametrize("text", [
    "scenarios:\n  - {name: x, requests: 1000000000000}",
    "scenarios:\n  - {name: x, users: 100000000}",
    "scenarios:\n  - {name: x, input_len: 10000000000}",
    BILLION_LAUGHS + "scenarios: [*l9]",
])
def test_scenario_refusals_come_before_any_memory_is_taken(tmp_path, text):
    """What a file asks for is refused from its numbers alone: fast, and with less than a few MB
    allocated (a billion laughs would be 9^9 values, a trillion requests' prompts gigabytes)."""
    import tracemalloc

    from neuron.bench import scenario

    path = tmp_path / "big.yaml"
    path.write_text(text)
    tracemalloc.start()
    try:
        started = time.perf_counter()
        with pytest.raises(ConfigError):
            scenario.load_scenarios(path, ["http://127.0.0.1:1/v1"])
        elapsed = time.perf_counter() - started
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert elapsed < 2 and peak < 4 * 2**20


def test_bench_numbers_past_what_a_run_can_hold_are_refused(fake, capsys):
    for argv, message in ((["-n", "1000000000000"], "num_requests must be in 1..1,000,000, got 1,000,000,000,000"),
                          (["-c", "100000000"], "concurrency must be in 1..10,000"),
                          (["--input-len", "10000000000"],
                           "input_len must be a range A:B with 1 <= A <= B <= 1,048,576"),
                          (["-n", "100000", "--input-len", "1000"], "num_requests x input_len must be at most")):
        assert _cli(["--base-url", fake.url, *argv]) == 2
        assert message in capsys.readouterr().err
    assert fake.count == 0


EXAMPLE = ROOT / "docs" / "bench_scenarios.yaml"


def test_the_example_scenario_file_reads_as_documented():
    """The README's example file, through the real parser: every key it shows is taken."""
    from neuron.bench.scenario import load_scenarios

    burst, steady = load_scenarios(EXAMPLE, [])
    assert (burst.name, burst.endpoint, burst.users, burst.requests, burst.input_len, burst.output_len) == \
        ("chat-burst", "chat", 8, 64, (32, 256), (64, 64))
    assert burst.providers == ["http://127.0.0.1:8000/v1", "http://127.0.0.1:8001/v1"]
    assert (burst.stream, burst.ignore_eos, burst.seed, burst.timeout, burst.request_rate) == (True, True, 0, 120.0,
                                                                                                math.inf)
    assert burst.checks == {"p99_ttft_ms": 2000, "p50_decode_ms": 5000, "error_rate": 0, "min_output_throughput": 10}
    assert (steady.providers, steady.users, steady.request_rate, steady.output_len) == \
        (["http://127.0.0.1:8000/v1"], 4, 16.0, (16, 64))
    # it shows every key the parser takes, and so does the README
    import yaml

    from neuron.bench.scenario import _RULES

    doc = yaml.safe_load(EXAMPLE.read_text())
    assert set(doc) == {"providers", "scenarios"} and set().union(*doc["scenarios"]) == set(_RULES)
    readme = (ROOT / "README.md").read_text()
    assert all(f"`{key}`" in readme for key in _RULES) and "docs/bench_scenarios.yaml" in readme


def test_the_example_scenario_file_runs(fake, second_fake_server, tmp_path, capsys):
    """The example against two stand-in servers in place of its providers: both scenarios pass."""
    second_fake_server.reset()
    text = EXAMPLE.read_text().replace("http://127.0.0.1:8000/v1", fake.url)
    path = tmp_path / "example.yaml"
    path.write_text(text.replace("http://127.0.0.1:8001/v1", second_fake_server.url))
    assert _cli(["--scenario", str(path)]) == 0
    report = capsys.readouterr().out
    assert "== chat-burst: PASS" in report and "== steady-arrivals: PASS" in report
    assert len(fake.bodies) == 32 + 32 and len(second_fake_server.bodies) == 32
    assert all("messages" in body for body in second_fake_server.bodies)


def test_several_base_urls_need_a_scenario(fake, capsys):
    assert _cli(["--base-url", fake.url, "--base-url", fake.url, "-n", "1"]) == 2
    assert "only with --scenario" in capsys.readouterr().err
