"""OpenAI's Responses API (/v1/responses) through the official client's `responses` resource and
the Agents SDK: text, reasoning and function-call output items, the typed stream events,
structured output, the store (retrieve, delete, previous_response_id, eviction), and errors in
OpenAI's shape. The tiny default model answers where the tokens matter (a seeded sample is the
same as the chat endpoint's, a grammar forces calls and JSON); a scripted engine writes the
reasoning and tool calls a random model never would."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Annotated

import agents
import httpx
import jsonschema
import openai
import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types.shared import Reasoning
from server_harness import (
    ERROR,
    LiveServer,
    ScriptedEngine,
    ServeProcess,
    client,
    metric,
    real_engine,
    scripted_engine,
    wait_until,
)
from test_fuzz_http import FUZZ, nasty, odd_text

from neuron.entrypoints.openai.app import ServerConfig
from neuron.entrypoints.openai.response_store import ResponseStore, StoredResponse
from neuron.entrypoints.openai.serving_responses import input_messages

MODEL = "neuron-default"
KEY = "sekrit"
MAX_STORED = 4
BODY_LIMIT = 2**16
SAMPLED = {"temperature": 1.0, "extra_body": {"ignore_eos": True, "seed": 7}}
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
        "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city",
                "parameters": CITY, "strict": True}
WEATHER = ["<think>", "\nThe user wants", " the weather.\n", "</think>", "\n\n", "<tool_call>",
           '\n{"name": "get_weather", ', '"arguments": {"city": "Paris"}}', "\n", "</tool_call>"]
# The scripted engine answers a prompt with the first script whose key it holds: a tool's result
# (in the second turn) before the question that both turns hold.
SCRIPTS = {
    "sunny in Paris": ["It is sunny", " in Paris."],
    "weather?": WEATHER,
    "hello": ["Hello", " there", "!"],
    "explode": ["Hello", ERROR],
}


@pytest.fixture(scope="module")
def model_server():
    cfg = ServerConfig(responses_max_stored=MAX_STORED, max_body_bytes=BODY_LIMIT)
    with LiveServer(real_engine(None, 2, max_model_len=1024), cfg) as server:  # the default model at tp 2
        yield server.wait_ready()


@pytest.fixture(scope="module")
def stub(default_tokenizer):
    return ScriptedEngine(default_tokenizer, SCRIPTS)


@pytest.fixture(scope="module")
def stub_server(stub):
    with LiveServer(scripted_engine(stub), ServerConfig(api_key=KEY, keepalive_s=0.2)) as server:
        yield server.wait_ready(10)


def _stub_client(server) -> openai.OpenAI:
    return client(server, KEY)


def _create(server, **kw):
    return client(server).responses.create(model=MODEL, **kw)


def _post(server, body: dict, **kw) -> httpx.Response:
    kw.setdefault("timeout", 30)
    return httpx.post(f"{server.base_url}/responses", json=body, **kw)


# ---- text, usage and the same tokens as chat ----


def test_a_response_has_the_tokens_of_the_same_chat(model_server, default_tokenizer):
    out = _create(model_server, input="The river", instructions="Be brief.", max_output_tokens=12,
                  reasoning={"effort": "none"}, **SAMPLED)
    chat = client(model_server).chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The river"}],
        max_tokens=12, temperature=1.0, seed=7, extra_body={"ignore_eos": True,
                                                           "chat_template_kwargs": {"enable_thinking": False}})
    [message] = out.output
    assert message.type == "message" and message.role == "assistant" and message.status == "incomplete"
    assert out.output_text == chat.choices[0].message.content and out.output_text
    assert (out.usage.input_tokens, out.usage.output_tokens) == (chat.usage.prompt_tokens, 12)
    assert out.usage.total_tokens == chat.usage.total_tokens
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert (out.object, out.model, out.instructions, out.max_output_tokens) == ("response", MODEL, "Be brief.", 12)
    assert out.id.startswith("resp_") and message.id.startswith("msg_")


def test_reasoning_effort_is_the_templates_thinking_switch(model_server, default_tokenizer):
    chat = [{"role": "user", "content": "Tell me about trains."}]
    for effort, thinking in (("none", False), ("minimal", False), ("low", True), ("high", True)):
        out = _create(model_server, input="Tell me about trains.", max_output_tokens=1, reasoning={"effort": effort},
                      temperature=0)
        prompt = default_tokenizer.apply_chat_template(chat, add_generation_prompt=True, enable_thinking=thinking)
        assert out.usage.input_tokens == len(default_tokenizer.encode(prompt)), effort
        assert out.reasoning.effort == effort


def test_a_stop_sequence_completes_the_response(model_server):
    free = _create(model_server, input="The river", max_output_tokens=12, reasoning={"effort": "none"}, **SAMPLED)
    text = free.output_text
    stop = text[8:12]
    extra = {**SAMPLED["extra_body"], "stop": [stop]}
    out = _create(model_server, input="The river", max_output_tokens=12, reasoning={"effort": "none"},
                  temperature=1.0, extra_body=extra)
    assert out.status == "completed" and out.incomplete_details is None
    assert out.output_text == text[:text.index(stop)]
    assert out.output[0].status == "completed"


# ---- streaming ----


def test_stream_events_tell_the_same_response(model_server):
    kw = dict(input="The river", max_output_tokens=10, reasoning={"effort": "none"}, **SAMPLED)
    whole = _create(model_server, **kw)
    events = list(_create(model_server, stream=True, **kw))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done, final = events[-4], events[-1].response
    assert deltas == done.text == final.output_text == whole.output_text
    assert events[2].item.id == done.item_id == final.output[0].id
    assert final.usage.output_tokens == 10 and final.incomplete_details.reason == "max_output_tokens"
    assert client(model_server).responses.retrieve(final.id) == final


def test_streamed_reasoning_and_function_call(stub_server):
    c = _stub_client(stub_server)
    with c.responses.stream(model="stub", input="weather?", tools=[WEATHER_TOOL]) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert types == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    reasoning, call = final.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "\nThe user wants the weather.\n"
    assert (call.type, call.name, call.status) == ("function_call", "get_weather", "completed")
    assert json.loads(call.arguments) == {"city": "Paris"} and call.call_id.startswith("call_")
    added = events[9]
    assert added.item.type == "function_call" and added.item.arguments == "" and added.output_index == 1
    assert events[11].arguments == call.arguments and events[11].item_id == call.id
    kept = c.responses.retrieve(final.id)
    assert [(i.id, i.status) for i in kept.output] == [(i.id, i.status) for i in final.output]
    assert kept.output[1].arguments == call.arguments and kept.usage == final.usage


def test_a_failed_generation_ends_the_stream_with_response_failed(stub_server):
    c = _stub_client(stub_server)
    events = list(c.responses.create(model="stub", input="explode", stream=True))
    assert [e.type for e in events][2:] == ["response.output_item.added", "response.content_part.added",
                                            "response.output_text.delta", "error", "response.failed"]
    error, failed = events[-2:]
    assert error.code == "generation_failed" and "rank 1 exited" in error.message
    assert failed.response.status == "failed" and failed.response.error.code == "generation_failed"
    assert failed.response.output[0].content[0].text == "Hello"  # what was written before it failed
    with pytest.raises(openai.NotFoundError):  # a failed response is not kept
        c.responses.retrieve(failed.response.id)
    with pytest.raises(openai.APIStatusError) as e:
        c.responses.create(model="stub", input="explode")
    assert e.value.status_code == 503 and e.value.code == "generation_failed"


@pytest.mark.slow
def test_neuron_serve_tp2_answers_as_its_chat_does():
    """`neuron serve --tp 2`: a seeded sample, streamed and not, is the chat endpoint's; a forced
    call fits its schema and its result, fed back, is read."""
    with ServeProcess("--tp", "2", "--max-model-len", "1024") as server:
        c = client(server)
        kw = dict(input="The river", max_output_tokens=8, reasoning={"effort": "none"}, **SAMPLED)
        whole = c.responses.create(model=MODEL, **kw)
        streamed = list(c.responses.create(model=MODEL, stream=True, **kw))[-1].response
        chat = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "The river"}],
                                         max_tokens=8, temperature=1.0, seed=7,
                                         extra_body={"ignore_eos": True,
                                                     "chat_template_kwargs": {"enable_thinking": False}})
        assert whole.output_text == streamed.output_text == chat.choices[0].message.content
        assert whole.usage.input_tokens == streamed.usage.input_tokens == chat.usage.prompt_tokens
        call = c.responses.create(model=MODEL, input="Weather?", tools=[WEATHER_TOOL], tool_choice="required",
                                  temperature=0, max_output_tokens=40, reasoning={"effort": "none"})
        jsonschema.validate(json.loads(call.output[0].arguments), CITY)
        [made] = call.output
        result = {"type": "function_call_output", "call_id": made.call_id, "output": "sunny"}
        tail = dict(tools=[WEATHER_TOOL], max_output_tokens=4, temperature=0)  # tools are not carried on
        after = c.responses.create(model=MODEL, previous_response_id=call.id, input=[result], **tail)
        explicit = c.responses.create(model=MODEL, **tail, input=[
            {"role": "user", "content": "Weather?"},
            {"type": "function_call", "call_id": made.call_id, "name": made.name, "arguments": made.arguments},
            result])
        assert after.usage.input_tokens == explicit.usage.input_tokens > call.usage.input_tokens
        assert after.output_text == explicit.output_text


# ---- reasoning and function calls, not streamed ----


def test_reasoning_and_function_call_items(stub_server):
    out = _stub_client(stub_server).responses.create(model="stub", input="weather?", tools=[WEATHER_TOOL])
    assert [item.type for item in out.output] == ["reasoning", "function_call"]
    reasoning, call = out.output
    assert reasoning.content[0].type == "reasoning_text" and reasoning.summary == []
    assert reasoning.content[0].text == "\nThe user wants the weather.\n"
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    assert out.status == "completed" and out.output_text == ""
    # one token a piece: the reasoning is written by the first four, <think> to </think>
    assert (out.usage.output_tokens, out.usage.output_tokens_details.reasoning_tokens) == (len(WEATHER), 4)
    assert out.tools[0].name == "get_weather" and out.tool_choice == "auto"


def test_without_tools_a_call_is_text(stub_server):
    out = _stub_client(stub_server).responses.create(model="stub", input="weather?")
    assert [item.type for item in out.output] == ["reasoning", "message"]
    assert out.output_text == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_forced_function_call_round_trip(model_server):
    """The grammar writes a call whose arguments fit the schema; its result goes back as a
    function_call_output, after the call itself or after the response that made it."""
    c = client(model_server)
    first = _create(model_server, input="Weather in Paris?", tools=[WEATHER_TOOL], tool_choice="required",
                    temperature=0, max_output_tokens=40, reasoning={"effort": "none"})
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather" and first.status == "completed"
    jsonschema.validate(json.loads(call.arguments), CITY)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "clear"}'}
    tail = dict(tools=[WEATHER_TOOL], max_output_tokens=6, reasoning={"effort": "none"}, **SAMPLED)
    chained = _create(model_server, previous_response_id=first.id, input=[result], **tail)
    explicit = _create(model_server, input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        result], **tail)
    assert chained.previous_response_id == first.id
    assert chained.usage.input_tokens == explicit.usage.input_tokens > first.usage.input_tokens + 10
    assert chained.output_text == explicit.output_text
    named = c.responses.create(model=MODEL, input="Weather?", tools=[WEATHER_TOOL], temperature=0,
                               tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=40)
    assert named.output[0].name == "get_weather"
    jsonschema.validate(json.loads(named.output[0].arguments), CITY)


# ---- structured output ----


class Answer(pydantic.BaseModel):
    answer: str = pydantic.Field(max_length=10)
    sure: bool


def test_json_schema_format_through_structured_output(model_server):
    out = client(model_server).responses.parse(model=MODEL, input="Answer in JSON.", text_format=Answer,
                                               temperature=0, max_output_tokens=60, reasoning={"effort": "none"})
    assert out.status == "completed"
    assert isinstance(out.output_parsed, Answer)
    jsonschema.validate(json.loads(out.output_text), Answer.model_json_schema())
    assert out.text.format.type == "json_schema"


# ---- the store ----


def test_previous_response_id_continues_the_conversation(model_server):
    first = _create(model_server, input="Tell me about trains.", instructions="Be brief.", max_output_tokens=6,
                    reasoning={"effort": "none"}, **SAMPLED)
    tail = dict(max_output_tokens=6, reasoning={"effort": "none"}, **SAMPLED)
    chained = _create(model_server, previous_response_id=first.id, input="And rivers?", **tail)
    explicit = _create(model_server, input=[  # instructions are not carried on, as OpenAI has it
        {"role": "user", "content": "Tell me about trains."},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": first.output_text}]},
        {"role": "user", "content": "And rivers?"}], **tail)
    assert chained.usage.input_tokens == explicit.usage.input_tokens
    assert chained.output_text == explicit.output_text


def test_retrieve_delete_and_not_stored(model_server):
    c = client(model_server)
    out = _create(model_server, input="The river", max_output_tokens=2, temperature=0)
    assert c.responses.retrieve(out.id) == out
    c.responses.delete(out.id)
    for call in (lambda: c.responses.retrieve(out.id), lambda: c.responses.delete(out.id)):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.code == "response_not_found"
    r = httpx.get(f"{model_server.base_url}/responses/{out.id}?stream=true")
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"
    unstored = _create(model_server, input="The river", max_output_tokens=2, temperature=0, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(unstored.id)


def test_the_least_recently_used_is_evicted(model_server):
    c = client(model_server)
    made = [_create(model_server, input="The river", max_output_tokens=1, temperature=0) for _ in range(MAX_STORED)]
    c.responses.retrieve(made[0].id)  # now the most recently used: made[1] goes first
    _create(model_server, input="The river", max_output_tokens=1, temperature=0)
    c.responses.retrieve(made[0].id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(made[1].id)
    r = _post(model_server, {"model": MODEL, "input": "x", "previous_response_id": made[1].id})
    assert r.status_code == 404
    assert r.json() == {"error": {"message": r.json()["error"]["message"], "type": "invalid_request_error",
                                  "param": "previous_response_id", "code": "previous_response_not_found"}}
    assert made[1].id in r.json()["error"]["message"]


def test_the_store_is_bounded_by_bytes_too():
    store = ResponseStore(max_count=10, max_bytes=100)
    for i in range(3):
        assert store.put("", f"r{i}", StoredResponse(b"x" * 20, b"y" * 10))
    store.get("", "r0")  # the least recently used is now r1, then r2
    assert store.put("", "r3", StoredResponse(b"x" * 40, b""))  # 130 bytes: r1 leaves
    assert (len(store), store.bytes) == (3, 100)
    assert store.put("", "r4", StoredResponse(b"x" * 20, b""))  # 120 bytes: r2 leaves
    assert [store.get("", k) is not None for k in ("r0", "r1", "r2", "r3", "r4")] == [True, False, False, True, True]
    assert not store.put("", "big", StoredResponse(b"x" * 101, b""))  # alone over the bound: not kept, nothing evicted
    assert (len(store), store.bytes) == (3, 90) and store.get("", "big") is None
    assert store.delete("", "r0") and not store.delete("", "r0") and store.bytes == 60
    assert not ResponseStore(max_count=0, max_bytes=100).put("", "r", StoredResponse(b"x", b""))


def test_an_owner_sees_only_its_own_responses():
    store = ResponseStore(max_count=10, max_bytes=100)
    assert store.put("a", "r", StoredResponse(b"a", b""))
    assert store.get("b", "r") is None and not store.delete("b", "r")
    assert store.put("b", "r", StoredResponse(b"b", b""))  # the same id under another owner is another entry
    assert store.get("a", "r").body == b"a" and store.get("b", "r").body == b"b"


# ---- input items ----


def test_input_items_become_chat_turns():
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "cold"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "noon"}]},
    ]
    assert input_messages(items, vision=False) == [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {"role": "assistant", "content": None, "reasoning_content": "hm", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "cold", "name": "get_weather"},
        {"role": "tool", "tool_call_id": "c2", "content": "noon", "name": "get_time"},
    ]
    assert input_messages("Hi", vision=False) == [{"role": "user", "content": "Hi"}]


# ---- errors: OpenAI's shape, never a 500 ----

# A tool_choice the Responses API does not take, told in its own shape (not the chat path's).
RESPONSES_TOOL_CHOICE = 'tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}'


@pytest.mark.parametrize("body, status, param, words", [
    ({"input": "x"}, 400, "model", "you must provide a model parameter"),
    ({"model": MODEL, "input": 5}, 400, "input", "Expected `str | array | null`, got `int`"),
    ({"model": MODEL}, 400, "input", "input must be a string or a non-empty list of items"),
    ({"model": MODEL, "input": []}, 400, "input", "input must be a string or a non-empty list of items"),
    ({"model": MODEL, "input": [{"type": "item_reference", "id": "x"}]}, 400, "input[0].type",
     "input[0].type 'item_reference' is not supported"),
    ({"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, 400,
     "input[0].content[0]", "input[0].content[0] must be an input_text, output_text or input_image part"),
    ({"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]},
     400, "input[0].content[0]", "this model does not accept images"),
    ({"model": MODEL, "input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, 400,
     "input[0].arguments", "input[0].arguments must be a string"),
    ({"model": MODEL, "input": "x", "tools": [{"type": "web_search"}]}, 400, "tools[0].type",
     "tools[0] is of type 'web_search'; neuron serves function tools only"),
    ({"model": MODEL, "input": "x", "tools": [{"type": "function", "parameters": {}}]}, 400, "tools[0].name",
     "tools[0].name must be the function's name"),
    ({"model": MODEL, "input": "x", "tool_choice": {"type": "web_search_preview"}}, 400, "tool_choice",
     RESPONSES_TOOL_CHOICE),
    ({"model": MODEL, "input": "x", "tools": [WEATHER_TOOL], "tool_choice": "bogus"}, 400, "tool_choice",
     RESPONSES_TOOL_CHOICE),
    ({"model": MODEL, "input": "x", "tool_choice": "required"}, 400, "tool_choice",
     "tool_choice 'required' needs tools"),
    ({"model": MODEL, "input": "x", "tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "name": "nope"}},
     400, "tool_choice", "tool_choice names the function 'nope', which is not among the tools"),
    ({"model": MODEL, "input": "x", "max_output_tokens": 0}, 400, "max_output_tokens",
     "max_output_tokens must be >= 1 or null, got 0"),
    ({"model": MODEL, "input": "x", "temperature": "hot"}, 400, "temperature", "got `str` - at `$.temperature`"),
    ({"model": MODEL, "input": "x", "reasoning": {"effort": "huge"}}, 400, "reasoning.effort",
     "Invalid enum value 'huge'"),
    ({"model": MODEL, "input": "x", "text": {"format": {"type": "yaml"}}}, 400, "text.format.type",
     "text.format.type must be text, json_object or json_schema, got 'yaml'"),
    ({"model": MODEL, "input": "x", "text": {"format": {"type": "json_schema", "name": "a"}}}, 400,
     "text.format.schema", "text.format of type json_schema needs schema"),
    ({"model": MODEL, "input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}}, 400, "text.format.schema",
     "text.format.schema cannot be compiled"),
    ({"model": MODEL, "input": "x", "background": True}, 400, "background", "background responses are not supported"),
    ({"model": MODEL, "input": "x", "conversation": "conv_1"}, 400, "conversation", "conversations are not supported"),
    ({"model": MODEL, "input": "x", "previous_response_id": "resp_never"}, 404, "previous_response_id",
     "Previous response with id 'resp_never' not found"),
    ({"model": "gpt-5", "input": "x"}, 404, "model", "the model `gpt-5` does not exist"),
    ({"model": MODEL, "input": "word " * 9000}, 400, "input", "maximum context length is 1024 tokens"),
])
def test_bad_requests_get_openai_errors(model_server, body, status, param, words):
    r = _post(model_server, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and words in error["message"], error


def test_truncation_auto_drops_the_oldest_turns_to_fit(model_server):
    """truncation "auto": a conversation past the context loses its oldest turns, from a user message
    on, until the prompt leaves room for max_output_tokens; "disabled" (the default) refuses it."""
    turns = []
    for k in range(6):  # about 1,300 tokens in all, against a context of 1,024
        turns += [{"role": "user", "content": f"Turn {k}: " + "river " * 200},
                  {"role": "assistant", "content": f"Noted {k}."}]
    turns.append({"role": "user", "content": "Which turn was the last?"})
    body = {"model": MODEL, "input": turns, "max_output_tokens": 8, "temperature": 0, "instructions": "Be brief."}
    refused = _post(model_server, body)
    assert refused.status_code == 400 and "maximum context length" in refused.json()["error"]["message"]
    out = _post(model_server, {**body, "truncation": "auto"})
    assert out.status_code == 200, out.text
    response = out.json()
    assert response["truncation"] == "auto" and 0 < response["usage"]["input_tokens"] <= 1024 - 8
    system = [{"role": "system", "content": "Be brief."}]
    counts = [httpx.post(f"{model_server.url}/tokenize", json={"model": MODEL, "messages": system + turns[start:]})
              .json()["count"] for start in range(0, len(turns), 2)]  # each cut at a user message
    assert response["usage"]["input_tokens"] == max(c for c in counts if c <= 1024 - 8) < counts[0]



RESPONSES_FIELDS = ["input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "max_output_tokens",
                    "temperature", "top_p", "reasoning", "text", "stream", "store", "previous_response_id", "metadata",
                    "include", "truncation", "user", "top_k", "seed", "stop"]
ITEM_FIELDS = ["type", "role", "content", "call_id", "name", "arguments", "output", "summary"]


@st.composite
def responses_bodies(draw) -> dict:
    """A valid request with every kind of input item, then up to three mutations."""
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
             {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]
    body = {"model": "stub", "input": items[draw(st.integers(0, 4)):], "stream": draw(st.booleans()),
            "tools": [dict(WEATHER_TOOL)], "reasoning": {"effort": "low"},
            "text": {"format": {"type": "json_schema", "name": "a", "schema": CITY}}}
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["field", "field", "item", "part", "tool", "drop"]))
        if kind == "field":
            body[draw(st.sampled_from(RESPONSES_FIELDS))] = draw(nasty)
        elif kind == "item" and isinstance(body.get("input"), list) and body["input"]:
            item = body["input"][draw(st.integers(0, len(body["input"]) - 1))]
            item[draw(st.sampled_from(ITEM_FIELDS))] = draw(nasty)
        elif kind == "part":
            part = draw(st.fixed_dictionaries({"type": st.sampled_from(["input_text", "input_image", "x"])},
                                              optional={"text": nasty | odd_text, "image_url": nasty}))
            body["input"] = [{"role": "user", "content": [part]}]
        elif kind == "tool":
            body["tools"] = [draw(st.dictionaries(st.sampled_from(["type", "name", "parameters", "strict"]), nasty,
                                                  max_size=4))]
        elif kind == "drop":
            body.pop(draw(st.sampled_from(sorted(body))), None)
    return body


@settings(FUZZ, max_examples=60)
@given(body=responses_bodies())
def test_mutated_requests_get_answers_or_openai_errors(stub_server, body):
    r = httpx.post(f"{stub_server.base_url}/responses", content=json.dumps(body).encode(), timeout=30,
                   headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"})
    context = f"body {body!r:.600}\nanswer {r.status_code} {r.text[:600]}"
    assert r.status_code in (200, 400, 404), context
    if r.status_code != 200:
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], context
    elif r.headers["content-type"].startswith("text/event-stream"):
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1]["type"] == "response.completed", context
    else:
        assert r.json()["status"] == "completed", context


def test_an_oversized_body_is_413(model_server):
    r = _post(model_server, {"model": MODEL, "input": "x" * BODY_LIMIT})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_the_api_key_guards_every_route(stub_server):
    for method, path in (("POST", "/responses"), ("GET", "/responses/resp_1"), ("DELETE", "/responses/resp_1")):
        r = httpx.request(method, f"{stub_server.base_url}{path}", json={"model": "stub", "input": "hello"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_a_client_that_leaves_aborts_the_response(stub_server, stub):
    """A client that goes away, streaming or not, before the first token: its request leaves the
    engine as an abort."""
    aborted = 'neuron_request_finished_total{reason="abort"}'
    before = metric(stub_server, aborted)
    body = json.dumps({"model": "stub", "input": "hello"}).encode()
    stub.gate.clear()
    try:
        with socket.create_connection(("127.0.0.1", int(stub_server.url.rsplit(":", 1)[1])), timeout=5) as sock:
            sock.sendall(b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(body)
                         + body)
            wait_until(lambda: len(stub_server.engine.open_streams) == 1)
        wait_until(lambda: not stub_server.engine.open_streams)
        with httpx.stream("POST", f"{stub_server.base_url}/responses", timeout=5,
                          json={"model": "stub", "input": "hello", "stream": True},
                          headers={"authorization": f"Bearer {KEY}"}) as r:
            lines = r.iter_lines()  # held: a dropped iterator would close the connection at once
            assert next(lines) == "event: response.created"
            wait_until(lambda: len(stub_server.engine.open_streams) == 1)
        # the gate opens only once the server has seen this client leave: opened before, the
        # request could finish first and be counted as finished, not aborted
        wait_until(lambda: not stub_server.engine.open_streams)
    finally:
        stub.gate.set()
    wait_until(lambda: not stub_server.engine.open_streams and not stub._active and stub._inbox.empty())
    wait_until(lambda: metric(stub_server, aborted) - before == 2)


# ---- the Agents SDK ----


def _weather_agent(server, calls: list[str]) -> agents.Agent:
    """An agent with one function tool, on a client of its own (a client keeps to one event loop)."""

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    model = agents.OpenAIResponsesModel(model="stub", openai_client=openai.AsyncOpenAI(
        base_url=server.base_url, api_key=KEY, max_retries=0))
    return agents.Agent(name="weather", instructions="Answer about the weather.", tools=[get_weather], model=model)


def test_an_agent_runs_a_function_tool_to_completion(stub_server):
    agents.set_tracing_disabled(True)
    calls = []
    result = agents.Runner.run_sync(_weather_agent(stub_server, calls), "What is the weather?")
    assert calls == ["Paris"]
    assert result.final_output == "It is sunny in Paris."
    kinds = [item.type for item in result.new_items]
    assert kinds == ["reasoning_item", "tool_call_item", "tool_call_output_item", "message_output_item"]

    async def streamed():
        run = agents.Runner.run_streamed(_weather_agent(stub_server, calls), "What is the weather?")
        return run, [event.type async for event in run.stream_events()]

    run, events = asyncio.run(streamed())
    assert calls == ["Paris", "Paris"] and run.final_output == "It is sunny in Paris."
    assert "raw_response_event" in events and [item.type for item in run.new_items] == kinds


def test_an_agent_on_the_real_model_runs_a_forced_tool_call_to_completion(model_server):
    """The default model at tp 2 behind the Agents SDK: the tool call forced (the random model would
    not choose one), its arguments valid for the tool, and the run ends with the tool's output."""
    agents.set_tracing_disabled(True)
    calls = []

    @agents.function_tool
    def get_weather(city: Annotated[str, pydantic.Field(max_length=12)]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    model = agents.OpenAIResponsesModel(model=MODEL, openai_client=openai.AsyncOpenAI(
        base_url=model_server.base_url, api_key="unused", max_retries=0))
    settings = agents.ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=128,
                                    reasoning=Reasoning(effort="none"))
    agent = agents.Agent(name="weather", instructions="Answer about the weather.", tools=[get_weather], model=model,
                         model_settings=settings, tool_use_behavior="stop_on_first_tool")
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?")
    assert len(calls) == 1 and isinstance(calls[0], str)
    assert result.final_output == f"sunny in {calls[0]}"
    assert [item.type for item in result.new_items] == ["tool_call_item", "tool_call_output_item"]
