"""Ollama's API through the official `ollama` client: chat and generate, streamed (NDJSON, the
default) and not, with the same tokens as /v1/chat/completions and /v1/completions; options, stop
strings, format (JSON and a schema), tools and tool results, think, logprobs; tags, ps, show and
version; keep_alive on an on-demand model; pull refused, embed refused to a generation model (see
test_embeddings for an embedding model's); bad input in Ollama's error
shape; an oversized body and a client leaving mid-stream. Also vLLM's /tokenizer_info, as lm-eval's
remote tokenizer reads it."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import datetime, timezone

import httpx
import jsonschema
import ollama
import pytest
from family_chat import formatless_tokenizer
from server_harness import (
    ERROR,
    LiveServer,
    ScriptedEngine,
    ServeProcess,
    client,
    metric,
    ollama_client,
    real_engine,
    scripted_engine,
    wait_until,
)

from neuron.engine.async_engine import AsyncEngine
from neuron.engine.engine_config import EngineConfig
from neuron.engine.host import ModelHost, ModelSpec
from neuron.entrypoints.openai.app import ServerConfig
from neuron.entrypoints.openai.ollama import OLLAMA_API_VERSION
from neuron.entrypoints.openai.ollama.models import parse_keep_alive
from neuron.utils.default_checkpoint import default_model_dir

MODEL = "neuron-default"
MAX_MODEL_LEN = 1024
BODY_LIMIT = 1 << 20
GREEDY = {"temperature": 0, "num_predict": 6}
HI = [{"role": "user", "content": "Tell me about rivers."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
# What the scripted model writes, by what its prompt holds.
SCRIPTS = {
    "<tool_response>\nsunny": ["It is ", "sunny in Paris."],  # a tool result fed back
    "Weather in Paris?": ["<tool_call>", '\n{"name": "get_weather", ', '"arguments": {"city": "Paris"}}\n',
                          "</tool_call>"],
    "<think>\n\n</think>": ["Paris."],  # the template's reasoning switch, off
    "Capital of France?": ["<think>", "The capital ", "is Paris.", "</think>", "\n\n", "Paris."],
    "Break now": ["partial ", "answer", ERROR],  # a rank fails mid-answer
}


@pytest.fixture(scope="module")
def ollama_server():
    """The default model at tp 2."""
    cfg = ServerConfig(max_body_bytes=BODY_LIMIT)
    with LiveServer(real_engine(None, 2, max_model_len=MAX_MODEL_LEN), cfg) as server:
        yield server.wait_ready()


@pytest.fixture(scope="module")
def scripted_server(default_tokenizer):
    """The default model's tokenizer and template, with replies written in advance (SCRIPTS), behind
    an API key."""
    with LiveServer(scripted_engine(ScriptedEngine(default_tokenizer, SCRIPTS)), ServerConfig(api_key="k")) as server:
        yield server.wait_ready(10)


def keyed(server) -> ollama.Client:
    return ollama_client(server, headers={"Authorization": "Bearer k"})


def lines(server, path: str, body: dict) -> list[dict]:
    """The NDJSON objects of a streamed answer, read as they come."""
    with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "application/x-ndjson", r.read()
        return [json.loads(line) for line in r.iter_lines()]


def refused(call) -> ollama.ResponseError:
    with pytest.raises(ollama.ResponseError) as err:
        call()
    return err.value


def tokens(logprobs) -> list[str]:
    return [lp.token for lp in logprobs]


# ---- chat and generate: the chat path's tokens, streamed and not ----


def test_chat_gives_the_openai_chats_tokens_and_counts(ollama_server):
    out = ollama_client(ollama_server).chat(MODEL, HI, options=GREEDY, logprobs=True, top_logprobs=2)
    want = client(ollama_server).chat.completions.create(model=MODEL, messages=HI, temperature=0, max_tokens=6,
                                                         logprobs=True, top_logprobs=2)
    entries = want.choices[0].logprobs.content
    assert [(lp.token, [t.token for t in lp.top_logprobs]) for lp in out.logprobs] == [
        (t.token, [a.token for a in t.top_logprobs]) for t in entries]
    # equal up to float rounding (a request that finds its prompt cached computes less of it)
    assert [lp.logprob for lp in out.logprobs] == pytest.approx([t.logprob for t in entries], abs=1e-4)
    assert out.message.role == "assistant" and out.message.content == (want.choices[0].message.content or "")
    assert (out.prompt_eval_count, out.eval_count) == (want.usage.prompt_tokens, want.usage.completion_tokens)
    assert out.done and out.done_reason == {"length": "length", "stop": "stop"}[want.choices[0].finish_reason]
    assert out.total_duration >= out.prompt_eval_duration + out.eval_duration > 0 and out.load_duration >= 0


def test_a_final_assistant_message_is_continued_as_ollama_does(ollama_server):
    """Ollama continues a chat's last assistant message (a prefill): the same tokens as vLLM's
    continue_final_message on the OpenAI route, the reply without the prefill."""
    started = [*HI, {"role": "assistant", "content": "Rivers are"}]
    out = ollama_client(ollama_server).chat(MODEL, started, options=GREEDY)
    want = client(ollama_server).chat.completions.create(
        model=MODEL, messages=started, temperature=0, max_tokens=6,
        extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert out.message.content == want.choices[0].message.content
    assert out.prompt_eval_count == want.usage.prompt_tokens
    fresh = client(ollama_server).chat.completions.create(model=MODEL, messages=started, temperature=0, max_tokens=6)
    assert fresh.usage.prompt_tokens > out.prompt_eval_count  # a new turn would have opened after it


def test_a_streamed_chat_is_ndjson_ending_with_the_counts(ollama_server):
    whole = ollama_client(ollama_server).chat(MODEL, HI, options=GREEDY, logprobs=True)
    parts = lines(ollama_server, "/api/chat", {"model": MODEL, "messages": HI, "options": GREEDY, "logprobs": True})
    assert [p["done"] for p in parts] == [False] * (len(parts) - 1) + [True]
    assert "".join(p["message"]["content"] for p in parts) == whole.message.content
    assert [lp["token"] for p in parts for lp in p.get("logprobs", [])] == tokens(whole.logprobs)
    last = parts[-1]
    assert (last["done_reason"], last["eval_count"], last["prompt_eval_count"]) == (
        whole.done_reason, whole.eval_count, whole.prompt_eval_count)
    assert all(isinstance(last[k], int) for k in ("total_duration", "load_duration", "prompt_eval_duration",
                                                  "eval_duration"))
    datetime.fromisoformat(last["created_at"])  # RFC 3339
    # and through the client, a model named as Ollama's clients name it
    streamed = list(ollama_client(ollama_server).chat(f"{MODEL}:latest", HI, options=GREEDY, stream=True))
    assert "".join(p.message.content for p in streamed) == whole.message.content and streamed[-1].done


def test_generate_is_a_one_turn_chat_and_raw_is_a_completion(ollama_server):
    c, openai = ollama_client(ollama_server), client(ollama_server)
    out = c.generate(MODEL, "The river", system="Be brief.", options=GREEDY)
    want = openai.chat.completions.create(model=MODEL, temperature=0, max_tokens=6, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "The river"}])
    assert out.response == (want.choices[0].message.content or "") and out.eval_count == want.usage.completion_tokens
    assert out.context is None  # deprecated by Ollama, not returned
    raw = c.generate(MODEL, "The river", raw=True, options={**GREEDY, "stop": ["\n\n\n"]})
    text = openai.completions.create(model=MODEL, prompt="The river", temperature=0, max_tokens=6, stop=["\n\n\n"])
    assert raw.response == text.choices[0].text and raw.prompt_eval_count == text.usage.prompt_tokens
    parts = list(c.generate(MODEL, "The river", raw=True, options=GREEDY, stream=True))
    assert "".join(p.response for p in parts) == c.generate(MODEL, "The river", raw=True, options=GREEDY).response


def test_options_map_onto_the_sampling_params(ollama_server):
    c, openai = ollama_client(ollama_server), client(ollama_server)
    sampled = {"temperature": 1.0, "top_p": 0.9, "top_k": 50, "seed": 7, "num_predict": 8, "repeat_penalty": 1.3,
               "presence_penalty": 0.5, "frequency_penalty": 0.2, "num_ctx": 99999, "num_gpu": 1}  # last two ignored
    out = c.generate(MODEL, "The river", raw=True, options=sampled, logprobs=True)
    want = openai.completions.create(model=MODEL, prompt="The river", temperature=1.0, top_p=0.9, seed=7, max_tokens=8,
                                     presence_penalty=0.5, frequency_penalty=0.2, logprobs=0,
                                     extra_body={"top_k": 50, "repetition_penalty": 1.3})
    assert tokens(out.logprobs) == want.choices[0].logprobs.tokens and out.eval_count == 8
    # greedy, the tiny model repeats the prompt's last word; repeat_penalty stops that, as vLLM's does
    repeats = c.generate(MODEL, "The river", raw=True, options={"temperature": 0, "num_predict": 5}).response
    penalised = c.generate(MODEL, "The river", raw=True, options={"temperature": 0, "num_predict": 5,
                                                                 "repeat_penalty": 2.0}).response
    assert repeats == " river" * 5 and " river" not in penalised
    assert penalised == openai.completions.create(model=MODEL, prompt="The river", temperature=0, max_tokens=5,
                                                  extra_body={"repetition_penalty": 2.0}).choices[0].text
    # over the last repeat_last_n tokens only (64 unless given): neuron's repetition_window
    windowed = c.generate(MODEL, "The river", raw=True, options={"temperature": 0, "num_predict": 8,
                                                                "repeat_penalty": 2.0, "repeat_last_n": 2}).response
    assert windowed == openai.completions.create(model=MODEL, prompt="The river", temperature=0, max_tokens=8,
                                                 extra_body={"repetition_penalty": 2.0, "repetition_window": 2}
                                                 ).choices[0].text
    # a stop string cuts the text before it, and the answer ends as "stop"
    full = c.generate(MODEL, "The river", raw=True, options={"temperature": 0, "num_predict": 12}).response
    stop = next(full[k: k + 3] for k in range(2, len(full) - 3) if full.index(full[k: k + 3]) == k)
    cut = c.generate(MODEL, "The river", raw=True, options={"temperature": 0, "num_predict": 12, "stop": [stop]})
    assert cut.response == full[: full.index(stop)] and cut.done_reason == "stop"
    short = c.generate(MODEL, "The river", raw=True, options={"temperature": 0, "num_predict": 3})
    assert (short.done_reason, short.eval_count) == ("length", 3)


def test_format_holds_the_reply_to_json_or_a_schema(ollama_server):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    c = ollama_client(ollama_server)
    out = c.chat(MODEL, HI, format=schema, options={"temperature": 0, "num_predict": 20})
    jsonschema.validate(json.loads(out.message.content), schema)
    assert out.done_reason == "stop"
    parts = list(c.generate(MODEL, "Answer in JSON.", format=schema, options={"temperature": 0.8, "seed": 3,
                                                                            "num_predict": 20}, stream=True))
    jsonschema.validate(json.loads("".join(p.response for p in parts)), schema)
    any_json = c.chat(MODEL, HI, format="json", options={"temperature": 0, "num_predict": 3})
    assert any_json.message.content.startswith("{")
    colours = {"enum": ["red", "green", "blue"]}  # raw: the prompt as it is, the format held all the same
    raw = c.generate(MODEL, "My favourite colour is", raw=True, format=colours, options={"temperature": 0.8, "seed": 3,
                                                                                        "num_predict": 20})
    assert json.loads(raw.response) in colours["enum"] and raw.done_reason == "stop"


# ---- tools, tool results and think (a scripted model, behind an API key) ----


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_come_back_with_their_arguments_as_objects(scripted_server, stream):
    c = keyed(scripted_server)
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    if stream:
        parts = list(c.chat("stub", ask, tools=[WEATHER], stream=True))
        calls = [call for p in parts for call in p.message.tool_calls or []]
        content, last = "".join(p.message.content for p in parts), parts[-1]
    else:
        last = c.chat("stub", ask, tools=[WEATHER])
        calls, content = last.message.tool_calls, last.message.content
    assert [(call.function.name, call.function.arguments) for call in calls] == [("get_weather", {"city": "Paris"})]
    assert content == "" and last.done_reason == "stop"
    # without tools the same reply is text
    assert c.chat("stub", ask).message.content == CALL


def test_a_tool_result_is_fed_back_through_the_template(scripted_server):
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
               {"role": "tool", "content": "sunny", "tool_name": "get_weather"}]
    out = keyed(scripted_server).chat("stub", history, tools=[WEATHER])
    assert out.message.content == "It is sunny in Paris." and not out.message.tool_calls
    # the rendered prompt held the call as the template writes it, its arguments an object
    tokenized = httpx.post(f"{scripted_server.url}/tokenize", headers={"Authorization": "Bearer k"}, json={
        "messages": [history[0], {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "content": "sunny"}], "tools": [WEATHER]}).json()
    assert out.prompt_eval_count == tokenized["count"]


@pytest.mark.parametrize("stream", [False, True])
def test_think_puts_the_reasoning_in_thinking(scripted_server, stream):
    c = keyed(scripted_server)
    ask = [{"role": "user", "content": "Capital of France?"}]
    if stream:
        parts = list(c.chat("stub", ask, think=True, stream=True))
        thinking = "".join(p.message.thinking or "" for p in parts)
        content = "".join(p.message.content for p in parts)
    else:
        out = c.chat("stub", ask, think=True)
        thinking, content = out.message.thinking, out.message.content
    assert (thinking, content) == ("The capital is Paris.", "Paris.")
    assert keyed(scripted_server).chat("stub", ask, think="high").message.thinking == "The capital is Paris."
    generated = c.generate("stub", "Capital of France?", think=True)
    assert (generated.thinking, generated.response) == ("The capital is Paris.", "Paris.")
    # think false is the template's switch: the prompt closes the reasoning before the reply
    off = c.chat("stub", ask, think=False)
    assert (off.message.content, off.message.thinking) == ("Paris.", None)


def test_a_failure_mid_answer_is_an_error_line_or_a_503(scripted_server):
    c, ask = keyed(scripted_server), [{"role": "user", "content": "Break now"}]
    got = []
    with pytest.raises(ollama.ResponseError) as err:
        for part in c.chat("stub", ask, stream=True):
            got.append(part.message.content)
    assert "".join(got) == "partial answer" and "generation failed: rank 1 exited" in err.value.error
    whole = refused(lambda: c.generate("stub", "Break now"))
    assert whole.status_code == 503 and "rank 1 exited" in whole.error


def test_think_is_refused_to_a_model_that_cannot_think():
    with LiveServer(scripted_engine(ScriptedEngine(formatless_tokenizer(), {}))) as server:
        c = ollama_client(server.wait_ready(10))
        err = refused(lambda: c.chat("stub", HI, think=True))
        assert err.status_code == 400 and err.error == '"stub" does not support thinking'
        assert c.chat("stub", HI, think=False).message.content == "ok"
        err = refused(lambda: c.chat("stub", HI, tools=[WEATHER]))
        assert err.status_code == 400 and "no tool-call format" in err.error


def test_the_api_key_guards_the_ollama_routes(scripted_server):
    for call in (lambda c: c.list(), lambda c: c.chat("stub", HI)):
        err = refused(lambda: call(ollama_client(scripted_server)))
        assert err.status_code == 401 and "API key" in err.error
    assert [m.model for m in keyed(scripted_server).list().models] == ["stub"]


# ---- the models: tags, ps, show, version ----


def test_tags_ps_and_show_describe_the_served_model(ollama_server):
    c = ollama_client(ollama_server)
    [tag] = c.list().models
    assert tag.model == MODEL and tag.size > 0 and len(tag.digest) == 64
    assert (tag.details.format, tag.details.family, tag.details.quantization_level) == ("safetensors", "qwen3", "F32")
    raw_tags = httpx.get(f"{ollama_server.url}/api/tags").json()["models"][0]
    assert (raw_tags["name"], raw_tags["status"]) == (MODEL, "ready")
    [running] = c.ps().models
    assert running.model == MODEL and running.context_length == MAX_MODEL_LEN and running.size_vram == 0
    assert running.size > tag.size  # the weights and the KV cache
    assert running.expires_at.year == 2318  # a model loaded at start-up stays,
    c.chat(MODEL, HI, options={"num_predict": 1}, keep_alive=0)
    assert c.ps().models[0].expires_at.year == 2318  # whatever keep_alive says
    shown = c.show(MODEL)
    assert shown.capabilities == ["completion", "tools", "thinking"]
    assert shown.template == ollama_server.engine.tokenizer.chat_template
    assert shown.modelinfo["general.architecture"] == "qwen3"
    assert shown.modelinfo["qwen3.context_length"] == MAX_MODEL_LEN and shown.modelinfo["qwen3.block_count"] == 2
    assert "temperature 0.6" in shown.parameters.splitlines()  # generation_config.json's
    assert c.show(f"{MODEL}:latest").template == shown.template
    assert refused(lambda: c.show("missing")).status_code == 404


def test_version_names_the_ollama_api_it_follows(ollama_server):
    body = httpx.get(f"{ollama_server.url}/api/version").json()
    assert body["version"] == OLLAMA_API_VERSION and body["neuron"]


# ---- keep_alive on a model that loads on demand ----


def test_keep_alive_parses_seconds_and_durations():
    assert parse_keep_alive(30) == 30.0 and parse_keep_alive("5m") == 300.0 and parse_keep_alive("1h30m") == 5400.0
    assert parse_keep_alive(-1) is None and parse_keep_alive("-1m") is None and parse_keep_alive("0") == 0.0
    assert parse_keep_alive("90") == 90.0 and parse_keep_alive("1.5s") == 1.5


def test_keep_alive_sets_how_long_an_on_demand_model_stays(default_tokenizer):
    def scripted(model, spec) -> AsyncEngine:
        return AsyncEngine(lambda: ScriptedEngine(default_tokenizer, {}), model_name=spec.name, max_running=4,
                           max_waiting=4)

    defaults = EngineConfig(device="cpu", dtype="float32", max_model_len=128)
    spec = ModelSpec.parse({"name": "m", "model": str(default_model_dir()), "load": "on_demand"}, defaults, "test")
    host = ModelHost([spec], defaults=defaults, make_engine=scripted)
    with LiveServer(host) as server:
        c = ollama_client(server)
        assert c.ps().models == [] and c.list().models[0].model == "m"
        unloaded = c.show("m")  # what its spec says, without loading it
        assert (unloaded.capabilities, unloaded.template, host.models["m"].status) == (["completion"], "", "available")
        loaded = c.generate("m", "")  # an empty prompt loads the model
        assert (loaded.done, loaded.done_reason, loaded.response) == (True, "load", "")
        assert host.models["m"].status == "ready" and c.ps().models[0].model == "m"
        out = c.chat("m", HI, keep_alive="10m")
        assert out.message.content == "ok"
        expires = c.ps().models[0].expires_at
        assert 590 < (expires - datetime.now(timezone.utc)).total_seconds() <= 600
        c.chat("m", HI, keep_alive=-1)
        assert c.ps().models[0].expires_at.year == 2318
        unloading = c.chat("m", [], keep_alive=0)  # no messages: load, or with keep_alive 0, unload
        assert unloading.done_reason == "unload"
        wait_until(lambda: host.models["m"].status == "available", 10, "keep_alive 0 did not unload the model")
        assert c.ps().models == []
        assert c.chat("m", HI).message.content == "ok"  # it loads again, with its own keep_alive (5 minutes)
        assert host.models["m"].keep_alive_s == 300


# ---- what neuron does not do ----


def test_pull_and_the_other_model_management_routes_are_refused(ollama_server):
    c = ollama_client(ollama_server)
    for call in (lambda: c.pull(MODEL), lambda: c.push(MODEL), lambda: c.delete(MODEL), lambda: c.copy(MODEL, "x")):
        err = refused(call)
        assert err.status_code == 403 and "never downloads" in err.error
    streamed = refused(lambda: list(c.pull(MODEL, stream=True)))
    assert streamed.status_code == 403
    err = refused(lambda: c.embed(MODEL, "hello"))  # a generation model (embed_server's model embeds)
    assert err.status_code == 400 and "is a generation model" in err.error


BAD = [
    ("/api/chat", {"model": MODEL, "messages": "hi"}, 400, "messages"),
    ("/api/chat", {"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]}, 400, "role"),
    ("/api/chat", {"model": MODEL, "messages": HI, "options": {"temperature": "hot"}}, 400, "temperature"),
    ("/api/chat", {"model": MODEL, "messages": HI, "options": {"temperature": -1}}, 400, "options.temperature"),
    ("/api/chat", {"model": MODEL, "messages": HI, "options": {"repeat_penalty": 0}}, 400, "options.repeat_penalty"),
    ("/api/chat", {"model": MODEL, "messages": HI, "options": {"mirostat": 2}}, 400, "options.mirostat"),
    ("/api/chat", {"model": MODEL, "messages": HI, "options": {"num_predict": 0}}, 400, "options.num_predict"),
    ("/api/chat", {"model": MODEL, "messages": HI, "options": {"repeat_penalty": 1.2, "repeat_last_n": -5}}, 400,
     "options.repeat_last_n"),
    ("/api/chat", {"model": MODEL, "messages": HI, "format": "xml"}, 400, "format"),
    ("/api/chat", {"model": MODEL, "messages": HI, "format": {"type": 7}}, 400, "format"),
    ("/api/chat", {"model": MODEL, "messages": HI, "think": "max"}, 400, "think"),
    ("/api/chat", {"model": MODEL, "messages": HI, "keep_alive": "5 minutes"}, 400, "keep_alive"),
    ("/api/chat", {"model": MODEL, "messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]}, 400,
     "images"),
    ("/api/chat", {"model": "missing", "messages": HI}, 404, "missing"),
    ("/api/chat", {"messages": HI}, 400, "model"),
    ("/api/generate", {"model": MODEL, "prompt": "hi", "suffix": "end"}, 400, "suffix"),
    ("/api/generate", {"model": MODEL, "prompt": "hi", "template": "{{ .Prompt }}"}, 400, "template"),
    ("/api/generate", {"model": MODEL, "prompt": "hi", "context": [1, 2]}, 400, "context"),
    ("/api/generate", {"model": MODEL, "prompt": 5}, 400, "prompt"),
    ("/api/generate", {"model": MODEL, "prompt": "hi", "raw": True, "logprobs": True, "top_logprobs": -1}, 400,
     "top_logprobs must be in [0, 20]"),
    ("/api/generate", {"model": MODEL, "prompt": "hi", "raw": True, "format": {"type": "nope"}}, 400,
     "format cannot be compiled"),
    ("/api/generate", {"model": MODEL, "prompt": "hi", "raw": True, "options": {"stop": [""]}}, 400,
     "options.stop must be a list of non-empty strings"),
]


@pytest.mark.parametrize(("path", "body", "status", "word"), BAD, ids=[f"{p}-{w}" for p, _, _, w in BAD])
def test_bad_input_gets_ollamas_error_shape(ollama_server, path, body, status, word):
    r = httpx.post(f"{ollama_server.url}{path}", json=body)
    assert r.status_code == status and list(r.json()) == ["error"], r.text
    assert word in r.json()["error"], r.text


def test_the_client_raises_bad_input_as_a_response_error(ollama_server):
    c = ollama_client(ollama_server)
    err = refused(lambda: c.chat(MODEL, HI, options={"mirostat": 2}))
    assert (err.status_code, err.error) == (400, "options.mirostat is not supported (neuron samples with temperature, "
                                                 "top_k, top_p and min_p); leave it at 0")
    err = refused(lambda: list(c.generate(MODEL, "hi", options={"top_p": 2.0}, stream=True)))
    assert (err.status_code, err.error) == (400, "options.top_p must be in (0, 1], got 2.0")
    err = refused(lambda: c.chat("nope", HI))
    assert err.status_code == 404 and f"serves `{MODEL}`" in err.error


def test_the_error_shape_holds_for_broken_bodies_and_unknown_paths(ollama_server):
    r = httpx.post(f"{ollama_server.url}/api/chat", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]
    r = httpx.post(f"{ollama_server.url}/api/chat", content=json.dumps({"model": MODEL, "messages": HI}))
    assert r.status_code == 415 and "application/json" in r.json()["error"]
    r = httpx.get(f"{ollama_server.url}/api/nothing")
    assert r.status_code == 404 and list(r.json()) == ["error"]


def test_an_oversized_body_is_refused_with_413(ollama_server):
    big = "x" * (BODY_LIMIT + 1)
    for path, body in (("/api/chat", {"model": MODEL, "messages": [{"role": "user", "content": big}]}),
                       ("/api/generate", {"model": MODEL, "prompt": big})):
        r = httpx.post(f"{ollama_server.url}{path}", json=body)
        assert r.status_code == 413 and "limit" in r.json()["error"], r.text


async def test_a_client_leaving_mid_stream_aborts_its_request(ollama_server):
    before = metric(ollama_server, 'neuron_request_finished_total{reason="abort"}')

    async def leave_after_the_first_line(path: str, body: dict) -> None:
        async with httpx.AsyncClient(timeout=60) as http:
            async with http.stream("POST", f"{ollama_server.url}{path}", json=body) as r:
                assert r.status_code == 200
                async for _ in r.aiter_lines():
                    return

    long = {"temperature": 1.0, "num_predict": 400, "seed": 1}
    await asyncio.gather(leave_after_the_first_line("/api/generate", {"model": MODEL, "prompt": "Once", "raw": True,
                                                                      "options": long}),
                         leave_after_the_first_line("/api/chat", {"model": MODEL, "messages": HI, "options": long,
                                                                  "think": False}))
    wait_until(lambda: metric(ollama_server, 'neuron_request_finished_total{reason="abort"}') - before == 2, 20,
               "the streams were not aborted")
    wait_until(lambda: not metric(ollama_server, "neuron_num_requests_running"), 20, "aborted requests still run")


# ---- vLLM's /tokenizer_info ----


def test_tokenizer_info_is_the_tokenizer_config_lm_eval_reads(ollama_server):
    info = httpx.get(f"{ollama_server.url}/tokenizer_info").json()
    on_disk = json.loads((default_model_dir() / "tokenizer_config.json").read_text())
    assert info["eos_token"] == on_disk["eos_token"] == "<|im_end|>" and info["pad_token"] == "<|endoftext|>"
    assert "bos_token" in info and info["bos_token"] is None  # the checkpoint names none: null, not missing
    assert info["chat_template"] == on_disk["chat_template"] and info["model_max_length"] == MAX_MODEL_LEN
    assert info["added_tokens_decoder"] == on_disk["added_tokens_decoder"]
    assert info["tokenizer_class"]
    assert httpx.get(f"{ollama_server.url}/tokenizer_info", params={"model": MODEL}).json() == info
    # what lm-eval does next with it: the eos token's id from /tokenize
    ids = httpx.post(f"{ollama_server.url}/tokenize", json={"prompt": info["eos_token"]}).json()["tokens"]
    assert ids == [ollama_server.engine.tokenizer.eos_token_id]
    r = httpx.get(f"{ollama_server.url}/tokenizer_info", params={"model": "missing"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_generation_durations_are_nanoseconds(ollama_server):
    t0 = time.monotonic()
    out = ollama_client(ollama_server).chat(MODEL, HI, options=GREEDY)
    elapsed_ns = (time.monotonic() - t0) * 1e9
    assert 0 < out.total_duration <= elapsed_ns and out.eval_duration < out.total_duration


# ---- images, on a tiny vision checkpoint ----


@pytest.mark.slow
def test_images_in_messages_reach_a_vision_model(tmp_path):
    from vision_checkpoint import build_vision_checkpoint, image_data_uri

    path = build_vision_checkpoint(tmp_path / "vision", seed=7)
    uri = image_data_uri(20, 28, seed=1)
    with LiveServer(real_engine(str(path), 1, name="vision", max_model_len=128)) as server:
        server.wait_ready()
        c = ollama_client(server)
        assert "vision" in c.show("vision").capabilities
        out = c.chat("vision", [{"role": "user", "content": "What is in this picture?", "images": [
            uri.split(",", 1)[1]]}], options={"temperature": 0, "num_predict": 4}, logprobs=True)
        want = client(server).chat.completions.create(model="vision", temperature=0, max_tokens=4, logprobs=True,
                                                      messages=[{"role": "user", "content": [
                                                          {"type": "image_url", "image_url": {"url": uri}},
                                                          {"type": "text", "text": "What is in this picture?"}]}])
        assert tokens(out.logprobs) == [t.token for t in want.choices[0].logprobs.content]
        assert out.prompt_eval_count == want.usage.prompt_tokens > 20  # the image's placeholders expanded
        err = refused(lambda: c.chat("vision", [{"role": "user", "content": "?", "images": ["bm90IGFuIGltYWdl"]}]))
        assert err.status_code == 400 and "image" in err.error


@pytest.mark.slow
def test_the_ollama_client_against_neuron_serve_tp_2():
    with ServeProcess("--tp", "2", "--device", "cpu", "--dtype", "float32", "--max-model-len", "512") as server:
        c, openai = ollama_client(server), client(server)
        parts = list(c.chat(MODEL, HI, options=GREEDY, stream=True))
        want = openai.chat.completions.create(model=MODEL, messages=HI, temperature=0, max_tokens=6)
        assert "".join(p.message.content for p in parts) == (want.choices[0].message.content or "")
        assert parts[-1].done and parts[-1].eval_count == want.usage.completion_tokens
        raw = c.generate(MODEL, "The river", raw=True, options=GREEDY)
        assert raw.response == openai.completions.create(model=MODEL, prompt="The river", temperature=0,
                                                         max_tokens=6).choices[0].text
        assert [m.model for m in c.list().models] == [MODEL]
        [running] = c.ps().models
        assert running.model == MODEL and running.context_length == 512


def test_quantization_level_names_the_dtype_auto_resolves_to():
    """`dtype: auto` (the default) is float32 on a CPU and bfloat16 on CUDA: F32 or BF16, not AUTO,
    loaded or not."""
    from types import SimpleNamespace

    from neuron.entrypoints.openai.ollama import models

    spec = SimpleNamespace(dtype="auto", quantization=None, model="m", device="cpu", devices=None)
    cfg = SimpleNamespace(device="cpu", spec=spec, model_type="qwen3", gguf=None, quantization=None)
    loaded = SimpleNamespace(engine=SimpleNamespace(loaded=True, engine=SimpleNamespace(model=cfg)),
                             spec=SimpleNamespace(engine=spec))
    assert models._details(loaded)["quantization_level"] == "F32"
    cfg.device = "cuda:0"
    assert models._details(loaded)["quantization_level"] == "BF16"
    waiting = SimpleNamespace(engine=None, spec=SimpleNamespace(engine=replace_ns(spec, devices=["cuda:1"])))
    assert models._details(waiting)["quantization_level"] == "BF16"
    quantized = SimpleNamespace(engine=None, spec=SimpleNamespace(engine=replace_ns(spec, quantization="int8")))
    assert models._details(quantized)["quantization_level"] == "INT8"


def replace_ns(ns, **changes):
    return type(ns)(**{**vars(ns), **changes})
