"""Structured output on the default model (random weights, real tokenizer) through the official openai
client: whatever the model's logits, the text parses and validates, because the grammar's mask decides
which tokens it may take. Seeds are pinned (CPU float32 is deterministic) to ones whose draws close the
JSON within max_tokens; a grammar ends its sequence as soon as it allows nothing more."""

from __future__ import annotations

import asyncio
import json
import re
import threading

import jsonschema
import numpy as np
import openai
import pytest
import torch
from server_harness import LiveServer, async_client, client, real_engine, token_ids

from neuron.engine.llm_engine import RequestError
from neuron.engine.sampling import SequenceSampler, TokenBitmask, sample
from neuron.engine.sampling_params import MAX_SPEC_CHARS, GuidedDecodingParams, SamplingParams

MODEL = "neuron-default"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "colour": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "colour"],
    "additionalProperties": False,
}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
       "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": ADD}}]
PERSON_CHAT = [{"role": "user", "content": "Describe a person as JSON."}]
WEATHER_CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def structured_server():
    with LiveServer(real_engine(None, 1, max_model_len=1024)) as server:
        yield server.wait_ready()


def chat(server, messages=PERSON_CHAT, **kw):
    return client(server).chat.completions.create(model=MODEL, messages=messages, **kw)


# ---- each way of asking for structured output ----


def test_json_object_parses(structured_server):
    out = chat(structured_server, max_tokens=200, seed=2, response_format={"type": "json_object"})
    choice = out.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(json.loads(choice.message.content), dict)
    assert out.usage.completion_tokens > 10  # not just "{}": the random model wrote keys and values


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_json_schema_strict_validates(structured_server, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    kw = {"max_tokens": 100, "seed": 0, "response_format": fmt}
    if stream:
        chunks = list(chat(structured_server, stream=True, **kw))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        reason = next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)
    else:
        choice = chat(structured_server, **kw).choices[0]
        text, reason = choice.message.content, choice.finish_reason
    assert reason == "stop"
    jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize("field", ["guided_json", "response_format"])
def test_json_schema_on_completions(structured_server, field):
    body = {"guided_json": PERSON} if field == "guided_json" else {
        "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}}
    out = client(structured_server).completions.create(model=MODEL, prompt="A person:", max_tokens=100, seed=1,
                                                       extra_body=body)
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].text), PERSON)


def test_guided_regex_fullmatches(structured_server):
    pattern = r"[A-Z]{3}-[0-9]{4}( OK| FAIL)?"
    out = client(structured_server).completions.create(model=MODEL, prompt="The code is", max_tokens=30, seed=0,
                                                       extra_body={"guided_regex": pattern})
    assert re.fullmatch(pattern, out.choices[0].text)


def test_guided_choice_ends_with_the_choice(structured_server):
    choices = ["positive", "negative", "neutral"]
    out = chat(structured_server, max_tokens=30, seed=0, extra_body={"guided_choice": choices, "ignore_eos": True})
    # ignore_eos: only the grammar, which allows nothing after a whole choice, can end it
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].message.content in choices


def test_max_tokens_before_the_grammar_ends_is_length(structured_server):
    out = chat(structured_server, max_tokens=4, seed=0, extra_body={"guided_json": PERSON})
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 4
    assert out.choices[0].message.content.startswith('{"name":"')


# ---- forced tool calls ----


def _check_calls(calls, tools=TOOLS) -> list[str]:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    return [call.function.name for call in calls]


def test_tool_choice_required_returns_tool_calls(structured_server):
    out = chat(structured_server, WEATHER_CHAT, max_tokens=200, seed=4, tools=TOOLS, tool_choice="required")
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert _check_calls(choice.message.tool_calls) == ["get_weather", "add"]  # parallel calls are allowed


def test_tool_choice_named_calls_that_function(structured_server):
    named = {"type": "function", "function": {"name": "add"}}
    for seed in (0, 1):
        choice = chat(structured_server, WEATHER_CHAT, max_tokens=200, seed=seed, tools=TOOLS,
                      tool_choice=named).choices[0]
        assert choice.finish_reason == "tool_calls"
        assert _check_calls(choice.message.tool_calls) == ["add"]


def test_tool_with_nested_definitions(structured_server):
    """Parameters that refer to their own `$defs`, as pydantic writes nested models."""
    book = {"$defs": {"Author": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}},
                                 "required": ["name"], "additionalProperties": False}},
            "type": "object", "required": ["title", "author"], "additionalProperties": False,
            "properties": {"title": {"type": "string", "maxLength": 8}, "author": {"$ref": "#/$defs/Author"}}}
    tools = [*TOOLS, {"type": "function", "function": {"name": "add_book", "parameters": book}}]
    choice = chat(structured_server, WEATHER_CHAT, max_tokens=200, seed=0, tools=tools,
                  tool_choice={"type": "function", "function": {"name": "add_book"}}).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert _check_calls(choice.message.tool_calls, tools) == ["add_book"]


# ---- in a batch, and where the grammar work runs ----


async def test_constrained_and_free_requests_in_one_batch(structured_server):
    """The masks touch only their own rows: free requests decode the same tokens as alone."""
    c = async_client(structured_server)

    def free(i):
        return c.completions.create(model=MODEL, prompt=f"Story {i}:", max_tokens=12, temperature=0.9, seed=10 + i,
                                    logprobs=0, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})

    def constrained(i):
        return c.completions.create(model=MODEL, prompt=f"Person {i}:", max_tokens=100, seed=i,
                                    extra_body={"guided_json": PERSON})

    alone = [token_ids((await free(i)).choices[0].logprobs) for i in range(4)]
    outs = await asyncio.gather(*(f(i) for i in range(4) for f in (free, constrained)))
    assert [token_ids(o.choices[0].logprobs) for o in outs[0::2]] == alone
    for out in outs[1::2]:
        jsonschema.validate(json.loads(out.choices[0].text), PERSON)


def test_grammars_compile_off_the_loop_once(structured_server):
    structured = structured_server.engine.engine.structured
    schema = {**PERSON, "title": "compiled once"}  # a spec no other test compiled
    builds, build = [], structured._build

    def spy(*args):
        builds.append(threading.current_thread().name)
        return build(*args)

    structured._build = spy
    try:
        for seed in (0, 1):
            out = chat(structured_server, max_tokens=100, seed=seed, extra_body={"guided_json": schema})
            jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)
    finally:
        del structured._build
    # Once (the second request found it in the cache), in a worker thread: not the event loop's
    # (test-server), not the engine's.
    assert builds == ["AnyIO worker thread"]


# ---- refusals ----


def _format(schema):
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


@pytest.mark.parametrize("kw, param", [
    (_format({"type": "object", "properties": {"a": {"type": "frob"}}}), "response_format.json_schema.schema"),
    (_format({"type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}}),
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"extra_body": {"guided_regex": "a(b"}}, "guided_regex"),
    ({"extra_body": {"guided_json": "{not json"}}, "guided_json"),
    ({"extra_body": {"guided_choice": []}}, "guided_choice"),
    ({"extra_body": {"guided_regex": "x" * (MAX_SPEC_CHARS + 1)}}, "guided_regex"),
    (_format({"enum": ["x" * MAX_SPEC_CHARS]}), "response_format.json_schema.schema"),
    ({"extra_body": {"guided_json": PERSON, "guided_regex": "a"}}, "guided_regex"),
    ({"response_format": {"type": "json_object"}, "tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "frob"}}}],
      "tool_choice": "required"}, "tools"),
])
def test_bad_grammars_are_400(structured_server, kw, param):
    with pytest.raises(openai.BadRequestError) as err:
        chat(structured_server, max_tokens=5, **kw)
    assert err.value.status_code == 400 and err.value.body["param"] == param


# ---- the engine's side ----


@pytest.fixture(scope="module")
def offline_llm():
    from neuron import LLM

    with LLM(device="cpu", dtype="float32", max_model_len=512) as llm:
        yield llm


def test_offline_guided_json(offline_llm):
    params = SamplingParams(max_tokens=100, seed=1, guided_decoding=GuidedDecodingParams(json=PERSON))
    outs = offline_llm.generate(["A person:", "Another person:"], params)
    for out in outs:
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), PERSON)
    with pytest.raises(RequestError, match="guided_decoding.regex cannot be compiled"):
        offline_llm.generate("x", SamplingParams(guided_decoding=GuidedDecodingParams(regex="a(b")))


def test_a_grammar_past_its_limits_fails_its_sequence_alone(offline_llm):
    """This regex compiles, but its lexer runs out of room after the first token: that sequence
    ends with an error the request is to blame for, and the one beside it runs to the end."""
    engine = offline_llm.engine
    ids = engine.tokenizer.encode("Letters:")
    engine.add_request("bad", ids, SamplingParams(max_tokens=8, guided_decoding=GuidedDecodingParams(
        regex="a{1000}{1000}")))
    engine.add_request("free", ids, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    final = {}
    while engine.has_unfinished():
        final |= {u.request_id: u for u in engine.step() if u.finished}
    assert final["bad"].finish_reason == "error" and final["bad"].failure_kind == "invalid_request"
    assert final["bad"].error.startswith("structured output failed: lexer error")
    assert final["free"].finish_reason == "length" and final["free"].num_output_tokens == 8


def test_guided_decoding_params_take_one_constraint():
    with pytest.raises(ValueError, match="exactly one of"):
        GuidedDecodingParams(json=PERSON, regex="a")
    with pytest.raises(ValueError, match="exactly one of"):
        GuidedDecodingParams()


def test_a_row_masked_to_nothing_fails_alone():
    vocab = 40
    logits = torch.randn(3, vocab)
    samplers = [SequenceSampler(SamplingParams(temperature=0.0), [1], vocab) for _ in range(3)]
    bits = np.zeros((2, 2), dtype=np.int32)
    bits[0, 0] = 1 << 5  # row 0 may only take token 5; row 2 may take nothing
    result = sample(logits, samplers, allowed=TokenBitmask([0, 2], bits))
    assert result.token_ids[:2] == [5, int(logits[1].argmax())] and result.token_ids[2] == -1
    assert list(result.failed) == [2] and result.failed[2].by_request
    assert "grammar allows no token" in result.failed[2].message


def _random_mask(rows: int, words: int) -> np.ndarray:
    return np.random.default_rng(0).integers(-(2**31), 2**31, size=(rows, words), dtype=np.int64).astype(np.int32)


def test_mask_bias_follows_the_bits():
    """Bit t of the mask (word t // 32, bit t % 32) allows token t; ids past the mask never are."""
    from neuron.engine.sampling import mask_bias

    bits = _random_mask(3, 5)
    for vocab in (160, 150, 170):  # the mask's width, less, and more
        expected = [[0.0 if t < 160 and (int(bits[r, t // 32]) >> (t % 32)) & 1 else float("-inf")
                     for t in range(vocab)] for r in range(3)]
        assert mask_bias(bits, vocab, torch.device("cpu")).tolist() == expected


@pytest.mark.gpu
def test_mask_bias_on_the_gpu_equals_the_cpu():
    from neuron.engine.sampling import mask_bias

    bits = _random_mask(64, 4748)  # a 151,936-token vocabulary
    on_gpu = mask_bias(bits, 151_936, torch.device("cuda")).cpu()
    assert torch.equal(on_gpu, mask_bias(bits, 151_936, torch.device("cpu")))
