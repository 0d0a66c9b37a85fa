"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) through the official
`anthropic` client: on the default model (a reply equal to the same chat completion, stop
sequences, max_tokens, a forced tool call and its result fed back, structured output, the token
count, the key as x-api-key or a bearer token), on a scripted engine (thinking, text and tool_use
blocks streamed as the SDK assembles them, the thinking switch, errors in Anthropic's shape, pings,
a failure mid-stream, a client leaving mid-stream, a full queue, an oversized body), and at tp 2."""

from __future__ import annotations

import json
import threading

import anthropic
import httpx
import jsonschema
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_harness import (
    ERROR,
    LiveServer,
    ScriptedEngine,
    anthropic_client,
    client,
    real_engine,
    scripted_engine,
    wait_until,
)
from test_fuzz_http import FUZZ, nasty, odd_text

from neuron.entrypoints.openai.api_errors import APIError
from neuron.entrypoints.openai.app import ServerConfig
from neuron.entrypoints.openai.messages_types import Message, MessagesRequest
from neuron.entrypoints.openai.serving_messages import chat_request, model_page

KEY = "sekrit"
MODEL = "neuron-default"
BODY_LIMIT = 4096
SAMPLED = {"temperature": 1.0, "seed": 7}  # neuron takes a seed as an extension, as on its OpenAI routes
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
           "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER}]
OPENAI_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                                  "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# The system prompt as blocks; cache_control is accepted and ignored.
SYSTEM = [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]
NO_THINKING = {"type": "disabled"}


@pytest.fixture(scope="module")
def real_server():
    """The default model at tp 2 behind an API key."""
    with LiveServer(real_engine(None, 2, max_model_len=1024), ServerConfig(api_key=KEY)) as server:
        yield server.wait_ready()


def collapsed(kinds: list[str]) -> list[str]:
    """Runs of the same event type as one."""
    return [k for i, k in enumerate(kinds) if i == 0 or kinds[i - 1] != k]


def raw_kinds(events) -> list[str]:
    """The SDK's raw stream events as `type` (deltas as `type:delta type`, starts with the block's)."""
    out = []
    for e in events:
        detail = getattr(e, "delta", None) if e.type == "content_block_delta" else getattr(e, "content_block", None)
        out.append(f"{e.type}:{detail.type}" if detail is not None and hasattr(detail, "type") else e.type)
    return out


def shown(blocks) -> list[tuple]:
    """Content blocks as (type, what they hold), whichever of the SDK's classes it built them as."""
    held = {"text": lambda b: b.text, "thinking": lambda b: b.thinking, "tool_use": lambda b: (b.name, b.input)}
    return [(b.type, held[b.type](b)) for b in blocks]


def chat_twin(server, messages: list[dict], **kw):
    """The same request through /v1/chat/completions."""
    return client(server, KEY).chat.completions.create(model=MODEL, messages=messages, **kw)


# ---- the default model ----


def test_a_reply_equals_the_same_chat_completion(real_server):
    """Equal tokens: one sampled request (a seed) through both APIs, streamed and not."""
    api = anthropic_client(real_server, KEY)
    request = dict(model=MODEL, max_tokens=12, system=SYSTEM, messages=ASK, thinking=NO_THINKING,
                   extra_body=SAMPLED)
    out = api.messages.create(**request)
    twin = chat_twin(real_server, [{"role": "system", "content": "Be brief."}, *ASK], max_tokens=12,
                     extra_body={"chat_template_kwargs": {"enable_thinking": False}}, **SAMPLED)
    assert (out.type, out.role, out.model, out.id[:4]) == ("message", "assistant", MODEL, "msg_")
    assert [(b.type, b.text) for b in out.content] == [("text", twin.choices[0].message.content)]
    assert (out.usage.input_tokens, out.usage.output_tokens) == (twin.usage.prompt_tokens, 12)
    assert twin.usage.completion_tokens == 12 and out.stop_reason == "max_tokens" and out.stop_sequence is None

    raw = list(api.messages.create(stream=True, **request))
    assert collapsed(raw_kinds(raw)) == ["message_start", "content_block_start:text", "content_block_delta:text_delta",
                                         "content_block_stop", "message_delta", "message_stop"]
    assert raw[0].message.usage.input_tokens == out.usage.input_tokens and raw[0].message.id.startswith("msg_")
    assert "".join(e.delta.text for e in raw if e.type == "content_block_delta") == out.content[0].text
    assert (raw[-2].delta.stop_reason, raw[-2].usage.output_tokens) == ("max_tokens", 12)
    with api.messages.stream(**request) as stream:
        assert "".join(stream.text_stream) == out.content[0].text
        final = stream.get_final_message()
    assert shown(final.content) == shown(out.content) and final.usage.output_tokens == 12
    assert final.stop_reason == "max_tokens"


def test_a_final_assistant_message_is_a_prefill_the_reply_continues(real_server, default_tokenizer):
    """Anthropic's prefill: the reply goes on from the final assistant message's text, and leaves
    it out; the same tokens as vLLM's continue_final_message on the chat route, whose echo puts the
    prefill back. An empty final assistant message is a reply of its own."""
    api = anthropic_client(real_server, KEY)
    prefill = "The weather in Paris is"
    messages = [*ASK, {"role": "assistant", "content": prefill}]
    request = dict(model=MODEL, max_tokens=8, messages=messages, thinking=NO_THINKING, extra_body=SAMPLED)
    out = api.messages.create(**request)
    twin = chat_twin(real_server, messages, max_tokens=8, **SAMPLED,
                     extra_body={"chat_template_kwargs": {"enable_thinking": False}, "add_generation_prompt": False,
                                 "continue_final_message": True, "echo": True})
    text = out.content[0].text
    assert twin.choices[0].message.content == prefill + text and not text.startswith(prefill)
    prompt = default_tokenizer.apply_chat_template(messages, add_generation_prompt=False, enable_thinking=False)
    continued = prompt[: prompt.rindex(prefill) + len(prefill)]
    assert out.usage.input_tokens == twin.usage.prompt_tokens == len(default_tokenizer.encode(continued))
    counted = api.messages.count_tokens(model=MODEL, messages=messages, thinking=NO_THINKING)
    assert counted.input_tokens == out.usage.input_tokens
    with api.messages.stream(**request) as stream:
        assert "".join(stream.text_stream) == text
    chunks = list(client(real_server, KEY).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, stream=True, **SAMPLED,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}, "add_generation_prompt": False,
                    "continue_final_message": True, "echo": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == prefill + text

    empty = api.messages.create(**{**request, "messages": [*ASK, {"role": "assistant", "content": ""}]})
    plain = api.messages.create(**{**request, "messages": ASK})
    assert shown(empty.content) == shown(plain.content)


def test_stop_sequences(real_server):
    api = anthropic_client(real_server, KEY)
    request = dict(model=MODEL, max_tokens=16, messages=ASK, thinking=NO_THINKING, extra_body=SAMPLED)
    full = api.messages.create(**request).content[0].text
    at = next(k for k in range(3, len(full) - 1) if full.index(full[k: k + 2]) == k)  # a first occurrence
    stop = full[at: at + 2]
    out = api.messages.create(stop_sequences=["zzzz", stop], **request)
    assert shown(out.content) == [("text", full[:at])]
    assert (out.stop_reason, out.stop_sequence) == ("stop_sequence", stop)
    with api.messages.stream(stop_sequences=["zzzz", stop], **request) as stream:
        final = stream.get_final_message()
    assert (shown(final.content), final.stop_reason, final.stop_sequence) == (shown(out.content), "stop_sequence",
                                                                              stop)


def test_a_forced_tool_call_then_its_result(real_server):
    """tool_choice any and tool hold the model to a call whose input fits the schema; the call and
    a tool_result fed back make the prompt the same chat with tool_calls and a tool turn makes."""
    api = anthropic_client(real_server, KEY)
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
        out = api.messages.create(model=MODEL, max_tokens=60, messages=ASK, tools=TOOLS, tool_choice=choice,
                                  thinking=NO_THINKING, extra_body={"seed": 1})
        [call] = out.content
        assert (call.type, call.name, call.id[:6], out.stop_reason) == ("tool_use", "get_weather", "toolu_", "tool_use")
        jsonschema.validate(call.input, WEATHER)

    with api.messages.stream(model=MODEL, max_tokens=60, messages=ASK, tools=TOOLS, tool_choice={"type": "any"},
                             thinking=NO_THINKING, extra_body={"seed": 2}) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    [streamed] = final.content
    assert "input_json" in kinds and streamed.type == "tool_use" and final.stop_reason == "tool_use"
    jsonschema.validate(streamed.input, WEATHER)

    turns = [*ASK, {"role": "assistant", "content": [call.model_dump(exclude_none=True)]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny"}]}]
    reply = api.messages.create(model=MODEL, max_tokens=8, messages=turns, tools=TOOLS, thinking=NO_THINKING,
                                extra_body=SAMPLED)
    twin = chat_twin(real_server, [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(call.input)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"}], tools=OPENAI_TOOLS, max_tokens=8,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}}, **SAMPLED)
    assert reply.usage.input_tokens == twin.usage.prompt_tokens
    assert "".join(b.text for b in reply.content if b.type == "text") == (twin.choices[0].message.content or "")


def test_count_tokens_is_the_prompt_the_model_is_given(real_server, default_tokenizer):
    """With the template's reasoning switch: thinking disabled renders the closed empty think."""
    api = anthropic_client(real_server, KEY)

    def count(**kw) -> int:
        return api.messages.count_tokens(model=MODEL, system="Be brief.", messages=ASK, **kw).input_tokens

    on, off = count(thinking={"type": "enabled", "budget_tokens": 1024}), count(thinking=NO_THINKING)
    assert off - on == len(default_tokenizer.encode("<think>\n\n</think>\n\n"))
    assert count() == on  # no thinking field: the template's default, which thinks
    out = api.messages.create(model=MODEL, max_tokens=1, system="Be brief.", messages=ASK, thinking=NO_THINKING)
    assert out.usage.input_tokens == off
    twin = chat_twin(real_server, [{"role": "system", "content": "Be brief."}, *ASK], tools=OPENAI_TOOLS,
                     max_tokens=1)
    assert count(tools=TOOLS) == twin.usage.prompt_tokens > on


def test_structured_output_through_output_config(real_server):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 8}}, "required": ["answer"],
              "additionalProperties": False}
    out = anthropic_client(real_server, KEY).messages.create(
        model=MODEL, max_tokens=40, messages=ASK, thinking=NO_THINKING, extra_body={"seed": 3},
        output_config={"format": {"type": "json_schema", "schema": schema}})
    assert out.stop_reason == "end_turn"
    jsonschema.validate(json.loads(out.content[0].text), schema)


def test_the_key_as_x_api_key_or_a_bearer_token(real_server):
    request = dict(model=MODEL, messages=ASK)
    want = anthropic_client(real_server, KEY).messages.count_tokens(**request).input_tokens  # x-api-key
    assert anthropic_client(real_server, None, auth_token=KEY).messages.count_tokens(**request).input_tokens == want
    for wrong in ("wrong", None):
        with pytest.raises(anthropic.AuthenticationError) as err:
            anthropic_client(real_server, wrong, auth_token=None if wrong else "wrong").messages.create(
                max_tokens=4, **request)
        assert err.value.status_code == 401
        assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "authentication_error"
        assert "x-api-key" in err.value.body["error"]["message"]
    assert [m.id for m in anthropic_client(real_server, KEY).models.list()] == [MODEL]  # the key as x-api-key
    with pytest.raises(anthropic.AuthenticationError) as err:
        anthropic_client(real_server, "wrong").models.list()
    assert err.value.body["error"]["type"] == "authentication_error"


# ---- a scripted engine: what the model writes is known ----

# Text on both sides of a call, after the reasoning.
INTERLEAVED = ["<think>", "r1", "</think>", "\n\n", "Hello", " world", "<tool_call>",
               '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n', "</tool_call>", "\n", "After", " text."]
# the same with one update carrying text, the call and the text after it (a speculative step's tokens)
AT_ONCE = INTERLEAVED[:4] + ["".join(INTERLEAVED[4:])]
REASONED_CALL = ["<think>", "\nThe user wants", " the weather.\n", "</think>", "\n\n", "<tool_call>",
                 '\n{"name": "get_weather", ', '"arguments": {"city": "Paris"}}', "\n", "</tool_call>"]
SCRIPTS = {
    "assistant\n<think>\n\n</think>\n\n": ["No thinking."],  # thinking disabled: the template closed it
    "weather?": REASONED_CALL,
    "interleave": INTERLEAVED,
    "all at once": AT_ONCE,
    "ponder": ["<think>", "\nHmm", ".\n", "</think>", "\n\n", "Forty", "-two."],
    "explode": ["Hello", ERROR],
    "slowly": [0.6, "late", " answer"],
    "drip": ["a", *[0.05, "b"] * 60],
}


@pytest.fixture(scope="module")
def stub(default_tokenizer):
    return ScriptedEngine(default_tokenizer, SCRIPTS)


@pytest.fixture(scope="module")
def stub_server(stub):
    """No API key; a small body limit, short keep-alives, one place and one queued."""
    cfg = ServerConfig(max_body_bytes=BODY_LIMIT, keepalive_s=0.2)
    with LiveServer(scripted_engine(stub, max_running=1, max_waiting=1), cfg) as server:
        yield server.wait_ready(10)


@pytest.fixture(autouse=True)
def _open_gate(request):
    """The scripted engine steps again after a test that stalled it, however that test ended."""
    yield
    if "stub" in request.fixturenames:
        request.getfixturevalue("stub").gate.set()


def say(content: str, **kw) -> dict:
    return {"model": "stub", "max_tokens": 64, "messages": [{"role": "user", "content": content}], **kw}


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_and_a_tool_call_come_as_blocks(stub_server, stream):
    api = anthropic_client(stub_server)
    request = say("weather?", tools=TOOLS)
    if stream:
        raw = list(api.messages.create(stream=True, **request))
        assert collapsed(raw_kinds(raw)) == [
            "message_start", "content_block_start:thinking", "content_block_delta:thinking_delta",
            "content_block_stop", "content_block_start:tool_use", "content_block_delta:input_json_delta",
            "content_block_stop", "message_delta", "message_stop"]
        assert [e.index for e in raw if e.type == "content_block_start"] == [0, 1]
        with api.messages.stream(**request) as helper:
            out = helper.get_final_message()
    else:
        out = api.messages.create(**request)
    thinking, call = out.content
    assert (thinking.type, thinking.thinking) == ("thinking", "\nThe user wants the weather.\n")
    assert (call.type, call.name, call.input, call.id[:6]) == ("tool_use", "get_weather", {"city": "Paris"}, "toolu_")
    assert out.stop_reason == "tool_use" and out.usage.output_tokens == len(REASONED_CALL)


@pytest.mark.parametrize("script", ["interleave", "all at once"])
def test_blocks_come_in_the_order_the_model_wrote_them(stub_server, script):
    """Streamed or not, the same blocks: text before a call and text after it stay apart, in place,
    whether they come a token at a time or in one update."""
    api = anthropic_client(stub_server)
    request = say(script, tools=TOOLS)
    want = [("thinking", "r1"), ("text", "Hello world"), ("tool_use", ("get_weather", {"city": "Paris"})),
            ("text", "After text.")]
    out = api.messages.create(**request)
    assert (shown(out.content), out.stop_reason) == (want, "tool_use")
    raw = list(api.messages.create(stream=True, **request))
    assert [e.content_block.type for e in raw if e.type == "content_block_start"] == [kind for kind, _ in want]
    with api.messages.stream(**request) as helper:
        final = helper.get_final_message()
    assert (shown(final.content), final.stop_reason) == (want, "tool_use")


def test_tool_choice_none_leaves_the_call_as_text(stub_server):
    out = anthropic_client(stub_server).messages.create(tool_choice={"type": "none"}, **say("weather?", tools=TOOLS))
    assert [b.type for b in out.content] == ["thinking", "text"] and out.stop_reason == "end_turn"
    assert out.content[1].text == "".join(REASONED_CALL[5:])


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_maps_onto_the_templates_switch(stub_server, stream):
    api = anthropic_client(stub_server)

    def blocks(**kw):
        if not stream:
            return api.messages.create(**say("ponder", **kw))
        with api.messages.stream(**say("ponder", **kw)) as helper:
            return helper.get_final_message()

    on = blocks(thinking={"type": "enabled", "budget_tokens": 32})
    assert [(b.type, getattr(b, "thinking", None) or b.text) for b in on.content] == [
        ("thinking", "\nHmm.\n"), ("text", "Forty-two.")]
    assert on.stop_reason == "end_turn"
    off = blocks(thinking=NO_THINKING)
    assert [(b.type, b.text) for b in off.content] == [("text", "No thinking.")]


def test_pings_while_the_model_is_quiet(stub_server):
    with httpx.stream("POST", f"{stub_server.url}/v1/messages", json=say("slowly", stream=True), timeout=10) as r:
        names = [line[7:] for line in r.iter_lines() if line.startswith("event: ")]
    assert names[:3] == ["message_start", "ping", "ping"]  # the opening ping, then a keep-alive one
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    with anthropic_client(stub_server).messages.stream(**say("slowly")) as helper:
        assert helper.get_final_message().content[0].text == "late answer"


def test_a_failure_mid_stream_is_an_error_event(stub_server):
    api = anthropic_client(stub_server)
    with pytest.raises(anthropic.APIStatusError) as err:
        with api.messages.stream(**say("explode")) as helper:
            for _ in helper:
                pass
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "api_error"
    assert "rank 1 exited" in err.value.body["error"]["message"]
    with httpx.stream("POST", f"{stub_server.url}/v1/messages", json=say("explode", stream=True), timeout=10) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-2] == "event: error" and json.loads(lines[-1][6:])["error"]["type"] == "api_error"
    r = httpx.post(f"{stub_server.url}/v1/messages", json=say("explode"))
    assert r.status_code == 503 and r.json()["error"]["type"] == "api_error" and r.headers["retry-after"]


def test_unknown_methods_and_paths_answer_in_anthropics_shape(stub_server):
    r = httpx.get(f"{stub_server.url}/v1/messages")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                   "message": "GET /v1/messages: Method Not Allowed"}}
    r = httpx.post(f"{stub_server.url}/v1/messages/batches", json={})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert httpx.get(f"{stub_server.url}/v1/messagesx").json()["error"]["code"] == "not_found"  # OpenAI's beside it


def test_models_are_listed_to_anthropics_client_in_its_shape(stub_server):
    api = anthropic_client(stub_server)
    page = api.models.list()
    assert [(m.type, m.id, m.display_name) for m in page.data] == [("model", "stub", "stub")]
    assert (page.first_id, page.last_id, page.has_more) == ("stub", "stub", False)
    assert page.data[0].created_at.tzinfo is not None and api.models.retrieve("stub").id == "stub"
    with pytest.raises(anthropic.NotFoundError) as err:
        api.models.retrieve("nope")
    assert err.value.body["error"]["type"] == "not_found_error" and "`stub`" in err.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as err:
        api.models.list(limit=0)
    assert err.value.body["error"]["type"] == "invalid_request_error"
    plain = httpx.get(f"{stub_server.url}/v1/models").json()  # OpenAI's clients, at the same path
    assert plain["object"] == "list" and [c["id"] for c in plain["data"]] == ["stub"]
    assert httpx.get(f"{stub_server.url}/v1/models/stub").json()["object"] == "model"


def test_anthropic_model_pages_follow_their_cursors():
    names = [f"m{i}" for i in range(5)]

    def ids(page: dict) -> list[str]:
        return [m["id"] for m in page["data"]]

    first = model_page(names, 0, {"limit": "2"})
    assert ids(first) == ["m0", "m1"] and first["has_more"] and (first["first_id"], first["last_id"]) == ("m0", "m1")
    last = model_page(names, 0, {"limit": "2", "after_id": "m3"})
    assert ids(last) == ["m4"] and not last["has_more"]
    assert ids(model_page(names, 0, {"limit": "2", "before_id": "m3"})) == ["m1", "m2"]
    assert model_page(names, 0, {"limit": "2", "before_id": "m3"})["has_more"]
    assert not model_page(names, 0, {"before_id": "m3"})["has_more"]
    assert model_page(names, 0, {"after_id": "m4"}) == {"data": [], "has_more": False, "first_id": None,
                                                        "last_id": None}
    assert model_page(names, 0, {})["data"][0]["created_at"] == "1970-01-01T00:00:00Z"
    for query, words in [({"limit": "1001"}, "limit must be"), ({"limit": "x"}, "limit must be"),
                         ({"after_id": "zz"}, "after_id 'zz' is not"),
                         ({"after_id": "m1", "before_id": "m2"}, "not both")]:
        with pytest.raises(APIError, match=words):
            model_page(names, 0, query)


def test_a_client_leaving_mid_stream_frees_its_place(stub_server, stub):
    with httpx.stream("POST", f"{stub_server.url}/v1/messages", json=say("drip", stream=True), timeout=10) as r:
        lines = r.iter_lines()
        while not next(lines).startswith("event: content_block_delta"):
            pass
        assert len(stub_server.engine.open_streams) == 1
    wait_until(lambda: not stub_server.engine.open_streams and not stub._active and stub._inbox.empty())
    assert anthropic_client(stub_server).messages.create(**say("hi")).content[0].text == "ok"


def test_a_full_queue_is_529_overloaded(stub_server, stub):
    stub.gate.clear()
    codes = []
    threads = [threading.Thread(target=lambda: codes.append(
        httpx.post(f"{stub_server.url}/v1/messages", json=say("hi"), timeout=30).status_code)) for _ in range(2)]
    for t in threads:
        t.start()
    wait_until(lambda: len(stub_server.engine.open_streams) == 2)
    with pytest.raises(anthropic.InternalServerError) as err:
        anthropic_client(stub_server).messages.create(**say("hi"))
    assert err.value.status_code == 529 and err.value.body["error"]["type"] == "overloaded_error"
    assert int(err.value.response.headers["retry-after"]) >= 1
    stub.gate.set()
    for t in threads:
        t.join()
    assert codes == [200, 200]


def test_an_oversized_body_is_413(stub_server):
    r = httpx.post(f"{stub_server.url}/v1/messages", json=say("x" * BODY_LIMIT))
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    r = httpx.post(f"{stub_server.url}/v1/messages/count_tokens", json=say("x" * BODY_LIMIT))
    assert r.status_code == 413 and r.json()["type"] == "error"


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}


@pytest.mark.parametrize("body, status, kind, words", [
    (b"{not json", 400, "invalid_request_error", "not valid JSON"),
    (json.dumps({"model": "stub", "messages": ASK}).encode(), 400, "invalid_request_error",
     "missing required field `max_tokens`"),
    (json.dumps(say("x", max_tokens="ten")).encode(), 400, "invalid_request_error", "max_tokens"),
    (json.dumps({**say("x"), "messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}]}).encode(),
     400, "invalid_request_error", "messages[0].content[0]: document blocks"),
    (json.dumps({**say("x"), "messages": [{"role": "system", "content": "x"}]}).encode(), 400,
     "invalid_request_error", "messages[0].role: must be 'user' or 'assistant'"),
    (json.dumps({**say("x"), "messages": [{"role": "user", "content": [{"type": "video"}]}]}).encode(), 400,
     "invalid_request_error", "a block of type 'video' is not supported in a user message"),
    (json.dumps({**say("x"), "messages": [{"role": "user", "content": [IMAGE]}]}).encode(), 400,
     "invalid_request_error", "does not accept images"),
    (json.dumps({**say("x"), "messages": [*ASK, {"role": "assistant", "content": "The "}]}).encode(), 400,
     "invalid_request_error", "final assistant content cannot end with trailing whitespace"),
    (json.dumps({**say("x"), "messages": [*ASK, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}]}]}).encode(), 400,
     "invalid_request_error", "messages[1]: a final assistant message (a prefill) takes text blocks only"),
    (json.dumps(say("x", tools=[{"type": "web_search_20250305", "name": "web_search"}])).encode(), 400,
     "invalid_request_error", "the server tool 'web_search_20250305' is not supported"),
    (json.dumps(say("x", tools=TOOLS, tool_choice={"type": "tool"})).encode(), 400, "invalid_request_error",
     "tool_choice.name"),
    (json.dumps(say("x", thinking={"type": "enabled", "budget_tokens": 64})).encode(), 400,
     "invalid_request_error", "budget_tokens: must be less than max_tokens (64)"),
    (json.dumps(say("x", max_tokens=0)).encode(), 400, "invalid_request_error", "max_tokens: must be >= 1, got 0"),
    (json.dumps(say("x", max_tokens=-5)).encode(), 400, "invalid_request_error", "max_tokens: must be >= 1, got -5"),
    (json.dumps(say("x", stop_sequences=[""])).encode(), 400, "invalid_request_error",
     "stop_sequences must be a list of non-empty strings"),
    (json.dumps(say("x", output_config={"format": {"type": "json_schema", "schema": {"type": "nope"}}})).encode(),
     400, "invalid_request_error", "output_config.format.schema cannot be compiled"),
    (json.dumps({**say("x"), "model": "claude-opus"}).encode(), 404, "not_found_error", "`claude-opus`"),
])
def test_bad_input_gets_anthropics_error_shape(stub_server, body, status, kind, words):
    r = httpx.post(f"{stub_server.url}/v1/messages", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status
    error = r.json()
    assert set(error) == {"type", "error"} and error["type"] == "error" and error["error"]["type"] == kind
    assert words in error["error"]["message"], error


def test_the_sdk_raises_its_own_error_for_a_document_block(stub_server):
    document = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}
    with pytest.raises(anthropic.BadRequestError) as err:
        anthropic_client(stub_server).messages.count_tokens(
            model="stub", messages=[{"role": "user", "content": [document]}])
    assert err.value.body["error"]["type"] == "invalid_request_error"


BODY_FIELDS = ["max_tokens", "system", "messages", "stop_sequences", "temperature", "top_p", "top_k", "tools",
               "tool_choice", "thinking", "metadata", "output_config", "stream", "mcp_servers", "seed", "model"]
BLOCK_FIELDS = ["type", "text", "source", "id", "name", "input", "tool_use_id", "content", "thinking"]
BLOCK_TYPES = ["text", "image", "tool_use", "tool_result", "thinking", "document", "x", None]


@st.composite
def message_bodies(draw) -> dict:
    """A valid request with every kind of block, then up to three mutations of its fields, blocks
    or tools."""
    body = {"model": "stub", "max_tokens": 4, "stream": draw(st.booleans()), "system": "Be brief.", "tools": [
        {"name": "get_weather", "input_schema": {"type": "object"}}], "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm"}, {"type": "text", "text": "Let me"},
                                          {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
                                     {"type": "text", "text": "and tomorrow?"}]}]}
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["field", "field", "block", "block", "message", "tool", "drop"]))
        if kind == "field":
            body[draw(st.sampled_from(BODY_FIELDS))] = draw(nasty | odd_text)
        elif kind == "block" and isinstance(body.get("messages"), list) and body["messages"]:
            message = body["messages"][draw(st.integers(0, len(body["messages"]) - 1))]
            if isinstance(message, dict) and isinstance(message.get("content"), list) and message["content"]:
                block = {"type": draw(st.sampled_from(BLOCK_TYPES))}
                block[draw(st.sampled_from(BLOCK_FIELDS))] = draw(nasty | odd_text)
                message["content"][draw(st.integers(0, len(message["content"]) - 1))] = block
        elif kind == "message" and isinstance(body.get("messages"), list):
            body["messages"].insert(0, {"role": draw(st.sampled_from(["user", "assistant", "system", "x"])),
                                        "content": draw(nasty | odd_text)})
        elif kind == "tool":
            body["tools"] = [draw(st.dictionaries(st.sampled_from(["name", "input_schema", "type", "description"]),
                                                  nasty, max_size=4))]
        elif kind == "drop":
            body.pop(draw(st.sampled_from(sorted(body))), None)
    return body


@settings(FUZZ, max_examples=40, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(body=message_bodies(), count=st.booleans())
def test_generated_bodies_are_answered_or_refused_in_anthropics_shape(stub_server, body, count):
    """Whatever a client sends: never a 500, every refusal Anthropic's error, every stream whole."""
    path = "/v1/messages/count_tokens" if count else "/v1/messages"
    r = httpx.post(f"{stub_server.url}{path}", content=json.dumps(body).encode(), timeout=30,
                   headers={"content-type": "application/json"})
    context = f"body {body!r:.600}\nanswer {r.status_code} {r.text[:600]}"
    assert r.status_code in (200, 400, 404, 413), context
    if r.status_code != 200:
        error = r.json()
        assert set(error) == {"type", "error"} and set(error["error"]) == {"type", "message"}, context
        assert error["error"]["type"] in ("invalid_request_error", "not_found_error", "request_too_large"), context
    elif r.headers["content-type"].startswith("text/event-stream"):
        names = [line[7:] for line in r.text.splitlines() if line.startswith("event: ")]
        assert names[0] == "message_start" and names[-1] == "message_stop", context
    else:
        assert set(r.json()) == ({"input_tokens"} if count else set(Message.__struct_fields__) | {"type"}), context


def test_blocks_become_the_chat_turns_they_mean():
    """Translated without a server: system blocks, a base64 image, thinking and tool_use in an
    assistant turn, tool_result blocks as tool turns in their place, tools, tool_choice, sampling."""
    req = msgspec.convert({
        "model": "m", "max_tokens": 9, "system": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Look"}, IMAGE]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hm", "signature": ""}, {"type": "text", "text": "Let me check."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                {"type": "text", "text": "And tomorrow?"}]}],
        "tools": TOOLS, "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "stop_sequences": ["\n\n"], "temperature": 0.5, "top_p": 0.9, "top_k": 20, "metadata": {"user_id": "u1"},
    }, MessagesRequest)
    chat = chat_request(req)
    assert chat.messages == [
        {"role": "system", "content": "A\nB"},
        {"role": "user", "content": [{"type": "text", "text": "Look"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]},
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "hm", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "user", "content": [{"type": "text", "text": "And tomorrow?"}]},
    ]
    assert chat.tools == OPENAI_TOOLS
    assert (chat.tool_choice, chat.parallel_tool_calls, chat.max_tokens, chat.stop) == ("required", False, 9, ["\n\n"])
    assert (chat.temperature, chat.top_p, chat.top_k, chat.chat_template_kwargs) == (0.5, 0.9, 20, None)
