"""What a client sends, however large or malformed, costs the server a bounded amount and ends its own
request alone: prompts bounded by length before tokenization and tokenized off the event loop,
malformed bodies and disconnects mid-upload, client text in logs, message and key checks. Against a
scripted engine served in this process."""

from __future__ import annotations

import logging
import socket
import threading
import time

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from server_harness import LiveServer, ScriptedEngine, metric, scripted_engine, wait_until
from tokenizers import Tokenizer as Backend
from tokenizers import models, normalizers, pre_tokenizers

from neuron.engine.tokenizer import Tokenizer
from neuron.entrypoints.openai.app import ServerConfig

KEY = "sekrit"
# Large enough that a prompt at the bound takes most of a second to tokenize on the default tokenizer.
MAX_MODEL_LEN = 16_000
FILLER = "hello world, this is some text 1234 "


@pytest.fixture(scope="module")
def server(default_tokenizer):
    engine = ScriptedEngine(default_tokenizer, {}, max_model_len=MAX_MODEL_LEN)
    with LiveServer(scripted_engine(engine), ServerConfig(api_key=KEY)) as s:
        yield s.wait_ready(10)


@pytest.fixture
def server_log(caplog, monkeypatch):
    monkeypatch.setattr(logging.getLogger("neuron"), "propagate", True)  # setup_logging may have cut it
    caplog.set_level(logging.INFO, logger="neuron")
    return caplog


class Spy:
    """Wraps a method: counts calls, and says when the first one started and ended."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0
        self.started, self.finished = threading.Event(), threading.Event()

    def __call__(self, *args, **kw):
        self.calls += 1
        self.started.set()
        try:
            return self.fn(*args, **kw)
        finally:
            self.finished.set()


@pytest.fixture
def encode_spy(default_tokenizer, monkeypatch) -> Spy:
    spy = Spy(default_tokenizer.encode)
    monkeypatch.setattr(default_tokenizer, "encode", spy)
    return spy


@pytest.fixture
def template_spy(default_tokenizer, monkeypatch) -> Spy:
    spy = Spy(default_tokenizer.apply_chat_template)
    monkeypatch.setattr(default_tokenizer, "apply_chat_template", spy)
    return spy


def bound(tokenizer: Tokenizer) -> int:
    """The most characters a prompt may have and still be tokenized."""
    return (MAX_MODEL_LEN - 1) * tokenizer.max_chars_per_token


def text(n: int) -> str:
    return (FILLER * (n // len(FILLER) + 1))[:n]


def post(server, path: str, body, headers: dict | None = None, **kw) -> httpx.Response:
    headers = {"authorization": f"Bearer {KEY}", **(headers or {})}
    sent = {"content": body} if isinstance(body, bytes) else {"json": body}
    return httpx.post(f"{server.base_url}{path}", headers=headers, timeout=60, **sent, **kw)


def completion(prompt) -> dict:
    return {"model": "stub", "prompt": prompt, "max_tokens": 4}


def chat(*messages: dict) -> dict:
    return {"model": "stub", "messages": list(messages)}


def user(content) -> dict:
    return {"role": "user", "content": content}


def assert_error(r: httpx.Response, status: int, code: str | None, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert (error["code"], error["type"]) == (code, "invalid_request_error")
    if param is not None:
        assert error["param"] == param
    return error


# ---- large prompts: bounded before tokenization, tokenized off the event loop ----


def test_default_tokenizer_bound(default_tokenizer):
    # its longest token, " configuration", is 14 characters; NFC may compose 4 characters into 1
    assert default_tokenizer.max_chars_per_token == 14 * 4


@settings(max_examples=50, deadline=None, derandomize=True)
@given(st.lists(st.sampled_from([" configuration", "\u0391\u0314\u0342\u0345", "e\u0301", "a", " ", "🙂", "<|im_end|>",
                                 "\u1100\u1161\u11a8"]), min_size=1, max_size=64))
def test_no_text_makes_fewer_tokens_than_the_bound(default_tokenizer, pieces):
    prompt = "".join(pieces)
    assert len(default_tokenizer.encode(prompt)) * default_tokenizer.max_chars_per_token >= len(prompt)


def _bpe(byte_fallback=False, unk=None, **parts) -> Tokenizer:
    vocab = {"<unk>": 0, "a": 1, "b": 2, "ab": 3, "▁": 4, "<0x20>": 5}
    backend = Backend(models.BPE(vocab, [("a", "b")], unk_token=unk, byte_fallback=byte_fallback, fuse_unk=True))
    for name, part in parts.items():
        setattr(backend, name, part)
    return Tokenizer(backend)


def test_no_bound_where_tokenization_can_drop_or_fuse_text():
    metaspace = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁"), normalizers.NFC()])
    assert _bpe(byte_fallback=True, normalizer=metaspace).max_chars_per_token == 6 * 4  # "<0x20>"
    assert _bpe(byte_fallback=True, normalizer=normalizers.Replace("ab", "b")).max_chars_per_token == 6 * 2
    assert _bpe(unk="<unk>").max_chars_per_token is None  # a run of unknown symbols fuses into one token
    assert _bpe().max_chars_per_token is None  # unknown symbols are skipped
    assert _bpe(byte_fallback=True, normalizer=normalizers.Strip()).max_chars_per_token is None
    assert _bpe(byte_fallback=True, normalizer=normalizers.Replace("a", "")).max_chars_per_token is None
    assert _bpe(byte_fallback=True, pre_tokenizer=pre_tokenizers.Whitespace()).max_chars_per_token is None
    assert Tokenizer(Backend(models.WordPiece({"[UNK]": 0, "a": 1}))).max_chars_per_token is None


def _health_while_tokenizing(server, spy: Spy, path: str, body: dict) -> tuple[float, bool, httpx.Response]:
    """Send `body`; once its tokenization starts, time a /health request. Returns that time, whether
    the tokenization was still running when /health answered, and the request's response."""
    answer: list[httpx.Response] = []
    sender = threading.Thread(target=lambda: answer.append(post(server, path, body)))
    sender.start()
    assert spy.started.wait(30)
    t0 = time.monotonic()
    health = httpx.get(f"{server.url}/health", timeout=5)
    took, still_running = time.monotonic() - t0, not spy.finished.is_set()
    sender.join(60)
    assert health.status_code == 200
    return took, still_running, answer[0]


@pytest.mark.parametrize("path", ["/completions", "/chat/completions"])
def test_health_answers_while_a_prompt_at_the_bound_is_tokenized(server, default_tokenizer, encode_spy, path):
    n = bound(default_tokenizer)
    body = completion(text(n)) if path == "/completions" else chat(user(text(n - 64)))  # room for the template
    took, still_running, r = _health_while_tokenizing(server, encode_spy, path, body)
    assert still_running and took < 0.5, (took, still_running)
    assert encode_spy.calls == 1
    assert_error(r, 400, "context_length_exceeded")  # by the engine, after tokenizing: far more tokens than fit


@pytest.mark.parametrize("path", ["/completions", "/chat/completions"])
def test_prompt_over_the_bound_is_refused_without_tokenizing(server, default_tokenizer, encode_spy, template_spy,
                                                             path):
    n = bound(default_tokenizer) + 1
    if path == "/completions":
        body, param = completion([text(n)]), "prompt"
    else:  # the contents of every message but the assistant's count, text parts included
        body, param = chat({"role": "system", "content": "be"}, user([{"type": "text", "text": text(n - 2)}])), "messages"
    t0 = time.monotonic()
    error = assert_error(post(server, path, body), 400, "context_length_exceeded", param)
    assert time.monotonic() - t0 < 1.0
    assert (encode_spy.calls, template_spy.calls) == (0, 0)
    assert error["message"] == (f"this model's maximum context length is {MAX_MODEL_LEN} tokens, but the prompt has "
                                f"{n} characters, which make at least {MAX_MODEL_LEN} tokens")


def test_rendered_chat_over_the_bound_is_refused_before_tokenizing(server, default_tokenizer, encode_spy,
                                                                   template_spy):
    # assistant turns do not count before the template (it may drop part of one); the rendered prompt does
    body = chat(user("hi"), {"role": "assistant", "content": text(bound(default_tokenizer))}, user("and?"))
    assert_error(post(server, "/chat/completions", body), 400, "context_length_exceeded", "messages")
    assert (template_spy.calls, encode_spy.calls) == (1, 0)


def test_token_id_prompt_over_the_context_is_refused_at_once(server):
    assert_error(post(server, "/completions", completion([1] * MAX_MODEL_LEN)), 400, "context_length_exceeded",
                 "prompt")
    assert post(server, "/completions", completion([1] * 8)).status_code == 200


# ---- malformed bodies and disconnects ----


NESTED = b"[" * 1000 + b"]" * 1000


@pytest.mark.parametrize("path,body,says", [
    ("/completions", b'{"model": "stub", "prompt": ' + NESTED + b"}", "nests"),
    ("/chat/completions", b'{"model": "stub", "messages": [{"role": "user", "content": ' + NESTED + b"}]}", "nests"),
    ("/chat/completions", b'{"model": "stub", "messages": [{"role": "user", "x": ' + b'{"a": ' * 1000 + b"1"
     + b"}" * 1000 + b"}]}", "nests"),
    ("/completions", b'{"model": "stub\xff", "prompt": "hi"}', "not valid JSON"),
    ("/chat/completions", b'{"model": "stub", "messages": [{"role": "user", "content": "caf\xc3"}]}', "not valid JSON"),
], ids=["nested-prompt", "nested-content", "nested-objects", "0xff-in-model", "truncated-utf8"])
def test_malformed_body_is_400(server, server_log, path, body, says):
    error = assert_error(post(server, path, body), 400, None)
    assert says in error["message"]
    assert not [r for r in server_log.records if r.levelno >= logging.ERROR]
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_disconnect_mid_upload_is_499_not_an_error(server, server_log):
    label = 'neuron_requests_total{endpoint="completions",status="%s"}'
    before = {s: metric(server, label % s) for s in ("499", "500")}
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
                     "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"model\": ".encode())
        time.sleep(0.1)  # the handler is reading the body when the client goes
    wait_until(lambda: metric(server, label % "499") == before["499"] + 1, message="no 499 counted")
    assert metric(server, label % "500") == before["500"]
    records = [r for r in server_log.records if r.name.startswith("neuron")]
    assert [r.levelno for r in records] == [logging.INFO], [r.getMessage() for r in records]
    assert "disconnected" in records[0].getMessage() and records[0].exc_info is None


# ---- client text in logs ----


def test_client_text_is_quoted_in_the_log(server, server_log):
    forged = "x\n12:00:00 INFO neuron.server: forged"
    r = post(server, "/completions", completion("hi") | {"model": forged})
    assert r.status_code == 404
    [record] = [r for r in server_log.records if r.name.startswith("neuron")]
    message = record.getMessage()
    assert "\n" not in message and "x\\n12:00:00 INFO" in message


# ---- messages and the API key ----


@pytest.mark.parametrize("role", ["user", "system", "developer", "tool"])
def test_null_content_is_refused_except_for_assistant_tool_calls(server, role):
    assert_error(post(server, "/chat/completions", chat({"role": role, "content": None}, user("hi"))), 400, None,
                 "messages[0].content")
    assert_error(post(server, "/chat/completions", chat(user("hi"), {"role": "assistant"}, user("and?"))), 400,
                 None, "messages[1].content")


def test_null_content_of_an_assistant_tool_call_is_accepted(server):
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    body = chat(user("hi"), {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "42"})
    assert post(server, "/chat/completions", body).status_code == 200


@pytest.mark.parametrize("header", [f"Bearer  {KEY}", f"Bearer\t{KEY}", f"Bearer {KEY} x", f"Bearer{KEY}", KEY, f"Basic {KEY}", "Bearer", ""])
def test_bearer_must_be_exact(server, header):
    r = post(server, "/completions", completion("hi"), headers={"authorization": header})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert r.headers["www-authenticate"] == "Bearer"


def test_bearer_scheme_case_is_free(server):
    for scheme in ("Bearer", "bearer", "BEARER"):
        assert post(server, "/completions", completion("hi"), headers={"authorization": f"{scheme} {KEY}"}).status_code \
            == 200
