"""Security basics of `neuron serve`: it listens on 127.0.0.1 unless told otherwise, --api-key guards
every /v1 route before a body is read, bodies are capped, and no request can make the server open a
file it names (checked with an audit hook on every `open` while such requests run)."""

from __future__ import annotations

import os
import sys
import uuid

import httpx
import pytest
from caches import fresh_cache
from server_harness import LiveServer, ServeProcess, real_engine

from neuron.entrypoints.openai.app import ServerConfig

KEY = "s3cret-key"


def listening(port: int) -> list[str]:
    """Local addresses (hex, as in /proc/net/tcp*) with a listening socket on `port`."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            local, state = row.split()[1], row.split()[3]
            address, port_hex = local.split(":")
            if int(port_hex, 16) == port and state == "0A":  # TCP_LISTEN
                found.append(address)
    return found


def test_defaults_are_loopback(monkeypatch):
    from neuron.entrypoints.cli import _parser
    from neuron.entrypoints.serve import configs

    monkeypatch.delenv("NEURON_HOST", raising=False)
    assert ServerConfig().host == "127.0.0.1"
    assert configs(_parser().parse_args(["serve"]))[1].host == "127.0.0.1"


@pytest.fixture(scope="module")
def keyed_process(tmp_path_factory):
    """`neuron serve` with NEURON_API_KEY set, as a subprocess."""
    env = {"NEURON_API_KEY": KEY, "NEURON_CACHE_DIR": str(fresh_cache(tmp_path_factory.mktemp("cache")))}
    with ServeProcess("--max-model-len", "128", env=env) as served:
        yield served


@pytest.mark.slow
def test_serve_listens_on_loopback_only(keyed_process):
    port = int(keyed_process.url.rsplit(":", 1)[1])
    assert listening(port) == ["0100007F"]  # 127.0.0.1, and nothing on 0.0.0.0 or IPv6


@pytest.mark.slow
@pytest.mark.parametrize("method,path", [("GET", "/v1/models"), ("POST", "/v1/chat/completions"),
                                         ("POST", "/v1/completions")])
def test_api_key_guards_every_v1_route(keyed_process, method, path):
    url = keyed_process.url + path
    body = b"{definitely not json"
    for headers in [{}, {"authorization": "Bearer wrong"}, {"authorization": KEY}, {"authorization": f"Basic {KEY}"},
                    {"x-api-key": KEY}]:
        r = httpx.request(method, url, content=body if method == "POST" else None, headers=headers)
        assert r.status_code == 401, (headers, r.text)  # refused before the body is even parsed
        assert r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.request(method, url, content=body if method == "POST" else None,
                      headers={"authorization": f"Bearer {KEY}"})
    assert r.status_code == (200 if method == "GET" else 400)
    for open_path in ("/health", "/metrics"):  # probes and scrapers stay open
        assert httpx.get(keyed_process.url + open_path).status_code == 200


@pytest.mark.slow
def test_default_body_limit(keyed_process):
    big = b'{"model": "x", "prompt": "' + b"a" * (8 * 1024 * 1024) + b'"}'
    r = httpx.post(f"{keyed_process.base_url}/completions", content=big,
                   headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


# ---- no request opens a file it names ----

_opened: list[str] = []
_watching: list[str] = []


def _audit(event: str, args: tuple) -> None:
    if event == "open" and _watching and args and isinstance(args[0], (str, bytes)):
        name = os.fsdecode(args[0])
        if any(w in name for w in _watching):
            _opened.append(name)


@pytest.fixture(scope="module")
def real_server(tmp_path_factory):
    with LiveServer(real_engine(None, 1, max_model_len=256)) as s:
        yield s.wait_ready()


def test_no_request_opens_a_file_it_names(real_server, tmp_path):
    secret = tmp_path / f"secret-{uuid.uuid4().hex}.txt"
    secret.write_text("TOP-SECRET-CONTENT")
    sys.addaudithook(_audit)  # hooks cannot be removed; this one only looks while _watching is set
    path, url = str(secret), secret.as_uri()
    chat, comp = f"{real_server.base_url}/chat/completions", f"{real_server.base_url}/completions"

    def message(content):
        return {"model": "neuron-default", "max_tokens": 4, "messages": [{"role": "user", "content": content}]}

    requests = [
        (comp, {"model": path, "prompt": "x"}),
        (comp, {"model": "neuron-default", "prompt": path, "max_tokens": 4}),
        (comp, {"model": "neuron-default", "prompt": url, "max_tokens": 4, "suffix": path}),
        (chat, message(path)),
        (chat, message([{"type": "text", "text": path}, {"type": "image_url", "image_url": {"url": url}}])),
        (chat, message([{"type": "input_audio", "input_audio": {"data": path}}])),
        (chat, {**message("hi"), "chat_template": path, "chat_template_kwargs": {"chat_template": path,
                                                                                 "tokenizer": path}}),
        (chat, {**message("hi"), "tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"$ref": url, "type": "object"}}}]}),
        (chat, {**message("hi"), "response_format": {"type": "json_schema", "json_schema": {"$ref": url}}}),
        (chat, {**message("hi"), "stop": [path], "user": path, "documents": [path]}),
    ]
    _watching.append(secret.name)
    try:
        for target, body in requests:
            r = httpx.post(target, json=body, timeout=60)
            assert r.status_code < 500, r.text
            assert "TOP-SECRET" not in r.text
        for probe in (f"/v1/..{path}", f"/{path}", f"/v1/models/{path}", "/v1/files", f"/static{path}"):
            r = httpx.get(real_server.url + probe)
            assert r.status_code in (404, 405) and "TOP-SECRET" not in r.text
    finally:
        _watching.clear()
    assert _opened == [], f"the server opened files a client named: {_opened}"
