"""The HTTP layer against a scripted engine: auth, limits, admission, lifecycle, disconnects, and
reasoning and tool-call output end to end through the openai client."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from neuron.models.default import default_model_dir
from neuron.entrypoints.openai.app import ServerConfig
from neuron.engine.tokenizer import Tokenizer
from server_harness import ERROR, LiveServer, ScriptedEngine, scripted_engine

KEY = "sekrit"
BODY_LIMIT = 4096
WEATHER = ["<think>", "\nThe user wants", " the weather.\n", "</think>", "\n\n", "<tool_call>",
           '\n{"name": "get_weather", ', '"arguments": {"city": "Paris"}}', "\n", "</tool_call>"]
SCRIPTS = {
    "weather?": WEATHER,
    "explode": ["Hello", ERROR],
    "slowly": [0.7, "late", " answer"],
    "json please": ["<tool_call>", "{oops}", "</tool_call>"],
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_dir(default_model_dir())


@pytest.fixture(scope="module")
def stub(tokenizer):
    return ScriptedEngine(tokenizer, SCRIPTS)


@pytest.fixture(scope="module")
def server(stub):
    cfg = ServerConfig(api_key=KEY, max_body_bytes=BODY_LIMIT, keepalive_s=0.2)
    with LiveServer(scripted_engine(stub, max_running=1, max_waiting=1), cfg) as s:
        yield s.wait_ready(10)


@pytest.fixture(autouse=True)
def _open_gate(stub):
    stub.gate.set()
    yield
    stub.gate.set()


def client(server, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0, timeout=30)


def auth() -> dict:
    return {"authorization": f"Bearer {KEY}"}


def chat(content: str, **kw) -> dict:
    return {"model": "stub", "messages": [{"role": "user", "content": content}], **kw}


def wait_until(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


# ---- reasoning and tool calls, end to end ----


def test_reasoning_and_tool_call(server):
    out = client(server).chat.completions.create(model="stub", messages=[{"role": "user", "content": "weather?"}],
                                                 tools=TOOLS)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.model_extra["reasoning_content"] == "\nThe user wants the weather.\n"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_streamed_reasoning_and_tool_call(server):
    chunks = list(client(server).chat.completions.create(
        model="stub", messages=[{"role": "user", "content": "weather?"}], tools=TOOLS, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    reasoning = "".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
    assert reasoning == "\nThe user wants the weather.\n"
    assert "".join(d.content or "" for d in deltas) == ""
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_without_tools_the_tags_stay_text(server):
    out = client(server).chat.completions.create(model="stub", messages=[{"role": "user", "content": "weather?"}])
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "stop" and not message.tool_calls
    assert message.content.startswith("<tool_call>") and message.model_extra["reasoning_content"]


def test_invalid_tool_json_is_content(server):
    out = client(server).chat.completions.create(model="stub", tools=TOOLS,
                                                 messages=[{"role": "user", "content": "json please"}])
    assert out.choices[0].message.content == "<tool_call>{oops}</tool_call>"
    assert out.choices[0].finish_reason == "stop" and not out.choices[0].message.tool_calls


def test_engine_error_mid_stream(server):
    stream = client(server).chat.completions.create(model="stub", stream=True,
                                                    messages=[{"role": "user", "content": "explode"}])
    with pytest.raises(openai.APIError) as e:
        for _ in stream:
            pass
    assert "rank 1 exited" in str(e.value)
    r = httpx.post(f"{server.base_url}/chat/completions", json=chat("explode"), headers=auth())
    assert r.status_code == 503 and r.json()["error"]["code"] == "generation_failed"
    assert "rank 1 exited" in r.json()["error"]["message"] and r.headers["Retry-After"]


def test_keepalive_while_waiting(server):
    with httpx.stream("POST", f"{server.base_url}/completions", headers=auth(), timeout=10,
                      json={"model": "stub", "prompt": "slowly", "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[0] == ": keep-alive"
    assert lines[-1] == "data: [DONE]"
    texts = [json.loads(line[6:])["choices"][0]["text"] for line in lines if line.startswith("data: {")]
    assert "".join(texts) == "late answer"


# ---- auth, body limit, admission ----


def test_api_key(server):
    with pytest.raises(openai.AuthenticationError):
        client(server, key="wrong").models.list()
    r = httpx.get(f"{server.base_url}/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert [m.id for m in client(server).models.list().data] == ["stub"]
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200


def test_body_limit(server):
    big = chat("x" * BODY_LIMIT)
    r = httpx.post(f"{server.base_url}/chat/completions", json=big, headers=auth())
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunked():  # no Content-Length: the limit is enforced while reading
        payload = json.dumps(big).encode()
        for i in range(0, len(payload), 1000):
            yield payload[i: i + 1000]

    r = httpx.post(f"{server.base_url}/chat/completions", content=chunked(), headers=auth())
    assert r.status_code == 413
    r = httpx.post(f"{server.base_url}/chat/completions", json=chat("small"), headers=auth())
    assert r.status_code == 200


def test_queue_full_is_503(server, stub):
    stub.gate.clear()
    results = []

    def occupy():
        results.append(httpx.post(f"{server.base_url}/chat/completions", json=chat("hi"), headers=auth(),
                                  timeout=30).status_code)

    threads = [threading.Thread(target=occupy) for _ in range(2)]
    for t in threads:
        t.start()
    wait_until(lambda: len(server.engine._streams) == 2)
    r = httpx.post(f"{server.base_url}/chat/completions", json=chat("hi"), headers=auth())
    assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded"
    assert int(r.headers["retry-after"]) >= 1
    stub.gate.set()
    for t in threads:
        t.join()
    assert results == [200, 200]


def test_client_disconnect_aborts_the_request(server, stub):
    """A client that gives up (streaming or not) before the first token frees its place."""
    stub.gate.clear()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/chat/completions", json=chat("hi"), headers=auth(), timeout=0.3)
    with httpx.stream("POST", f"{server.base_url}/chat/completions", json=chat("hi", stream=True),
                      headers=auth(), timeout=5) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")  # the role chunk; the first token never comes
        assert len(server.engine._streams) == 1
    wait_until(lambda: not server.engine._streams and not stub._active and stub._inbox.empty())


def test_context_length_from_the_engine(server):
    with pytest.raises(openai.BadRequestError) as e:
        client(server).chat.completions.create(model="stub",
                                               messages=[{"role": "user", "content": "word " * 600}])
    assert e.value.code == "context_length_exceeded" and e.value.param == "messages"


# ---- lifecycle ----


def test_health_while_loading_then_ready(tokenizer):
    release = threading.Event()
    engine = ScriptedEngine(tokenizer, SCRIPTS)

    def slow_load():
        release.wait(30)
        return engine

    with LiveServer(scripted_engine(engine, factory=slow_load)) as s:
        r = httpx.get(f"{s.url}/health")
        assert r.status_code == 503 and r.json() == {"status": "loading"}
        r = httpx.post(f"{s.base_url}/chat/completions", json=chat("hi"))
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading"
        assert "retry-after" in r.headers
        assert httpx.get(f"{s.base_url}/models").status_code == 503
        release.set()
        s.wait_ready(10)
        assert httpx.post(f"{s.base_url}/chat/completions", json=chat("hi")).status_code == 200


def test_health_after_failed_load(tokenizer):
    def broken():
        raise RuntimeError("no such checkpoint")

    with LiveServer(scripted_engine(None, factory=broken)) as s:
        wait_until(lambda: httpx.get(f"{s.url}/health").json()["status"] == "failed")
        r = httpx.get(f"{s.url}/health")
        assert r.status_code == 503 and "no such checkpoint" in r.json()["error"]
        r = httpx.post(f"{s.base_url}/completions", json={"model": "stub", "prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_failed"


# ---- the command line ----


def test_options_come_from_the_environment(monkeypatch):
    from neuron.entrypoints.cli import _parser

    monkeypatch.setenv("NEURON_TP", "2")
    monkeypatch.setenv("NEURON_API_KEY", "from-env")
    monkeypatch.setenv("NEURON_MAX_WAITING", "3")
    args = _parser().parse_args(["serve", "--tp", "4"])
    assert (args.tp, args.api_key, args.max_waiting, args.host, args.model) == (4, "from-env", 3, "127.0.0.1", None)
    monkeypatch.setenv("NEURON_PORT", "not-a-port")
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve"])


def test_cli_serves_then_stops_on_ctrl_c():
    cmd = [sys.executable, "-m", "neuron", "serve", "--port", "0", "--max-model-len", "128", "--log-level", "info"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, "NEURON_API_KEY": KEY})
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    try:
        wait_until(lambda: any("ready: serving" in line for line in lines) or proc.poll() is not None, 60)
        assert any("output is noise" in line for line in lines)
        url = re.search(r"(http://127\.0\.0\.1:\d+)/v1", next(li for li in lines if "ready: serving" in li)).group(1)
        assert httpx.get(f"{url}/health").json() == {"status": "ready"}
        out = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0).completions.create(
            model="neuron-default", prompt="Hello", max_tokens=3, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 3
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
