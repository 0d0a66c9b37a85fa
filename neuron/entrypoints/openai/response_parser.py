"""The model's output split into reasoning, content and tool calls.

Qwen-style models think inside `<think>...</think>` and call tools with
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. These tags are ordinary added tokens,
so they arrive in the decoded text. `OutputParser` is fed the text in whatever pieces it comes
and holds back only what might still turn into a tag, so a streamed answer splits exactly as the
same text parsed in one piece.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from neuron.engine.tokenizer import Tokenizer

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"


def prompt_opens_reasoning(prompt: str) -> bool:
    """The rendered prompt leaves a `<think>` open (templates that start the model thinking)."""
    return prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)


@dataclass(slots=True)
class ParsedToolCall:
    name: str
    arguments: str  # a JSON object, as a string (OpenAI's format)


@dataclass(slots=True)
class Parsed:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ParsedToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)

    def extend(self, other: "Parsed") -> None:
        self.content += other.content
        self.reasoning += other.reasoning
        self.tool_calls += other.tool_calls


def parse_tool_call(body: str) -> ParsedToolCall | None:
    """The JSON between the tool-call tags, or None when it is not a well-formed call."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
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
    tools: the request offered tools, so `<tool_call>` blocks are parsed.
    """

    def __init__(self, *, reasoning: bool, in_reasoning: bool = False, tools: bool = False):
        self._mode = "reasoning" if in_reasoning else "start" if reasoning else "content"
        self._tools = tools
        self._buf = ""  # text not yet classified
        self._ws = ""  # trailing content whitespace, dropped if a tool call follows
        self._after_tool = False

    @classmethod
    def for_chat(cls, tokenizer: Tokenizer, prompt: str, *, tools: bool) -> "OutputParser":
        """The parser for a reply to `prompt`: reasoning where the tokenizer has both think tags,
        starting inside it where the prompt left `<think>` open."""
        thinks = tokenizer.token_to_id(THINK_OPEN) is not None and tokenizer.token_to_id(THINK_CLOSE) is not None
        return cls(reasoning=thinks, in_reasoning=thinks and prompt_opens_reasoning(prompt), tools=tools)

    def feed(self, text: str) -> Parsed:
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> Parsed:
        out = self._drain(final=True)
        if self._buf:  # an unterminated tool call, or a lone tag prefix: plain text after all
            self._content(out, self._buf)
            self._buf = ""
        if not self._after_tool:
            out.content += self._ws
        self._ws = ""
        return out

    def _drain(self, final: bool) -> Parsed:
        out = Parsed()
        step = {"start": self._start, "reasoning": self._reasoning, "after_think": self._after_think,
                "content": self._plain, "tool": self._tool_call}
        while step[self._mode](out, final):
            pass
        return out

    # Each step consumes what it can from the buffer; True means "the mode changed, go again".

    def _start(self, out: Parsed, final: bool) -> bool:
        head = self._buf.lstrip()
        if head.startswith(THINK_OPEN):
            self._buf, self._mode = head[len(THINK_OPEN):], "reasoning"
            return True
        if not final and THINK_OPEN.startswith(head):  # empty or a prefix of the tag: wait
            return False
        self._mode = "content"
        return True

    def _reasoning(self, out: Parsed, final: bool) -> bool:
        at = self._buf.find(THINK_CLOSE)
        if at != -1:
            out.reasoning += self._buf[:at]
            self._buf, self._mode = self._buf[at + len(THINK_CLOSE):], "after_think"
            return True
        keep = 0 if final else _partial_tag(self._buf, THINK_CLOSE)
        out.reasoning += self._buf[: len(self._buf) - keep]
        self._buf = self._buf[len(self._buf) - keep:]
        return False

    def _after_think(self, out: Parsed, final: bool) -> bool:
        # The blank lines after </think> separate it from the answer; they are not the answer.
        self._buf = self._buf.lstrip()
        if not self._buf and not final:
            return False
        self._mode = "content"
        return True

    def _plain(self, out: Parsed, final: bool) -> bool:
        if self._tools:
            at = self._buf.find(TOOL_OPEN)
            if at != -1:
                self._content(out, self._buf[:at])
                self._buf, self._mode = self._buf[at:], "tool"
                return True
        keep = _partial_tag(self._buf, TOOL_OPEN) if self._tools and not final else 0
        self._content(out, self._buf[: len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep:]
        return False

    def _tool_call(self, out: Parsed, final: bool) -> bool:
        at = self._buf.find(TOOL_CLOSE, len(TOOL_OPEN))
        if at == -1:
            return False  # wait for the close tag; finish() turns an unclosed block into text
        raw, self._buf = self._buf[: at + len(TOOL_CLOSE)], self._buf[at + len(TOOL_CLOSE):]
        self._mode = "content"
        call = parse_tool_call(raw[len(TOOL_OPEN): -len(TOOL_CLOSE)])
        if call is None:
            self._content(out, raw)
        else:
            out.tool_calls.append(call)
            self._ws, self._after_tool = "", True
        return True

    def _content(self, out: Parsed, text: str) -> None:
        if not self._tools:
            out.content += text
            return
        # Whitespace touching a tool call is layout between calls, so it is held until we know.
        if self._after_tool:
            text = text.lstrip()
        body = text.rstrip()
        if body:
            out.content += self._ws + body
            self._ws, self._after_tool = text[len(body):], False
        else:
            self._ws += text
