"""Chat for the dense families on checkpoints with their own templates and tokenizers (built in
tests/family_chat.py): the template renders as transformers renders it, text prompts get the BOS
their tokenizer adds, tool calls come back as OpenAI `tool_calls` through the official client in
each family's format (forced by a grammar on the real model, and parsed from a scripted reply),
a model whose format is unknown is refused `auto` tools but served a forced tool_choice as vLLM
serves it (the grammar writes the call's JSON alone), and each of Llama 3's three stop ids ends a
generation."""

from __future__ import annotations

import json
import shutil

import jsonschema
import openai
import pytest
import torch
from family_chat import FAMILIES, LLAMA3_STOPS, build_family_checkpoint, formatless_tokenizer
from safetensors.torch import load_file, save_file
from server_harness import LiveServer, ScriptedEngine, client, real_engine, scripted_engine

from neuron.engine.structured_output import StructuredOutput
from neuron.engine.tokenizer import Tokenizer
from neuron.entrypoints.openai.api_types import ChatCompletionRequest
from neuron.entrypoints.openai.guided import guided_params
from neuron.entrypoints.openai.response_parser import tool_format

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
           "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "user", "content": "And now?"},
]
FORMATS = {"llama3": "json", "qwen2.5": "tags", "mistral": "mistral", "llama2": None}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
# What each family's model writes when it calls get_weather, in the pieces a stream might bring.
REPLIES = {
    "llama3": ['{"name": "get_weather", ', '"parameters": {"city": ', '"Paris"}}'],
    "qwen2.5": ["<tool_call>", '\n{"name": "get_weather", "arguments": ', '{"city": "Paris"}}\n', "</tool_call>"],
    "mistral": ["[TOOL_CALLS]", '[{"name": "get_weather", ', '"arguments": {"city": "Paris"}}]'],
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Each family's checkpoint, built once for the module when a test first asks for it."""
    built = {}

    def get(name: str):
        if name not in built:
            built[name] = build_family_checkpoint(tmp_path_factory.mktemp(name), name)
        return built[name]
    return get


@pytest.fixture(params=list(FAMILIES))
def family(request, checkpoints):
    return request.param, checkpoints(request.param)


@pytest.fixture(params=[name for name, fmt in FORMATS.items() if fmt])
def tool_family(request, checkpoints):
    """The families with a tool-call format of their own."""
    return request.param, checkpoints(request.param)


def test_the_template_renders_as_transformers(family):
    import transformers

    name, path = family
    ours = Tokenizer.from_dir(path)
    theirs = transformers.AutoTokenizer.from_pretrained(path)
    for messages, tools in ((HISTORY, TOOLS), (HISTORY[:2], None)):
        want = theirs.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        got = ours.apply_chat_template(messages, tools=tools, add_generation_prompt=True)
        assert got == want, name
        assert ours.encode(got) == theirs(want, add_special_tokens=False).input_ids
    assert tool_format(ours) == FORMATS[name]


def test_a_text_prompt_gets_the_bos_its_tokenizer_adds(family):
    import transformers

    from neuron import LLM, SamplingParams

    name, path = family
    text = "Hello there, how are you?"
    want = transformers.AutoTokenizer.from_pretrained(path)(text).input_ids
    with LLM(str(path), device="cpu", dtype="float32") as llm:
        [out] = llm.generate([text], SamplingParams(max_tokens=1, temperature=0.0))
    assert out.prompt_token_ids == want
    tok, bos = Tokenizer.from_dir(path), FAMILIES[name][4]
    assert want == ([tok.token_to_id(bos)] if bos else []) + tok.encode(text)


def test_special_tokens_decode_as_transformers_fast_tokenizers_with_either_spacing(family):
    """vLLM's spaces_between_special_tokens is taken; neuron decodes as transformers' fast tokenizers,
    for which it changes nothing (Metaspace ones included), streamed a token at a time or whole."""
    import transformers

    from neuron import SamplingParams
    from neuron.engine.tokenizer import IncrementalDetokenizer

    name, path = family
    ours, theirs = Tokenizer.from_dir(path), transformers.AutoTokenizer.from_pretrained(path)
    specials = [ours.token_to_id(t) for t in FAMILIES[name][2][:2]]
    ids = ours.encode("Hello world") + specials * 2 + ours.encode(" again")
    streamed = IncrementalDetokenizer(ours, [], skip_special_tokens=False)
    text = "".join(streamed.push(t) for t in ids) + streamed.flush()
    for spaces in (True, False):
        assert SamplingParams(spaces_between_special_tokens=spaces).spaces_between_special_tokens is spaces
        want = theirs.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=spaces)
        assert text == ours.decode(ids, skip_special_tokens=False) == want, name
    with pytest.raises(ValueError, match="spaces_between_special_tokens must be true or false"):
        SamplingParams(spaces_between_special_tokens="no")


MODEL_NAME = "llama3"


def test_add_special_tokens_on_the_openai_routes(checkpoints):
    """vLLM's add_special_tokens: a completion's text prompt has Llama 3's BOS unless it is false; a
    chat, whose template writes its own, gets the tokenizer's on top only when it is true."""
    path = checkpoints("llama3")
    tok = Tokenizer.from_dir(path)
    bos = tok.token_to_id("<|begin_of_text|>")
    messages = [{"role": "user", "content": "Hello there"}]
    with LiveServer(real_engine(str(path), 1, name=MODEL_NAME, max_model_len=256)) as server:
        server.wait_ready()
        api = client(server)
        text = "Hello there, how are you?"
        with_bos = api.completions.create(model=MODEL_NAME, prompt=text, max_tokens=1)
        without = api.completions.create(model=MODEL_NAME, prompt=text, max_tokens=1,
                                         extra_body={"add_special_tokens": False})
        assert with_bos.usage.prompt_tokens == len(tok.encode(text)) + 1 == without.usage.prompt_tokens + 1
        chat = api.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1)
        doubled = api.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1,
                                              extra_body={"add_special_tokens": True})
        rendered = tok.apply_chat_template(messages)
        assert chat.usage.prompt_tokens == len(tok.encode(rendered)) and rendered.startswith("<|begin_of_text|>")
        assert doubled.usage.prompt_tokens == chat.usage.prompt_tokens + 1 and bos is not None


@pytest.mark.slow
def test_forced_tool_calls_round_trip_through_the_openai_client(tool_family):
    """tool_choice holds the real model to its family's call format, which the parser then reads."""
    name, path = tool_family
    with LiveServer(real_engine(str(path), 1, max_model_len=512)) as server:
        server.wait_ready()
        api = client(server)
        for kwargs in (dict(tool_choice=NAMED), dict(tool_choice="required", parallel_tool_calls=False)):
            out = api.chat.completions.create(model=str(path), messages=HISTORY, tools=TOOLS, max_tokens=120,
                                              seed=1, **kwargs)
            choice = out.choices[0]
            assert choice.finish_reason == "tool_calls", (name, choice.message)
            assert choice.message.content is None
            [call] = choice.message.tool_calls
            schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call.function.name]
            jsonschema.validate(json.loads(call.function.arguments), schema)
        chunks = list(api.chat.completions.create(model=str(path), messages=HISTORY, tools=TOOLS, max_tokens=120,
                                                  tool_choice=NAMED, stream=True, seed=2))
        calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
        assert [c.function.name for c in calls] == ["get_weather"]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_a_reply_in_the_family_format_becomes_tool_calls(tool_family, stream):
    name, path = tool_family
    stub = ScriptedEngine(Tokenizer.from_dir(path), {"Paris": REPLIES[name]})
    with LiveServer(scripted_engine(stub)) as server:
        api = client(server.wait_ready(10))
        request = dict(model="stub", messages=HISTORY[:2], tools=TOOLS)
        if stream:
            chunks = list(api.chat.completions.create(stream=True, **request))
            calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            reason = chunks[-1].choices[0].finish_reason
        else:
            message = api.chat.completions.create(**request).choices[0]
            calls, content, reason = message.message.tool_calls, message.message.content or "", message.finish_reason
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
            ("get_weather", {"city": "Paris"})]
        assert content == "" and reason == "tool_calls"
        # Without tools the same reply is text (the special [TOOL_CALLS] is then skipped by decoding,
        # but a scripted reply is text already).
        plain = api.chat.completions.create(model="stub", messages=HISTORY[:2]).choices[0].message
        assert plain.content == "".join(REPLIES[name]) and not plain.tool_calls


def grammar_takes(tok: Tokenizer, text: str, **request) -> bool:
    """The grammar the request's tool_choice compiles to takes `text`, and then the end."""
    req = ChatCompletionRequest(model="m", messages=HISTORY[:2], tools=TOOLS, **request)
    guided, _ = guided_params(req, tok)
    eos = tok.token_to_id("<|eot|>")
    matcher = StructuredOutput(tok, tok.vocab_size, [eos]).compile(guided).matcher()
    ids = tok.encode(text) + [eos]
    return matcher.valid_prefix(ids) == len(ids)


def test_a_forced_choice_without_a_format_is_the_calls_json_alone():
    """vLLM's grammars: a named function's arguments object, or a list of {name, parameters}."""
    tok = formatless_tokenizer()
    assert grammar_takes(tok, '{"city":"Paris"}', tool_choice=NAMED)
    assert not grammar_takes(tok, '{"city": "Paris"}', tool_choice=NAMED)  # compact, like all its JSON
    assert not grammar_takes(tok, '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>',
                             tool_choice=NAMED)
    both = '[{"name":"get_weather","parameters":{"city":"Paris"}},{"name":"get_time","parameters":{}}]'
    assert grammar_takes(tok, both, tool_choice="required")
    assert not grammar_takes(tok, both, tool_choice="required", parallel_tool_calls=False)
    assert grammar_takes(tok, '[{"name":"get_time","parameters":{"at":1}}]', tool_choice="required",
                         parallel_tool_calls=False)
    assert not grammar_takes(tok, '[{"name":"get_weather","parameters":{}}]', tool_choice="required")


def test_tools_are_refused_where_the_call_format_is_unknown():
    """`auto` would leave the model to write calls in a format nobody reads; "none" is plain chat."""
    tok = formatless_tokenizer()
    assert tool_format(tok) is None
    with LiveServer(scripted_engine(ScriptedEngine(tok, {}))) as server:
        api = client(server.wait_ready(10))
        for choice in ({}, {"tool_choice": "auto"}):
            with pytest.raises(openai.BadRequestError) as err:
                api.chat.completions.create(model="stub", messages=HISTORY[:2], tools=TOOLS, **choice)
            assert err.value.body["param"] == "tools" and "tool-call format" in err.value.body["message"]
        out = api.chat.completions.create(model="stub", messages=HISTORY[:2], tools=TOOLS, tool_choice="none")
        assert out.choices[0].finish_reason == "stop"


# What the grammar has the model write, in the pieces a stream might bring.
ARGUMENTS = ['{"ci', 'ty":', '"Paris"}']
LISTED = ['[{"name":"get_weather",', '"parameters":{"city":"Paris"}},', '{"name":"get_time","parameters":{}}]']


def test_a_forced_choice_without_a_format_comes_back_as_tool_calls():
    """As vLLM answers a model without a tool parser: a named call is the reply's arguments
    (finish_reason "stop", as OpenAI ends a named choice), "required" a list of calls
    ("tool_calls"); streamed, a named call's arguments arrive as they are written."""
    stub = ScriptedEngine(formatless_tokenizer(), {"Named": ARGUMENTS, "Listed": LISTED})
    with LiveServer(scripted_engine(stub)) as server:
        api = client(server.wait_ready(10))

        def ask(text: str, **kw):
            return api.chat.completions.create(model="stub", messages=[{"role": "user", "content": text}],
                                               tools=TOOLS, **kw)

        choice = ask("Named", tool_choice=NAMED).choices[0]
        assert choice.finish_reason == "stop" and choice.message.content is None
        assert [(c.type, c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
            ("function", "get_weather", '{"city":"Paris"}')]
        chunks = list(ask("Named", tool_choice=NAMED, stream=True))
        deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
        assert [(d.index, d.id is not None, d.function.name, d.function.arguments) for d in deltas] == [
            (0, True, "get_weather", '{"ci'), (0, False, None, 'ty":'), (0, False, None, '"Paris"}')]
        assert chunks[-1].choices[0].finish_reason == "stop"

        choice = ask("Listed", tool_choice="required").choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
            ("get_weather", {"city": "Paris"}), ("get_time", {})]
        chunks = list(ask("Listed", tool_choice="required", stream=True))
        deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
        assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in deltas] == [
            (0, "get_weather", {"city": "Paris"}), (1, "get_time", {})]
        assert len({d.id for d in deltas}) == 2 and chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("tools, choice, param, words", [
    (TOOLS, {"type": "function", "function": {"name": "get_wether"}}, "tool_choice", "'get_wether'"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "frob"}}}],
     {"type": "function", "function": {"name": "f"}}, "tools", "cannot be compiled"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "frob"}}}], "required", "tools",
     "cannot be compiled"),
])
def test_a_bad_forced_choice_without_a_format_is_400(tools, choice, param, words):
    with LiveServer(scripted_engine(ScriptedEngine(formatless_tokenizer(), {}))) as server:
        api = client(server.wait_ready(10))
        with pytest.raises(openai.BadRequestError) as err:
            api.chat.completions.create(model="stub", messages=HISTORY[:2], tools=tools, tool_choice=choice)
        assert err.value.body["param"] == param and words in err.value.body["message"], err.value.body


@pytest.mark.slow
def test_forced_tool_calls_without_a_format_at_tp_2(checkpoints):
    """Llama 2 has no tool-call format: a named or "required" tool_choice is still served, through
    the official client, by the real model at tp 2 under the grammar."""
    path = checkpoints("llama2")
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    with LiveServer(real_engine(str(path), 2, max_model_len=512)) as server:
        api = client(server.wait_ready())
        request = dict(model=str(path), messages=HISTORY[:2], tools=TOOLS, max_tokens=120)
        choice = api.chat.completions.create(tool_choice=NAMED, seed=1, **request).choices[0]
        assert choice.finish_reason == "stop" and choice.message.content is None
        [call] = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)

        chunks = list(api.chat.completions.create(tool_choice=NAMED, stream=True, seed=2, **request))
        deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
        assert [d.function.name for d in deltas if d.function.name] == ["get_weather"] and deltas[0].id
        assert {d.index for d in deltas} == {0} and len(deltas) > 1  # the arguments come as they are written
        jsonschema.validate(json.loads("".join(d.function.arguments for d in deltas)), WEATHER)
        assert chunks[-1].choices[0].finish_reason == "stop"

        choice = api.chat.completions.create(tool_choice="required", parallel_tool_calls=False, seed=3,
                                             **request).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [call] = choice.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


@pytest.mark.slow
def test_each_of_llamas_three_stop_ids_ends_generation(tmp_path):
    """Llama 3 stops on <|end_of_text|>, <|eom_id|> and <|eot_id|> (generation_config lists all
    three). The head is untied and one row is set so that greedy decoding writes that stop id at
    once: a copy of the row of the token it would write, scaled to win."""
    import transformers

    from neuron import LLM, SamplingParams

    base = build_family_checkpoint(tmp_path / "base", "llama3")
    tok = Tokenizer.from_dir(base)
    prompt = tok.encode("Hello there", add_special_tokens=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1]
    first = int(logits.argmax())
    weights = load_file(base / "model.safetensors")
    embed = weights["model.embed_tokens.weight"]
    config = json.loads((base / "config.json").read_text())
    for stop in LLAMA3_STOPS:
        path = tmp_path / stop.strip("<|>")
        shutil.copytree(base, path)
        head = embed.clone()
        head[tok.token_to_id(stop)] = embed[first] * (1.1 if logits[first] > 0 else 0.9)
        save_file({**weights, "lm_head.weight": head}, path / "model.safetensors", metadata={"format": "pt"})
        (path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
        with LLM(str(path), device="cpu", dtype="float32") as llm:
            assert tok.token_to_id(stop) in llm.engine.model.eos_token_ids
            [out] = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=8, temperature=0.0))
        assert out.outputs[0].finish_reason == "stop", stop
        assert out.outputs[0].token_ids == [tok.token_to_id(stop)] and out.outputs[0].text == "", stop
