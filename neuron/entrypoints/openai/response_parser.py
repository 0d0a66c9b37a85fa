"""The model's output split into reasoning, content and tool calls.

Qwen-style models think inside `<think>...</think>`. Tool calls come in the format of the
checkpoint's family (`tool_format` tells which from its tokenizer and chat template):

- `tags` (Qwen2.5, Qwen3, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  anywhere in the reply, as often as the model likes;
- `json` (Llama 3.1 and later): the whole reply is `{"name": ..., "parameters": {...}}`, or several
  such objects separated by `;` (after `<|python_tag|>`, a special token the decoded text drops);
- `mistral`: `[TOOL_CALLS]` and then a JSON list of `{"name": ..., "arguments": {...}}`, or
  `name[ARGS]{...}` once per call (newer tokenizers).

A model with none of these formats gets a forced `tool_choice` only, as vLLM serves any model: the
grammar writes the call's JSON and nothing else, and `ForcedCallParser` reads it (the whole reply
is a named function's arguments, or for `"required"` a JSON list of `{"name", "parameters"}`).

The tags and markers arrive in the decoded text (`[TOOL_CALLS]` is a special token, so a chat with
tools decodes special tokens). `OutputParser` is fed the text in whatever pieces it comes and holds
back only what might still turn into a tag, so a streamed answer splits exactly as the same text
parsed in one piece; a reply that is a JSON call, or the rest of one after `[TOOL_CALLS]`, is held
until it ends and becomes tool calls only if all of it parses.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from neuron.engine.tokenizer import Tokenizer

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_CALLS, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
PYTHON_TAG = "<|python_tag|>"
TOOL_FORMATS = ("tags", "json", "mistral")
# Not a model's format: a forced tool_choice on a model with none, whose reply is the grammar's JSON.
GRAMMAR_CALLS = "grammar"


def tool_format(tokenizer: Tokenizer) -> str | None:
    """How this checkpoint's model writes tool calls (one of TOOL_FORMATS), or None when neuron
    knows no format for it: then requests with tools are refused rather than answered with the
    calls left in the text."""
    template = tokenizer.chat_template or ""
    if tokenizer.token_to_id(TOOL_OPEN) is not None or TOOL_OPEN in template:
        return "tags"
    if tokenizer.token_to_id(MISTRAL_CALLS) is not None:
        return "mistral"
    if tokenizer.token_to_id(PYTHON_TAG) is not None:
        return "json"
    return None


def prompt_opens_reasoning(prompt: str) -> bool:
    """The rendered prompt leaves a `<think>` open (templates that start the model thinking)."""
    return prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)


@dataclass(slots=True)
class ParsedToolCall:
    name: str
    arguments: str  # a JSON object, as a string (OpenAI's format)


@dataclass(slots=True)
class Parsed:
    """`arguments`: more of the arguments of the last call begun before this piece's `tool_calls`
    (a call streamed as it is written)."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ParsedToolCall] = field(default_factory=list)
    arguments: str = ""

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls or self.arguments)

    def extend(self, other: "Parsed") -> None:
        self.content += other.content
        self.reasoning += other.reasoning
        if self.tool_calls:
            self.tool_calls[-1].arguments += other.arguments
        else:
            self.arguments += other.arguments
        self.tool_calls += other.tool_calls


def merged(pieces: list[Parsed]) -> Parsed:
    """The pieces as one: their content and their calls each joined."""
    out = pieces[0]
    for piece in pieces[1:]:
        out.extend(piece)
    return out


def _append_content(pieces: list[Parsed], text: str) -> None:
    """`text` at the end of `pieces`: text after the last piece's calls opens the next piece."""
    if pieces[-1].tool_calls:
        pieces.append(Parsed())
    pieces[-1].content += text


def parse_tool_call(body: str) -> ParsedToolCall | None:
    """The JSON between the tool-call tags, or None when it is not a well-formed call."""
    try:
        return _call(json.loads(body))
    except json.JSONDecodeError:
        return None


def parse_json_calls(text: str) -> list[ParsedToolCall] | None:
    """Llama's calls: one JSON object, or several separated by `;`; None unless all of them parse."""
    text = text.strip()
    try:
        objs = [json.loads(text)]
    except json.JSONDecodeError:
        try:
            objs = [json.loads(part) for part in text.split(";")]
        except json.JSONDecodeError:
            return None
    return _all_calls(objs)


def parse_mistral_calls(text: str) -> list[ParsedToolCall] | None:
    """What follows `[TOOL_CALLS]`: a JSON list of calls, or `name[ARGS]{...}` per call (each
    after its own marker); None unless all of it parses."""
    body = text.removeprefix(MISTRAL_CALLS).strip()
    if body.startswith("["):
        try:
            objs = json.loads(body)
        except json.JSONDecodeError:
            return None
        return _all_calls(objs) if isinstance(objs, list) else None
    objs = []
    for part in body.split(MISTRAL_CALLS):
        name, sep, args = part.partition(MISTRAL_ARGS)
        try:
            objs.append({"name": name.strip(), "arguments": json.loads(args)} if sep else None)
        except json.JSONDecodeError:
            return None
    return _all_calls(objs)


def _all_calls(objs: list) -> list[ParsedToolCall] | None:
    calls = [_call(obj) for obj in objs]
    return calls if calls and None not in calls else None


def _call(obj) -> ParsedToolCall | None:
    """A decoded call: `name` and its `arguments` (or Llama's `parameters`) as an object."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class OutputParser:
    """Splits generated text into reasoning, content and tool calls, fed in arbitrary pieces.

    reasoning: the tokenizer knows the think tags; a leading `<think>` opens reasoning.
    in_reasoning: the prompt already opened `<think>`, so the output starts inside it.
    tools: the request offered tools, and the format its calls come in (TOOL_FORMATS); None: no
    tools, every tag is text.
    """

    def __init__(self, *, reasoning: bool, in_reasoning: bool = False, tools: str | None = None):
        self._mode = "reasoning" if in_reasoning else "start" if reasoning else "content"
        self._tools = tools
        self._opener = {"tags": TOOL_OPEN, "mistral": MISTRAL_CALLS}.get(tools)
        self._buf = ""  # text not yet classified
        self._ws = ""  # trailing content whitespace, dropped if a tool call follows
        self._after_tool = False
        self._content_began = False  # json: a call is a reply that opens with `{`
        self._pieces = [Parsed()]  # what the drain under way has found, in order

    @classmethod
    def for_chat(cls, tokenizer: Tokenizer, prompt: str, *, tools: str | None) -> "OutputParser":
        """The parser for a reply to `prompt`: reasoning where the tokenizer has both think tags,
        starting inside it where the prompt left `<think>` open."""
        thinks = tokenizer.token_to_id(THINK_OPEN) is not None and tokenizer.token_to_id(THINK_CLOSE) is not None
        return cls(reasoning=thinks, in_reasoning=thinks and prompt_opens_reasoning(prompt), tools=tools)

    @property
    def in_reasoning(self) -> bool:
        """Inside `<think>`: what comes next is reasoning, up to and with the closing tag."""
        return self._mode == "reasoning"

    def feed(self, text: str) -> Parsed:
        """What `text` completes, content and calls each joined (the order between them lost)."""
        return merged(self.feed_in_order(text))

    def finish(self) -> Parsed:
        return merged(self.finish_in_order())

    def feed_in_order(self, text: str) -> list[Parsed]:
        """What `text` completes as pieces in the order the model wrote them: a piece's tool calls
        come after its reasoning and content, and content written after them opens the next piece."""
        self._buf += text
        return self._drain(final=False)

    def finish_in_order(self) -> list[Parsed]:
        pieces = self._drain(final=True)
        if self._buf:  # an unterminated tool call, or a lone tag prefix: plain text after all
            self._content(self._buf)
            self._buf = ""
        if not self._after_tool:
            self._pieces[-1].content += self._ws
        self._ws = ""
        return pieces

    def _drain(self, final: bool) -> list[Parsed]:
        self._pieces = [Parsed()]
        step = {"start": self._start, "reasoning": self._reasoning, "after_think": self._after_think,
                "content": self._plain, "tool": self._tool_call, "tail": self._tail}
        while step[self._mode](final):
            pass
        return self._pieces

    # Each step consumes what it can from the buffer; True means "the mode changed, go again".

    def _start(self, final: bool) -> bool:
        head = self._buf.lstrip()
        if head.startswith(THINK_OPEN):
            self._buf, self._mode = head[len(THINK_OPEN):], "reasoning"
            return True
        if not final and THINK_OPEN.startswith(head):  # empty or a prefix of the tag: wait
            return False
        self._mode = "content"
        return True

    def _reasoning(self, final: bool) -> bool:
        at = self._buf.find(THINK_CLOSE)
        if at != -1:
            self._pieces[-1].reasoning += self._buf[:at]
            self._buf, self._mode = self._buf[at + len(THINK_CLOSE):], "after_think"
            return True
        keep = 0 if final else _partial_tag(self._buf, THINK_CLOSE)
        self._pieces[-1].reasoning += self._buf[: len(self._buf) - keep]
        self._buf = self._buf[len(self._buf) - keep:]
        return False

    def _after_think(self, final: bool) -> bool:
        # The blank lines after </think> separate it from the answer; they are not the answer.
        self._buf = self._buf.lstrip()
        if not self._buf and not final:
            return False
        self._mode = "content"
        return True

    def _plain(self, final: bool) -> bool:
        if self._tools == "json" and not self._content_began:
            head = self._buf.lstrip()
            if not head:
                return False
            self._content_began = True
            if head.startswith("{"):
                self._buf, self._mode = head, "tail"
                return True
        if self._opener is not None:
            at = self._buf.find(self._opener)
            if at != -1:
                self._content(self._buf[:at])
                self._buf, self._mode = self._buf[at:], "tool" if self._tools == "tags" else "tail"
                return True
        keep = _partial_tag(self._buf, self._opener) if self._opener is not None and not final else 0
        self._content(self._buf[: len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep:]
        return False

    def _tool_call(self, final: bool) -> bool:
        at = self._buf.find(TOOL_CLOSE, len(TOOL_OPEN))
        if at == -1:
            return False  # wait for the close tag; finish() turns an unclosed block into text
        raw, self._buf = self._buf[: at + len(TOOL_CLOSE)], self._buf[at + len(TOOL_CLOSE):]
        self._mode = "content"
        call = parse_tool_call(raw[len(TOOL_OPEN): -len(TOOL_CLOSE)])
        if call is None:
            self._content(raw)
        else:
            self._pieces[-1].tool_calls.append(call)
            self._ws, self._after_tool = "", True
        return True

    def _tail(self, final: bool) -> bool:
        """A reply's calls that end with it (json, mistral): parsed whole once the reply is over."""
        if not final:
            return False
        parse = parse_json_calls if self._tools == "json" else parse_mistral_calls
        calls = parse(self._buf)
        if calls is None:
            self._content(self._buf)
        else:
            self._pieces[-1].tool_calls += calls
            self._ws, self._after_tool = "", True
        self._buf, self._mode = "", "content"
        return False

    def _content(self, text: str) -> None:
        if not self._tools:
            self._pieces[-1].content += text
            return
        # Whitespace touching a tool call is layout between calls, so it is held until we know.
        if self._after_tool:
            text = text.lstrip()
        body = text.rstrip()
        if body:
            _append_content(self._pieces, self._ws + body)
            self._ws, self._after_tool = text[len(body):], False
        else:
            self._ws += text


class ForcedCallParser:
    """The reply to a forced tool_choice on a model with no call format of its own: the grammar
    wrote it from its first character to its last (guided.py), so there is nothing else to find.

    name given (a named tool_choice): the whole reply is that function's arguments, a call opened
    at the first text and continued as it comes. None ("required"): a JSON list of `{"name",
    "parameters"}` objects, each a call once it closes. Text that is not a whole call (a reply cut
    short by max_tokens) is content, so nothing is lost; a named call is returned as far as it got,
    as vLLM returns it.
    """

    in_reasoning = False  # a forced call has no reasoning

    def __init__(self, name: str | None):
        self._name = name
        self._opened = False
        self._buf = ""  # required: the text of the call being written
        self._decoder = json.JSONDecoder()

    def feed(self, text: str) -> Parsed:
        return merged(self.feed_in_order(text))

    def finish(self) -> Parsed:
        return merged(self.finish_in_order())

    def feed_in_order(self, text: str) -> list[Parsed]:
        return [self._named(text, final=False)] if self._name is not None else self._listed(text, final=False)

    def finish_in_order(self) -> list[Parsed]:
        return [self._named("", final=True)] if self._name is not None else self._listed("", final=True)

    def _named(self, text: str, final: bool) -> Parsed:
        if self._opened:
            return Parsed(arguments=text)
        if not text and not final:
            return Parsed()
        self._opened = True
        return Parsed(tool_calls=[ParsedToolCall(self._name, text)])

    def _listed(self, text: str, final: bool) -> list[Parsed]:
        pieces = [Parsed()]
        self._buf += text
        while True:
            self._buf = self._buf.lstrip(" \t\n[,]")  # the list around the calls
            if not self._buf.startswith("{") or "}" not in self._buf:
                break
            try:  # a call is whole once its object closes: no prefix of it decodes
                obj, end = self._decoder.raw_decode(self._buf)
            except json.JSONDecodeError:
                break
            call = _call(obj)
            if call is None:
                _append_content(pieces, self._buf[:end])
            else:
                pieces[-1].tool_calls.append(call)
            self._buf = self._buf[end:]
        if final and self._buf:
            _append_content(pieces, self._buf)
            self._buf = ""
        return pieces
