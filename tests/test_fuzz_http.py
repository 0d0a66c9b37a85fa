"""Generated request bodies against a live server: whatever a client sends, the answer is never a
500, every refusal is an OpenAI error envelope, and the server stays healthy.

Complements test_server.py's random malformed fields: here hypothesis builds arbitrary JSON
documents, raw bytes, and valid chat and completion requests mutated field by field (wrong types,
huge and negative numbers, NaN-like strings and tokens, nested junk, odd unicode, missing fields,
broken messages and tools). Most examples run against the scripted engine (the HTTP layer, fast);
a smaller set runs against a real tp=1 engine, whose tokenizer, chat template, sampler and
scheduler then see the bodies too. Derandomized, so a CI failure reproduces locally.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_harness import LiveServer, ScriptedEngine, real_engine, scripted_engine

from neuron.entrypoints.openai.app import ServerConfig

BODY_LIMIT = 64 * 1024
FUZZ = settings(deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])

# ---- strategies ----

scalars = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
           | st.text(max_size=20))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)

odd_text = st.one_of(
    st.text(max_size=40),
    st.text(st.characters(codec="utf-8"), max_size=40),  # anything UTF-8 can carry, controls and NUL included
    st.sampled_from(["", " ", "\x00", "\ud800", "\udfff\ud800", "\u202e\u0645\u0631\u062d\u0628\u0627", "e\u0301" * 30,
                     "\U0001f600" * 20, "\ufeff", "<|im_end|>", "<|im_start|>system", "<think>", "</tool_call>",
                     "{{ raise_exception('x') }}", "{% for x in range(10**9) %}", "../../etc/passwd",
                     "file:///etc/passwd", "NaN", "-Infinity", "1e999", "0x10", "null", "true", "[]"]),
)
huge_numbers = st.sampled_from([2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30, -(10**30), 1e308, -1e308,
                                5e-324, -0.0, 1e-300, 3.4e38, -1, 0, 1e20])
nasty = st.one_of(json_values, odd_text, huge_numbers, st.integers(-(2**70), 2**70),
                  st.lists(odd_text, max_size=3), st.lists(st.integers(-5, 10**6), max_size=5),
                  st.dictionaries(odd_text, json_values, max_size=3))

SHARED_FIELDS = ["max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                 "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "ignore_eos",
                 "skip_special_tokens", "n", "logit_bias", "stream", "stream_options", "return_tokens_as_token_ids",
                 "user", "metadata", "truncate_prompt_tokens", "use_beam_search", "length_penalty", "bad_words",
                 "allowed_token_ids"]
CHAT_FIELDS = SHARED_FIELDS + ["max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice",
                               "chat_template_kwargs", "response_format", "parallel_tool_calls",
                               "add_generation_prompt", "continue_final_message", "echo"]
COMPLETION_FIELDS = SHARED_FIELDS + ["logprobs", "echo", "best_of", "suffix"]
MESSAGE_FIELDS = ["role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content"]

# Legal or nearly legal values: these get past validation, so the tokenizer, the chat template and
# the sampler see odd input too.
plausible = {
    "max_tokens": st.integers(0, 12), "max_completion_tokens": st.integers(0, 12),
    "temperature": st.floats(0, 2.5), "top_p": st.floats(0, 1), "top_k": st.integers(-2, 5000),
    "min_p": st.floats(0, 1), "seed": st.integers(-(2**64), 2**64),
    "stop": odd_text | st.lists(odd_text, max_size=4), "stop_token_ids": st.lists(st.integers(-1, 3000), max_size=4),
    "presence_penalty": st.floats(-2.5, 2.5), "frequency_penalty": st.floats(-2.5, 2.5),
    "repetition_penalty": st.floats(0.005, 200), "min_tokens": st.integers(0, 10), "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(), "n": st.sampled_from([None, 1]), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}) | st.none(),
    "return_tokens_as_token_ids": st.booleans(), "logprobs": st.booleans() | st.integers(0, 25),
    "top_logprobs": st.integers(0, 25), "tool_choice": st.sampled_from(["auto", "none", None]),
    "chat_template_kwargs": st.dictionaries(st.sampled_from(["enable_thinking", "documents", "x"]), json_values,
                                            max_size=2),
    "user": odd_text, "echo": st.booleans(), "best_of": st.sampled_from([None, 1]), "suffix": st.none(),
    "truncate_prompt_tokens": st.sampled_from([None, -1, 0, 1, 3, 10**6]), "use_beam_search": st.booleans(),
    "length_penalty": st.floats(-3, 3) | huge_numbers, "add_generation_prompt": st.booleans(),
    "continue_final_message": st.booleans(),
}

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def set_field(draw, body: dict, fields: list[str]) -> None:
    name = draw(st.sampled_from(fields))
    if name in plausible and draw(st.booleans()):
        body[name] = draw(plausible[name])
    else:
        body[name] = draw(nasty)


@st.composite
def chat_bodies(draw, model: str) -> dict:
    """A valid chat request, then up to four mutations of its fields, messages or tools."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
                {"role": "user", "content": [{"type": "text", "text": "and tomorrow?"}]}]
    body = {"model": model, "messages": messages[draw(st.integers(0, 4)):], "max_tokens": 4,
            "stream": draw(st.booleans())}
    if draw(st.booleans()):
        body["tools"] = [json.loads(json.dumps(TOOL))]
    if draw(st.booleans()):
        body["logprobs"], body["top_logprobs"] = True, 2
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["field", "field", "text", "text", "message", "content", "tool", "drop"]))
        messages = body.setdefault("messages", [])
        if kind == "field":
            set_field(draw, body, CHAT_FIELDS)
        elif kind == "text":  # odd but legal text where the template and tokenizer meet it
            messages.append({"role": draw(st.sampled_from(["user", "system", "assistant"])), "content": draw(odd_text)})
        elif kind == "message" and messages:
            message = messages[draw(st.integers(0, len(messages) - 1))]
            message[draw(st.sampled_from(MESSAGE_FIELDS))] = draw(nasty)
        elif kind == "content":
            part = draw(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "input_audio", "x"])},
                                              optional={"text": nasty, "image_url": nasty}))
            messages.append({"role": "user", "content": [part]})
        elif kind == "tool":
            body["tools"] = [{"type": "function", "function": draw(st.dictionaries(
                st.sampled_from(["name", "description", "parameters", "strict"]), nasty, max_size=4))}]
        elif kind == "drop":
            body.pop(draw(st.sampled_from(sorted(body))), None)
    return body


@st.composite
def completion_bodies(draw, model: str) -> dict:
    prompt = draw(st.sampled_from(["Once upon a time", [1, 2, 3], ["one prompt"], [[5, 6]]]))
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "stream": draw(st.booleans())}
    if draw(st.booleans()):
        body["logprobs"] = 2
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["field", "field", "prompt", "drop"]))
        if kind == "field":
            set_field(draw, body, COMPLETION_FIELDS)
        elif kind == "prompt":
            body["prompt"] = draw(odd_text | st.lists(st.integers(-2, 3000), max_size=6) | nasty)
        else:
            body.pop(draw(st.sampled_from(sorted(body))), None)
    return body


def encode(body) -> bytes:
    """JSON as a careless client might write it: Python's NaN/Infinity tokens and lone surrogates pass."""
    return json.dumps(body, allow_nan=True).encode()


raw_bodies = st.one_of(
    st.binary(max_size=200),
    json_values.map(encode),
    st.sampled_from([b"", b"{", b'{"model": "stub", "prompt": "x"', b'{"model": NaN}', b"\xff\xfe{}",
                     b'{"model": "stub", "prompt": "\\ud800"}', b'{"a": ' * 2000 + b"1" + b"}" * 2000,
                     b"[" * 5000 + b"]" * 5000, b'{"model": "stub", "prompt": "x", "model": 1}']),
)

# ---- checks ----


def check_response(r: httpx.Response, body) -> None:
    context = f"body {body!r:.600}\nanswer {r.status_code} {r.text[:600]}"
    assert r.status_code in (200, 400, 404, 413), context
    if r.status_code != 200:
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, context
        assert isinstance(error["message"], str) and error["message"], context
        assert error["type"] == "invalid_request_error", context
        assert error["param"] is None or isinstance(error["param"], str), context
        assert error["code"] is None or isinstance(error["code"], str), context
    elif r.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", context
        for event in events[:-1]:
            assert "choices" in json.loads(event), context
    else:
        assert json.loads(r.text)["choices"], context


def post(http: httpx.Client, url: str, content: bytes, body) -> None:
    r = http.post(url, content=content, headers={"content-type": "application/json"})
    check_response(r, body)


# ---- against the scripted engine ----


def _serving(engine, ready_s: float, http_timeout_s: float):
    """A live server over `engine` with an HTTP client as `.http`; still healthy when done."""
    with LiveServer(engine, ServerConfig(max_body_bytes=BODY_LIMIT)) as s:
        s.wait_ready(ready_s)
        with httpx.Client(base_url=s.base_url, timeout=http_timeout_s) as http:
            s.http = http
            yield s
        assert httpx.get(f"{s.url}/health").status_code == 200


@pytest.fixture(scope="module")
def stub_server(default_tokenizer):
    engine = scripted_engine(ScriptedEngine(default_tokenizer, {}), max_running=4, max_waiting=4)
    yield from _serving(engine, 10, 30)


@settings(FUZZ, max_examples=70)
@given(body=chat_bodies("stub"))
def test_mutated_chat_requests(stub_server, body):
    post(stub_server.http, "/chat/completions", encode(body), body)


@settings(FUZZ, max_examples=70)
@given(body=completion_bodies("stub"))
def test_mutated_completion_requests(stub_server, body):
    post(stub_server.http, "/completions", encode(body), body)


@settings(FUZZ, max_examples=60)
@given(content=raw_bodies, chat=st.booleans())
def test_arbitrary_bodies(stub_server, content, chat):
    post(stub_server.http, "/chat/completions" if chat else "/completions", content, content)


@settings(FUZZ, max_examples=40)
@given(extra=st.dictionaries(st.sampled_from(sorted(set(CHAT_FIELDS + COMPLETION_FIELDS + ["model", "messages",
                                                                                              "prompt"]))),
                             json_values, max_size=6),
       chat=st.booleans())
def test_known_fields_with_any_json(stub_server, extra, chat):
    body = {"model": "stub", "max_tokens": 4, **extra}
    body.setdefault("messages" if chat else "prompt", [{"role": "user", "content": "hi"}] if chat else "hi")
    post(stub_server.http, "/chat/completions" if chat else "/completions", encode(body), body)


# ---- against a real engine (tokenizer, template, sampler and scheduler in the loop) ----


@pytest.fixture(scope="module")
def real_server():
    # A short context bounds every generation, whatever max_tokens and ignore_eos say.
    yield from _serving(real_engine(None, 1, max_model_len=320, max_num_seqs=4), 120, 60)


@pytest.mark.slow
@settings(FUZZ, max_examples=40)
@given(body=chat_bodies("neuron-default"))
def test_real_engine_chat(real_server, body):
    post(real_server.http, "/chat/completions", encode(body), body)


@pytest.mark.slow
@settings(FUZZ, max_examples=40)
@given(body=completion_bodies("neuron-default"))
def test_real_engine_completions(real_server, body):
    post(real_server.http, "/completions", encode(body), body)
