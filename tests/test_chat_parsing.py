"""The chat output parser (reasoning, content, tool calls) and message validation, without a server."""

from __future__ import annotations

import json
import random

import pytest

from neuron.entrypoints.openai.api_errors import APIError
from neuron.entrypoints.openai.chat_utils import normalise_messages
from neuron.entrypoints.openai.response_parser import (
    ForcedCallParser,
    OutputParser,
    Parsed,
    ParsedToolCall,
    parse_tool_call,
    prompt_opens_reasoning,
    tool_format,
)

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def parse(text: str, pieces: list[str] | None = None, **kw) -> Parsed:
    kw.setdefault("reasoning", True)
    parser = OutputParser(**kw)
    out = Parsed()
    for piece in pieces if pieces is not None else [text]:
        out.extend(parser.feed(piece))
    out.extend(parser.finish())
    return out


def random_pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(0, 12)))) if len(text) > 1 else []
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def test_reasoning_then_answer():
    out = parse("<think>\nLet me think.\n</think>\n\nThe answer is 4.")
    assert out.reasoning == "\nLet me think.\n"
    assert out.content == "The answer is 4."
    assert out.tool_calls == []


def test_no_think_tags_is_all_content():
    out = parse("Just an answer, no thinking.")
    assert (out.reasoning, out.content) == ("", "Just an answer, no thinking.")


def test_prompt_opened_think():
    """Templates that end the prompt with `<think>`: the output starts inside the reasoning."""
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")
    out = parse("considering...\n</think>\n\nDone.", in_reasoning=True)
    assert (out.reasoning, out.content) == ("considering...\n", "Done.")


def test_unterminated_reasoning_stays_reasoning():
    out = parse("<think>still going when max_tokens hit")
    assert (out.reasoning, out.content) == ("still going when max_tokens hit", "")


def test_think_tag_only_recognised_at_the_start():
    out = parse("Use the <think> tag like this.")
    assert out.content == "Use the <think> tag like this." and out.reasoning == ""


def test_reasoning_disabled_keeps_tags_as_text():
    out = parse("<think>x</think>y", reasoning=False)
    assert out.content == "<think>x</think>y" and out.reasoning == ""


def test_tool_call():
    out = parse(f"<think>need weather</think>\n\n{CALL}", tools="tags")
    assert out.reasoning == "need weather"
    assert out.content == ""
    assert len(out.tool_calls) == 1
    call = out.tool_calls[0]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}


def test_several_tool_calls_and_surrounding_text():
    second = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    out = parse(f"Let me check.\n{CALL}\n{second}\n", tools="tags")
    assert out.content == "Let me check."
    assert [c.name for c in out.tool_calls] == ["get_weather", "get_time"]
    assert json.loads(out.tool_calls[1].arguments) == {}


def test_pieces_keep_the_order_the_model_wrote():
    """Text written after a call in the same feed opens a piece of its own (the merged view joins it
    to the text before, which the chat route's separate fields cannot tell apart anyway)."""
    second = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    text = f"<think>hm</think>\n\nBefore.\n{CALL}\nBetween.\n{second}\nAfter."
    parser = OutputParser(reasoning=True, tools="tags")
    pieces = parser.feed_in_order(text) + parser.finish_in_order()
    shown = [(p.reasoning, p.content, [c.name for c in p.tool_calls]) for p in pieces if p]
    assert shown == [("hm", "Before.", ["get_weather"]), ("", "Between.", ["get_time"]), ("", "After.", [])]
    assert parse(text, tools="tags").content == "Before.Between.After."
    forced = ForcedCallParser(None)
    pieces = forced.feed_in_order('[{"name": "a", "parameters": {}}, {"oops": 1}') + forced.finish_in_order()
    assert [(p.content, [c.name for c in p.tool_calls]) for p in pieces if p] == [("", ["a"]), ('{"oops": 1}', [])]


def test_invalid_tool_json_stays_content():
    bad = "<tool_call>\n{not json}\n</tool_call>"
    out = parse(f"before {bad} after", tools="tags")
    assert out.content == f"before {bad} after"
    assert out.tool_calls == []


def test_unclosed_tool_call_is_content():
    out = parse('text <tool_call>{"name": "f", "arguments": {}', tools="tags")
    assert out.content == 'text <tool_call>{"name": "f", "arguments": {}'
    assert out.tool_calls == []


def test_tool_tags_are_text_without_tools():
    out = parse(CALL, tools=None)
    assert out.content == CALL and out.tool_calls == []


def test_trailing_whitespace_kept_without_tool_call():
    assert parse("Hello\n", tools="tags").content == "Hello\n"
    assert parse("Hello\n", tools=None).content == "Hello\n"


def test_arguments_given_as_string():
    call = parse_tool_call('{"name": "f", "arguments": "{\\"x\\": 1}"}')
    assert call is not None and json.loads(call.arguments) == {"x": 1}
    assert parse_tool_call('{"name": "f", "arguments": "not json"}') is None
    assert parse_tool_call('{"arguments": {}}') is None
    assert parse_tool_call("[1, 2]") is None


@pytest.mark.parametrize("text,kw", [
    ("<think>\nLet me think.\n</think>\n\nThe answer is 4.", {}),
    (f"  <think>a<b</think>\n\nx <tool_call> y {CALL}\n{CALL} tail <tool_ca", {"tools": "tags"}),
    ("plain </think> text <thin", {}),
    ("more reasoning</think>\n\nanswer <tool_call>{}</tool_call>", {"in_reasoning": True, "tools": "tags"}),
    ("<thi", {}),
    ("\n\n", {"tools": "tags"}),
    (' \n{"name": "f", "parameters": {"x": [1, 2]}}; {"name": "g", "parameters": {}}', {"tools": "json"}),
    ('I will not call {"name": "f"}', {"tools": "json"}),
    ('Checking. [TOOL_CALLS][{"name": "f", "arguments": {"a": "[b]"}}]', {"tools": "mistral"}),
    ('[TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[ARGS]{}', {"tools": "mistral"}),
    ("[TOOL_CALL", {"tools": "mistral"}),
])
def test_any_split_parses_like_the_whole(text, kw):
    """Streaming equals non-streaming: every way of cutting the text gives the same result."""
    whole = parse(text, **kw)
    rng = random.Random(0)
    for _ in range(200):
        assert parse(text, random_pieces(text, rng), **kw) == whole
    assert parse(text, list(text), **kw) == whole


def test_messages_developer_role_and_text_parts():
    msgs, images = normalise_messages([
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ])
    assert msgs[0]["role"] == "system"
    assert msgs[1]["content"] == "a\nb" and images == []


def test_messages_keep_their_image_parts():
    msgs, images = normalise_messages([
        {"role": "system", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "user", "content": [
            {"type": "text", "text": "compare"},
            {"type": "image_url", "image_url": {"url": "data:one", "detail": "low"}},
            {"type": "image_url", "image_url": "data:two"},
        ]},
        {"role": "user", "content": [{"type": "input_image", "image_url": "data:three"}]},
    ], vision=True)
    assert msgs[0]["content"] == "a\nb"  # no images: the joined string, as without vision
    assert msgs[1]["content"] == [{"type": "text", "text": "compare"}, {"type": "image"}, {"type": "image"}]
    assert msgs[2]["content"] == [{"type": "image"}]
    assert images == ["data:one", "data:two", "data:three"]


@pytest.mark.parametrize("part", [{"type": "image_url"}, {"type": "image_url", "image_url": {}},
                                  {"type": "image_url", "image_url": {"url": 3}}, {"type": "input_image"},
                                  {"type": "image", "image_url": ""}])
def test_image_parts_need_a_url(part):
    with pytest.raises(APIError) as e:
        normalise_messages([{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}], vision=True)
    assert e.value.status == 400 and e.value.param == "messages[0].content[1].image_url"


def test_messages_reject_images_and_bad_roles():
    with pytest.raises(APIError) as e:
        normalise_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    assert e.value.code == "vision_unsupported" and e.value.status == 400
    with pytest.raises(APIError) as e:
        normalise_messages([{"role": "wizard", "content": "hi"}])
    assert e.value.param == "messages[0].role"
    with pytest.raises(APIError):
        normalise_messages([])


def test_llama_json_calls():
    out = parse(' {"name": "get_weather", "parameters": {"city": "Paris"}}', tools="json", reasoning=False)
    assert out.content == "" and [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [
        ("get_weather", {"city": "Paris"})]
    two = parse('{"name": "f", "parameters": {"x": 1}};{"name": "g", "parameters": {}}', tools="json")
    assert [c.name for c in two.tool_calls] == ["f", "g"]


@pytest.mark.parametrize("text", ['{"name": "f", "parameters": {"x": 1}', '{"city": "Paris"}',
                                  'Sure: {"name": "f", "parameters": {}}', '{"name": "f", "parameters": {}}; oops'])
def test_llama_json_that_is_not_a_whole_call_stays_content(text):
    out = parse(text, tools="json", reasoning=False)
    assert out.tool_calls == [] and out.content == text


def test_mistral_calls_in_both_forms():
    listed = parse('[TOOL_CALLS] [{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}]',
                   tools="mistral", reasoning=False)
    assert listed.content == "" and [(c.name, json.loads(c.arguments)) for c in listed.tool_calls] == [
        ("f", {"x": 1}), ("g", {})]
    named = parse('Let me look.[TOOL_CALLS]f[ARGS]{"x": 1}[TOOL_CALLS]g[ARGS]{}', tools="mistral")
    assert named.content == "Let me look." and [c.name for c in named.tool_calls] == ["f", "g"]
    broken = parse("[TOOL_CALLS]f[ARGS]{oops", tools="mistral")
    assert broken.tool_calls == [] and broken.content == "[TOOL_CALLS]f[ARGS]{oops"


def test_the_format_follows_the_tokenizer_and_template():
    class Tok:
        def __init__(self, tokens, template=""):
            self.tokens, self.chat_template = tokens, template

        def token_to_id(self, token):
            return self.tokens.get(token)

    assert tool_format(Tok({"<tool_call>": 5})) == "tags"
    assert tool_format(Tok({}, "{% if tools %}<tool_call>{% endif %}")) == "tags"
    assert tool_format(Tok({"[TOOL_CALLS]": 9})) == "mistral"
    assert tool_format(Tok({"<|python_tag|>": 7})) == "json"
    assert tool_format(Tok({"<|eot_id|>": 1})) is None


# ---- a forced tool_choice on a model with no call format: the reply is the grammar's JSON ----

LISTED = '[{"name":"get_weather","parameters":{"city":"}{ ,]["}},{"name":"get_time","parameters":{}}]'


def parse_forced(name: str | None, pieces: list[str]) -> Parsed:
    parser = ForcedCallParser(name)
    out = Parsed()
    for piece in pieces:
        out.extend(parser.feed(piece))
    out.extend(parser.finish())
    return out


def test_a_named_call_is_the_whole_reply_streamed_as_it_comes():
    parser = ForcedCallParser("get_weather")
    assert parser.feed("") == Parsed()
    assert parser.feed('{"city"') == Parsed(tool_calls=[ParsedToolCall("get_weather", '{"city"')])
    assert parser.feed(':"Paris"}') == Parsed(arguments=':"Paris"}')
    assert parser.finish() == Parsed()
    assert parse_forced("get_weather", ['{"ci', 'ty":"Paris"}']) == Parsed(
        tool_calls=[ParsedToolCall("get_weather", '{"city":"Paris"}')])
    # Cut short by max_tokens: the call as far as it got, as vLLM returns it.
    assert parse_forced("f", ['{"a":[1,']).tool_calls == [ParsedToolCall("f", '{"a":[1,')]


def test_required_calls_are_a_list_each_a_call_once_it_closes():
    parser = ForcedCallParser(None)
    assert parser.feed('[{"name":"get_weather","parameters":{"city":"}') == Parsed()
    first = parser.feed('{ ,]["}},{"name":"get_time",')
    assert first.tool_calls == [ParsedToolCall("get_weather", '{"city": "}{ ,]["}')] and not first.content
    assert parser.feed('"parameters":{}}]').tool_calls == [ParsedToolCall("get_time", "{}")]
    assert parser.finish() == Parsed()


def test_a_required_list_cut_short_keeps_its_unfinished_call_as_content():
    out = parse_forced(None, ['[{"name":"f","parameters":{}},{"name":"g","par'])
    assert out.tool_calls == [ParsedToolCall("f", "{}")] and out.content == '{"name":"g","par'


@pytest.mark.parametrize("name, text", [("get_weather", '{"city":"Paris","days":[1,2]}'), (None, LISTED),
                                        (None, '[{"name":"f","parameters":{}},{"name":"g"')])
def test_any_split_of_a_forced_reply_parses_like_the_whole(name, text):
    whole = parse_forced(name, [text])
    rng = random.Random(1)
    for _ in range(200):
        assert parse_forced(name, random_pieces(text, rng)) == whole
    assert parse_forced(name, list(text)) == whole
