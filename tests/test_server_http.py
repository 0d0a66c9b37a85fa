"""The HTTP layer against a scripted engine: auth, limits, admission, lifecycle, disconnects, and
reasoning and tool-call output end to end through the openai client."""

from __future__ import annotations

import json
import signal
import threading

import httpx
import openai
import pytest
from server_harness import ERROR, LiveServer, ScriptedEngine, ServeProcess, client, scripted_engine, wait_until

import neuron
from neuron.entrypoints.openai.app import ServerConfig
from neuron.errors import ConfigError

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
def stub(default_tokenizer):
    return ScriptedEngine(default_tokenizer, SCRIPTS)


@pytest.fixture(scope="module")
def stub_server(stub):
    """A live server on the scripted engine: an API key, a small body limit, one place and one queued."""
    cfg = ServerConfig(api_key=KEY, max_body_bytes=BODY_LIMIT, keepalive_s=0.2)
    with LiveServer(scripted_engine(stub, max_running=1, max_waiting=1), cfg) as s:
        yield s.wait_ready(10)


@pytest.fixture(autouse=True)
def _open_gate(stub):
    stub.gate.set()
    yield
    stub.gate.set()


def auth() -> dict:
    return {"authorization": f"Bearer {KEY}"}


def chat(content: str, **kw) -> dict:
    return {"model": "stub", "messages": [{"role": "user", "content": content}], **kw}


# ---- reasoning and tool calls, end to end ----


def test_reasoning_and_tool_call(stub_server):
    out = client(stub_server, KEY).chat.completions.create(
        model="stub", messages=[{"role": "user", "content": "weather?"}], tools=TOOLS)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.model_extra["reasoning_content"] == "\nThe user wants the weather.\n"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


DUPLICATE = TOOLS + [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("path, body, param, says", [
    ("/v1/chat/completions", chat("weather?", tools=[{"type": "function", "name": "f"}]), "tools[0]",
     'tools[0] must be {"type": "function"'),
    ("/v1/chat/completions", chat("weather?", tools=[{"type": "function", "function": {"name": "f", "parameters": 3}}],
                                  tool_choice="none"), "tools[0].function.parameters", "must be a JSON schema object"),
    ("/v1/chat/completions", chat("weather?", tools=DUPLICATE), "tools[1]", "as tools[0] is"),
    ("/tokenize", chat("weather?", tools=[{"name": "get_weather"}]), "tools[0]",
     'tools[0] must be {"type": "function"'),
    ("/tokenize", chat("weather?", tools=[{"type": "function", "function": {"name": "f", "description": 5}}]),
     "tools[0].function.description", "must be a string"),
    ("/api/chat", chat("weather?", tools=[{"function": {"parameters": {}}}]), "tools[0]", "tools[0] must be"),
    ("/v1/messages", {"model": "stub", "max_tokens": 5, "messages": [{"role": "user", "content": "weather?"}],
                      "tools": [{"name": "f", "input_schema": {}}, {"name": "f", "input_schema": {}}]},
     "tools[1]", "as tools[0] is"),
    ("/v1/responses", {"model": "stub", "input": "weather?", "tools": [{"type": "function", "name": "f"}] * 2},
     "tools[1]", "as tools[0] is"),
])
def test_a_malformed_or_repeated_tool_is_a_400_naming_it(stub_server, path, body, param, says):
    """Every route that renders tools checks them first, whoever decides on calling them."""
    r = httpx.post(stub_server.url + path, json=body, headers=auth(), timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    if path == "/api/chat":  # Ollama's errors are a message alone
        assert says in error, error
    else:
        assert says in error["message"] and error.get("param", param) == param, error


def test_streamed_reasoning_and_tool_call(stub_server):
    chunks = list(client(stub_server, KEY).chat.completions.create(
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


def test_without_tools_the_tags_stay_text(stub_server):
    out = client(stub_server, KEY).chat.completions.create(
        model="stub", messages=[{"role": "user", "content": "weather?"}])
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "stop" and not message.tool_calls
    assert message.content == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert message.model_extra["reasoning_content"] == "\nThe user wants the weather.\n"


def test_invalid_tool_json_is_content(stub_server):
    out = client(stub_server, KEY).chat.completions.create(
        model="stub", tools=TOOLS, messages=[{"role": "user", "content": "json please"}])
    assert out.choices[0].message.content == "<tool_call>{oops}</tool_call>"
    assert out.choices[0].finish_reason == "stop" and not out.choices[0].message.tool_calls


def test_engine_error_mid_stream(stub_server):
    stream = client(stub_server, KEY).chat.completions.create(
        model="stub", stream=True, messages=[{"role": "user", "content": "explode"}])
    with pytest.raises(openai.APIError) as e:
        for _ in stream:
            pass
    assert "rank 1 exited" in str(e.value)
    r = httpx.post(f"{stub_server.base_url}/chat/completions", json=chat("explode"), headers=auth())
    assert r.status_code == 503 and r.json()["error"]["code"] == "generation_failed"
    assert "rank 1 exited" in r.json()["error"]["message"] and r.headers["Retry-After"]


def test_keepalive_while_waiting(stub_server):
    with httpx.stream("POST", f"{stub_server.base_url}/completions", headers=auth(), timeout=10,
                      json={"model": "stub", "prompt": "slowly", "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[0] == ": keep-alive"
    assert lines[-1] == "data: [DONE]"
    texts = [json.loads(line[6:])["choices"][0]["text"] for line in lines if line.startswith("data: {")]
    assert "".join(texts) == "late answer"


# ---- auth, body limit, admission ----


def test_api_key(stub_server):
    with pytest.raises(openai.AuthenticationError):
        client(stub_server, "wrong").models.list()
    r = httpx.get(f"{stub_server.base_url}/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert [m.id for m in client(stub_server, KEY).models.list().data] == ["stub"]
    assert httpx.get(f"{stub_server.url}/health").status_code == 200
    assert httpx.get(f"{stub_server.url}/metrics").status_code == 200


def test_one_models_card_and_the_version(stub_server):
    """OpenAI's models.retrieve (GET /v1/models/{model}) behind the key, and vLLM's GET /version."""
    card = client(stub_server, KEY).models.retrieve("stub")
    assert (card.id, card.object, card.owned_by) == ("stub", "model", "neuron")
    with pytest.raises(openai.NotFoundError) as err:
        client(stub_server, KEY).models.retrieve("org/other")
    assert err.value.body["code"] == "model_not_found" and "`org/other` does not exist" in err.value.body["message"]
    assert httpx.get(f"{stub_server.url}/v1/models/stub").status_code == 401
    assert httpx.get(f"{stub_server.url}/version").json() == {"version": neuron.__version__}


def test_body_limit(stub_server):
    big = chat("x" * BODY_LIMIT)
    r = httpx.post(f"{stub_server.base_url}/chat/completions", json=big, headers=auth())
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunked():  # no Content-Length: the limit is enforced while reading
        payload = json.dumps(big).encode()
        for i in range(0, len(payload), 1000):
            yield payload[i: i + 1000]

    r = httpx.post(f"{stub_server.base_url}/chat/completions", content=chunked(), headers=auth())
    assert r.status_code == 413
    r = httpx.post(f"{stub_server.base_url}/chat/completions", json=chat("small"), headers=auth())
    assert r.status_code == 200


def test_queue_full_is_503(stub_server, stub):
    stub.gate.clear()
    results = []

    def occupy():
        results.append(httpx.post(f"{stub_server.base_url}/chat/completions", json=chat("hi"), headers=auth(),
                                  timeout=30).status_code)

    threads = [threading.Thread(target=occupy) for _ in range(2)]
    for t in threads:
        t.start()
    wait_until(lambda: len(stub_server.engine.open_streams) == 2)
    r = httpx.post(f"{stub_server.base_url}/chat/completions", json=chat("hi"), headers=auth())
    assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded"
    assert int(r.headers["retry-after"]) >= 1
    stub.gate.set()
    for t in threads:
        t.join()
    assert results == [200, 200]


def test_client_disconnect_aborts_the_request(stub_server, stub):
    """A client that gives up (streaming or not) before the first token frees its place."""
    stub.gate.clear()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{stub_server.base_url}/chat/completions", json=chat("hi"), headers=auth(), timeout=0.3)
    with httpx.stream("POST", f"{stub_server.base_url}/chat/completions", json=chat("hi", stream=True),
                      headers=auth(), timeout=5) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")  # the role chunk; the first token never comes
        assert len(stub_server.engine.open_streams) == 1
    wait_until(lambda: not stub_server.engine.open_streams and not stub._active and stub._inbox.empty())


def test_context_length_from_the_engine(stub_server):
    with pytest.raises(openai.BadRequestError) as e:
        client(stub_server, KEY).chat.completions.create(
            model="stub", messages=[{"role": "user", "content": "word " * 600}])
    assert e.value.code == "context_length_exceeded" and e.value.param == "messages"


# ---- lifecycle ----


def test_health_while_loading_then_ready(default_tokenizer):
    release = threading.Event()
    engine = ScriptedEngine(default_tokenizer, SCRIPTS)

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


def test_health_after_failed_load():
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
    from neuron.entrypoints.serve import configs

    monkeypatch.setenv("NEURON_TP", "2")
    monkeypatch.setenv("NEURON_API_KEY", "from-env")
    monkeypatch.setenv("NEURON_MAX_WAITING", "3")
    engine_cfg, server_cfg = configs(_parser().parse_args(["serve", "--tp", "4"]))
    assert (engine_cfg.tp, server_cfg.api_key, server_cfg.max_waiting, server_cfg.host, engine_cfg.model) == \
        (4, "from-env", 3, "127.0.0.1", None)
    monkeypatch.setenv("NEURON_PORT", "not-a-port")
    with pytest.raises(ConfigError, match="NEURON_PORT: expected an integer in 0..65535, got 'not-a-port'"):
        configs(_parser().parse_args(["serve"]))
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--port", "70000"])


@pytest.mark.slow
def test_cli_serves_then_stops_on_ctrl_c():
    with ServeProcess("--max-model-len", "128", env={"NEURON_API_KEY": KEY}) as served:
        assert any("output is noise" in line for line in served.lines)
        health = httpx.get(f"{served.url}/health").json()
        assert {k: health[k] for k in ("status", "kernels")} == {"status": "ready", "kernels": {"paged_attention": "cpu"}}
        [rank0] = health["memory"]  # one rank: its weights, KV cache and the process's resident bytes
        assert rank0["weight_bytes"] > 0 and rank0["kv_bytes"] > 0
        assert rank0["resident_bytes"] > rank0["weight_bytes"] + rank0["kv_bytes"]
        out = client(served, KEY).completions.create(model="neuron-default", prompt="Hello", max_tokens=3,
                                                     extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 3
        served.proc.send_signal(signal.SIGINT)
        assert served.proc.wait(30) == 0
