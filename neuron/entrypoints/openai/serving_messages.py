"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API.

A thin translation onto the chat path: the request becomes a chat completion request (system
blocks a system turn, tool_result blocks tool turns, tools functions, `thinking` the template's
`enable_thinking`), which serving_chat checks, renders and queues as it does its own; the reply's
reasoning, text and tool calls, parsed there, come back as thinking, text and tool_use blocks, in
the order the model wrote them; the chat path's errors are told in the Messages request's names.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from datetime import datetime, timezone

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from neuron.engine.async_engine import AsyncEngine
from neuron.engine.output_processor import Update
from neuron.entrypoints.openai.api_errors import APIError, bad_request, renamed, unsupported
from neuron.entrypoints.openai.api_types import ChatCompletionRequest, ToolCall, UsageInfo
from neuron.entrypoints.openai.chat_utils import template_content_chars
from neuron.entrypoints.openai.common import Samples, check_model, check_ready, encoded, stream_error, stream_events
from neuron.entrypoints.openai.messages_types import (
    ContentBlock,
    ContentBlockDelta,
    ContentBlockStart,
    ContentBlockStop,
    CountTokensRequest,
    InputJsonDelta,
    Message,
    MessageDelta,
    MessagesRequest,
    MessageStart,
    MessageStop,
    OutputUsage,
    Ping,
    StopDelta,
    TextBlock,
    TextDelta,
    ThinkingBlock,
    ThinkingDelta,
    TokenCount,
    ToolUseBlock,
    Usage,
)
from neuron.entrypoints.openai.prompt_input import Limiters, check_prompt_chars, off_loop
from neuron.entrypoints.openai.response_parser import Parsed
from neuron.entrypoints.openai.serving_chat import ChatRequestContext, ChoiceState, open_chat, render_chat
from neuron.entrypoints.openai.streaming import EventStreamResponse, json_unless_disconnected

# ---- errors ----

# Anthropic's error types by status; 529 is its "overloaded" (our queue being full).
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 415: "invalid_request_error",
                429: "rate_limit_error", 529: "overloaded_error"}
_OVERLOADED = 529


def _status(exc: APIError) -> int:
    return _OVERLOADED if exc.code == "overloaded" else exc.status


def error_body(exc: APIError) -> dict:
    """`{"type": "error", "error": {"type", "message"}}`; the type follows the status, as Anthropic's."""
    status = _status(exc)
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": exc.message}}


def error_response(exc: APIError) -> Response:
    """An error of these routes in Anthropic's shape (the wrapper in app.py renders every one so)."""
    return Response(msgspec.json.encode(error_body(exc)), _status(exc), exc.headers, media_type="application/json")


def _error_event(exc: APIError) -> bytes:
    return b"event: error\ndata: " + msgspec.json.encode(error_body(exc)) + b"\n\n"


# ---- GET /v1/models, as Anthropic lists them ----

_MAX_PAGE = 1000


def is_anthropic(request: Request) -> bool:
    """Anthropic's clients send the version of its API they speak with every request; OpenAI's never
    do, so GET /v1/models answers each in its own shape."""
    return "anthropic-version" in request.headers


def model_object(name: str, created: float) -> dict:
    """One model as Anthropic describes it: its id, a name to show (the same) and when it was made
    (the server's start, RFC 3339)."""
    at = datetime.fromtimestamp(created, timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")
    return {"type": "model", "id": name, "display_name": name, "created_at": at}


def model_page(names: list[str], created: float, query) -> dict:
    """A page of the served models: `limit` of them (1-1000, 20 unless given) after `after_id` or
    before `before_id`, with the ids at its ends and whether more lie past the end it was taken
    from, as Anthropic pages them."""
    raw = query.get("limit", "20")
    try:
        limit = int(raw)
    except ValueError:
        limit = 0
    if not 1 <= limit <= _MAX_PAGE:
        raise bad_request(f"limit must be an integer from 1 to {_MAX_PAGE}, got {raw[:64]!r}", param="limit")
    after, before = query.get("after_id"), query.get("before_id")
    if after is not None and before is not None:
        raise bad_request("send after_id or before_id, not both", param="before_id")
    for field, cursor in (("after_id", after), ("before_id", before)):
        if cursor is not None and cursor not in names:
            raise bad_request(f"{field} {cursor[:256]!r} is not a model this server serves", param=field)
    if before is not None:
        end = names.index(before)
        page, more = names[max(end - limit, 0):end], end > limit
    else:
        start = names.index(after) + 1 if after is not None else 0
        page, more = names[start:start + limit], start + limit < len(names)
    return {"data": [model_object(n, created) for n in page], "has_more": more,
            "first_id": page[0] if page else None, "last_id": page[-1] if page else None}


# ---- the request, as a chat ----

_USER_BLOCKS = ("text", "image", "tool_result")
_ASSISTANT_BLOCKS = ("text", "thinking", "tool_use")
# Blocks Anthropic takes that neuron does not, with what to do instead.
_REFUSED_BLOCKS = {
    "document": "document blocks (PDFs and text files) are not supported; send the document's text in a text block",
    "redacted_thinking": "redacted_thinking blocks are not supported: neuron never redacts its reasoning, so send "
                         "back the thinking blocks it returned",
    "search_result": "search_result blocks are not supported; send the results as text",
    "server_tool_use": "server tools are not supported: neuron runs no tools itself",
    "web_search_tool_result": "server tools are not supported: neuron runs no tools itself",
    "container_upload": "container_upload blocks are not supported: neuron runs no code",
}
# The chat path's names for what a Messages request calls otherwise, in the errors it raises.
_RENAMES = {"stop": "stop_sequences", "response_format": "output_config.format",
            "response_format.json_schema.schema": "output_config.format.schema", "chat_template_kwargs": "thinking",
            "parallel_tool_calls": "tool_choice.disable_parallel_tool_use"}


def chat_request(req: CountTokensRequest) -> ChatCompletionRequest:
    """The chat completion request a Messages request means; what it cannot mean is a 400."""
    for name in ("mcp_servers", "container"):
        if getattr(req, name) is not None:
            raise unsupported(name, f"{name} is not supported: neuron runs no tools or code itself")
    tools = _tools(req.tools)
    choice, parallel = _tool_choice(req.tool_choice, tools)
    generates = isinstance(req, MessagesRequest)  # not a count_tokens request
    switch = _thinking(req.thinking, req.max_tokens if generates else None)
    turns, prefill = _turns(req.messages)
    fields = dict(model=req.model, messages=_system(req.system) + turns, tools=tools, tool_choice=choice,
                  parallel_tool_calls=parallel, chat_template_kwargs=switch, add_generation_prompt=not prefill,
                  continue_final_message=prefill)
    if generates:
        if req.max_tokens < 1:  # only /v1/completions takes 0 (it scores a prompt without generating)
            raise bad_request(f"max_tokens: must be >= 1, got {req.max_tokens}", param="max_tokens")
        _check_metadata(req.metadata)
        fields.update(max_tokens=req.max_tokens, stop=req.stop_sequences, temperature=req.temperature,
                      top_p=req.top_p, top_k=req.top_k, seed=req.seed, stream=req.stream, cache_salt=req.cache_salt,
                      response_format=_output_format(req.output_config))
    return ChatCompletionRequest(**fields)


def _output_format(config: dict | None) -> dict | None:
    """`output_config.format` as OpenAI's response_format, which the structured-output path compiles
    (its `effort` is not used)."""
    fmt = (config or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise bad_request('output_config.format: must be {"type": "json_schema", "schema": {...}}',
                          param="output_config.format")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def _system(system) -> list[dict]:
    if system is None:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}] if system else []
    texts = [_text(block, f"system[{i}]") for i, block in enumerate(system)]
    return [{"role": "system", "content": "\n".join(texts)}] if texts else []


def _turns(messages: list) -> tuple[list[dict], bool]:
    """The chat turns, and whether the reply continues the last of them: a final assistant message
    is a prefill, whose text the reply goes on from (and leaves out, as Anthropic's does)."""
    if not messages:
        raise bad_request("messages: at least one message is required", param="messages")
    out = [turn for i, m in enumerate(messages) for turn in _message(m, i)]
    if out[-1]["role"] != "assistant":
        return out, False
    where = f"messages[{len(messages) - 1}]"
    last = out[-1]
    if last.get("tool_calls") or last.get("reasoning_content"):
        raise bad_request(f"{where}: a final assistant message (a prefill) takes text blocks only", param=where)
    if not last["content"]:  # an empty prefill: the reply opens its own turn
        return out[:-1], False
    if last["content"] != last["content"].rstrip():
        raise bad_request(f"{where}: final assistant content cannot end with trailing whitespace", param=where)
    return out, True


def _message(m, i: int) -> list[dict]:
    """One Anthropic message as chat turns: a user message's tool_result blocks become tool turns,
    in their place among its other blocks."""
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad_request(f"{where}: a message must be an object with a role and content", param=where)
    role = m.get("role")
    if role not in ("user", "assistant"):
        raise bad_request(f"{where}.role: must be 'user' or 'assistant', got {role!r} (a system prompt goes in the "
                          "top-level `system` field)", param=f"{where}.role")
    content = m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise bad_request(f"{where}.content: must be a string or a list of content blocks", param=f"{where}.content")
    allowed = _USER_BLOCKS if role == "user" else _ASSISTANT_BLOCKS
    blocks = [(_block_type(b, f"{where}.content[{j}]", role, allowed), b, f"{where}.content[{j}]")
              for j, b in enumerate(content)]
    return _user(blocks) if role == "user" else [_assistant(blocks)]


def _block_type(block, where: str, role: str, allowed: tuple[str, ...]) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    if kind in allowed:
        return kind
    if kind in _REFUSED_BLOCKS:
        raise bad_request(f"{where}: {_REFUSED_BLOCKS[kind]}", param=where)
    raise bad_request(f"{where}: a block of type {kind!r} is not supported in a{'n' * (role == 'assistant')} {role} "
                      f"message; it takes {', '.join(allowed)} blocks", param=where)


def _user(blocks: list[tuple[str, dict, str]]) -> list[dict]:
    turns: list[dict] = []
    parts: list[dict] = []
    for kind, block, where in blocks:
        if kind == "tool_result":
            if parts:
                turns.append({"role": "user", "content": parts})
                parts = []
            turns.append(_tool_result(block, where))
        elif kind == "image":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block, where)}})
        else:
            parts.append({"type": "text", "text": _text(block, where)})
    if parts or not turns:
        turns.append({"role": "user", "content": parts})
    return turns


def _assistant(blocks: list[tuple[str, dict, str]]) -> dict:
    texts, thoughts, calls = [], [], []
    for kind, block, where in blocks:
        if kind == "text":
            texts.append(_text(block, where))
        elif kind == "thinking":
            thought = block.get("thinking")
            if not isinstance(thought, str):
                raise bad_request(f"{where}.thinking: must be a string", param=f"{where}.thinking")
            thoughts.append(thought)
        else:
            calls.append(_tool_use(block, where))
    turn = {"role": "assistant", "content": "\n".join(texts)}
    if thoughts:
        turn["reasoning_content"] = "\n".join(thoughts)
    if calls:
        turn["tool_calls"] = calls
    return turn


def _text(block, where: str) -> str:
    """A text block's text (its cache_control and citations are ignored)."""
    if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
        raise bad_request(f'{where}: must be a text block {{"type": "text", "text": ...}}', param=where)
    return block["text"]


def _image_url(block: dict, where: str) -> str:
    """A base64 image as a data URI (a URL source is passed on, and refused: neuron fetches nothing)."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source.get("media_type"), str) and isinstance(source.get("data"), str):
        return f"data:{source['media_type']};base64,{source['data']}"
    if kind == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise bad_request(f'{where}.source: an image needs {{"type": "base64", "media_type": "image/png", "data": ...}}',
                      param=f"{where}.source")


def _tool_use(block: dict, where: str) -> dict:
    name, call_id, args = block.get("name"), block.get("id"), block.get("input")
    if not isinstance(name, str) or not name or not isinstance(call_id, str) or not isinstance(args, dict):
        raise bad_request(f"{where}: a tool_use block needs an id, a name and an input object", param=where)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def _tool_result(block: dict, where: str) -> dict:
    """A tool turn; its content a string or text blocks. `is_error` reaches the model only as the
    result's text says it."""
    call_id, content = block.get("tool_use_id"), block.get("content", "")
    if not isinstance(call_id, str):
        raise bad_request(f"{where}.tool_use_id: must be the id of the tool_use block answered",
                          param=f"{where}.tool_use_id")
    if isinstance(content, list):
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") != "text":
                raise bad_request(f"{where}.content[{j}]: a tool result takes text blocks only, not "
                                  f"{part.get('type')!r}", param=f"{where}.content[{j}]")
        content = "\n".join(_text(part, f"{where}.content[{j}]") for j, part in enumerate(content))
    elif not isinstance(content, str):
        raise bad_request(f"{where}.content: must be a string or a list of text blocks", param=f"{where}.content")
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def _message_id(ctx: ChatRequestContext) -> str:
    """msg_<hex>, as Anthropic's ids read; the engine's logs name the request msg-<hex>."""
    return ctx.id.replace("-", "_", 1)


def _tools(tools: list | None) -> list[dict] | None:
    """Client tools as functions; a server tool (one with a `type` of Anthropic's) is a 400."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind not in (None, "custom"):
            raise unsupported(f"tools[{i}]", f"tools[{i}]: the server tool {kind!r} is not supported: neuron runs no "
                                             "tools itself; describe a tool by name, description and input_schema")
        name = tool.get("name") if isinstance(tool, dict) else None
        schema = tool.get("input_schema") if isinstance(tool, dict) else None
        if not isinstance(name, str) or not name or not isinstance(schema, dict):
            raise bad_request(f"tools[{i}]: a tool needs a name and an input_schema (a JSON schema object)",
                              param=f"tools[{i}]")
        # name, description, parameters: the order OpenAI's clients send, which templates render as is
        described = {"description": tool["description"]} if isinstance(tool.get("description"), str) else {}
        out.append({"type": "function", "function": {"name": name, **described, "parameters": schema}})
    return out


def _tool_choice(choice: dict | None, tools: list[dict] | None) -> tuple[str | dict | None, bool | None]:
    """OpenAI's tool_choice for Anthropic's (auto, any, tool, none), and whether parallel calls are allowed."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    if kind not in ("auto", "any", "tool", "none"):
        raise bad_request(f"tool_choice.type: must be auto, any, tool or none, got {kind!r}", param="tool_choice")
    if kind in ("any", "tool") and not tools:
        raise bad_request(f"tool_choice {kind!r} needs tools", param="tool_choice")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request("tool_choice.name: a tool_choice of type tool names the tool", param="tool_choice")
        return {"type": "function", "function": {"name": name}}, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[kind], parallel


def _thinking(thinking: dict | None, max_tokens: int | None) -> dict | None:
    """The template's reasoning switch: on for `enabled`, off for `disabled`, the template's own
    default for `adaptive` or none given. The budget is checked as Anthropic checks it (below
    max_tokens), not enforced: reasoning counts against max_tokens."""
    if thinking is None:
        return None
    kind = thinking.get("type")
    if kind == "disabled":
        return {"enable_thinking": False}
    if kind == "adaptive":
        return None
    if kind != "enabled":
        raise bad_request(f"thinking.type: must be enabled, disabled or adaptive, got {kind!r}", param="thinking")
    budget = thinking.get("budget_tokens")
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise bad_request("thinking.budget_tokens: must be a positive integer", param="thinking.budget_tokens")
    if max_tokens is not None and budget >= max_tokens:
        raise bad_request(f"thinking.budget_tokens: must be less than max_tokens ({max_tokens}), got {budget}",
                          param="thinking.budget_tokens")
    return {"enable_thinking": True}


def _check_metadata(metadata: dict | None) -> None:
    """Anthropic's `metadata.user_id`, an opaque string: checked, then not used."""
    user = (metadata or {}).get("user_id")
    if user is not None and not isinstance(user, str):
        raise bad_request("metadata.user_id: must be a string", param="metadata.user_id")


# ---- the reply ----


def _stop(update: Update, called: bool) -> tuple[str | None, str | None]:
    """stop_reason and stop_sequence: max_tokens, tool_use, the stop sequence met, or end_turn."""
    if update.finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if update.finish_reason == "stop" and isinstance(update.stop_reason, str):
        return "stop_sequence", update.stop_reason
    return "end_turn", None


def _tool_use_block(block: ToolUseBlock, arguments: str) -> ToolUseBlock | TextBlock:
    """A tool_use block with its input parsed. A named call the grammar left unfinished
    (max_tokens) has no input to parse: its text comes back as text, so nothing is lost."""
    try:
        args = json.loads(arguments)
    except json.JSONDecodeError:
        args = None
    if not isinstance(args, dict):
        return TextBlock(arguments)
    return ToolUseBlock(block.id, block.name, args)


def _tool_use_id(call: ToolCall) -> str:
    return "toolu_" + call.id.removeprefix("call_")


async def create_message(request: Request, engine: AsyncEngine, req: MessagesRequest, keepalive_s: float,
                         limiters: Limiters, cache_salt: str | None = None) -> Response:
    try:
        ctx, samples = await open_chat(engine, chat_request(req), limiters, cache_salt, id_prefix="msg")
    except APIError as exc:
        raise renamed(exc, _RENAMES) from None
    if req.stream:
        return EventStreamResponse(_events(ctx, samples, keepalive_s), on_close=samples.close)
    return await json_unless_disconnected(request, samples, _collect(ctx, samples))


async def _collect(ctx: ChatRequestContext, samples: Samples) -> bytes:
    """The whole reply: the blocks built as the stream builds them, so both have the same blocks
    in the same order."""
    [stream] = samples.streams
    blocks = _Blocks(ChoiceState(ctx), streaming=False)
    async for update in stream:
        if update.finish_reason == "error":
            raise stream_error(stream, update.error)
        blocks.update(update)
    reason, sequence = _stop(blocks.last, blocks.state.num_tool_calls > 0)
    usage = samples.usage([0])
    message = Message(_message_id(ctx), ctx.model, blocks.content(), reason, sequence,
                      Usage(usage.prompt_tokens, usage.completion_tokens))
    return await encoded(message)


def _event(event) -> bytes:
    """One SSE event, named by its type as Anthropic's clients expect."""
    return b"event: " + event.__struct_config__.tag.encode() + b"\ndata: " + msgspec.json.encode(event) + b"\n\n"


class _Blocks:
    """A reply's content blocks in the order the model wrote them, built as its parsed output
    arrives (reasoning, then text, then tool calls, in each piece), and, when streaming, the
    events that open, extend and close them."""

    def __init__(self, state: ChoiceState, streaming: bool):
        self.state = state
        self.blocks: list[ContentBlock] = []
        self.last: Update | None = None  # the update that ended the reply
        self._inputs: dict[int, str] = {}  # each tool_use block's input as written so far, by its index
        self._open: str | None = None  # the open block's type
        self._events: list[bytes] | None = [] if streaming else None

    def update(self, update: Update) -> None:
        """One update's text, parsed; the last also ends the parse and closes the open block."""
        pieces = self.state.parser.feed_in_order(update.text)
        if update.finished:
            pieces += self.state.parser.finish_in_order()
        for piece in pieces:
            self._feed(piece)
        if update.finished:
            self._close()
            self.last = update

    def take(self) -> list[bytes]:
        """The events since the last take."""
        out, self._events = self._events, []
        return out

    def content(self) -> list[ContentBlock]:
        """The finished blocks, each tool_use block with its input."""
        return [_tool_use_block(block, self._inputs[i]) if i in self._inputs else block
                for i, block in enumerate(self.blocks)]

    def _feed(self, parsed: Parsed) -> None:
        if parsed.reasoning:
            self._extend(ThinkingBlock(""), ThinkingDelta(parsed.reasoning))
        if parsed.arguments:  # more of the call the open tool_use block holds
            self._input(parsed.arguments)
        if parsed.content:
            self._extend(TextBlock(""), TextDelta(parsed.content))
        for call in self.state.tool_calls(parsed):
            self._start(ToolUseBlock(_tool_use_id(call), call.function.name, {}))
            self._inputs[len(self.blocks) - 1] = ""
            if call.function.arguments:
                self._input(call.function.arguments)

    def _extend(self, empty: ThinkingBlock | TextBlock, delta: ThinkingDelta | TextDelta) -> None:
        if self._open != empty.__struct_config__.tag:
            self._start(empty)
        block = self.blocks[-1]
        if isinstance(block, TextBlock):
            block.text += delta.text
        else:
            block.thinking += delta.thinking
        self._emit(ContentBlockDelta(len(self.blocks) - 1, delta))

    def _input(self, text: str) -> None:
        """More of the open tool_use block's input."""
        index = len(self.blocks) - 1
        if self._open == "tool_use":
            self._inputs[index] += text
            self._emit(ContentBlockDelta(index, InputJsonDelta(text)))

    def _start(self, block: ContentBlock) -> None:
        self._close()
        self.blocks.append(block)
        self._open = block.__struct_config__.tag
        self._emit(ContentBlockStart(len(self.blocks) - 1, block))

    def _close(self) -> None:
        if self._open is not None:
            self._open = None
            self._emit(ContentBlockStop(len(self.blocks) - 1))

    def _emit(self, event) -> None:
        if self._events is not None:
            self._events.append(_event(event))


async def _events(ctx: ChatRequestContext, samples: Samples, keepalive_s: float) -> AsyncIterator[bytes]:
    """message_start and a ping, the blocks' events as the reply comes, then message_delta (the
    stop reason and the output tokens) and message_stop; a ping whenever `keepalive_s` passes with
    nothing to say, and an `error` event if generation fails."""
    blocks = _Blocks(ChoiceState(ctx), streaming=True)

    async def chunks(k: int, update: Update) -> list[bytes]:
        blocks.update(update)
        return blocks.take()

    def ending(usage: UsageInfo) -> bytes:
        reason, sequence = _stop(blocks.last, blocks.state.num_tool_calls > 0)
        return (_event(MessageDelta(StopDelta(reason, sequence), OutputUsage(usage.completion_tokens)))
                + _event(MessageStop()))

    start = Message(_message_id(ctx), ctx.model, [], None, None, Usage(samples.prompt_lens[0], 0))
    opening = [_event(MessageStart(start)), _event(Ping())]
    async for event in stream_events(samples, keepalive_s, chunks, ending, opening, keepalive=_event(Ping()),
                                     error_event=_error_event, done=b""):
        yield event


# ---- count_tokens ----


async def count_tokens(engine: AsyncEngine, req: CountTokensRequest, limiters: Limiters) -> Response:
    """The prompt's tokens as the model would be given them: template, tools and images included."""
    chat = chat_request(req)
    check_model(chat, engine.model_name)
    check_ready(engine)
    if engine.tokenizer is None:
        raise bad_request("this model has no tokenizer, so it cannot count a chat's tokens", param="messages")
    check_prompt_chars(engine, template_content_chars(chat.messages), "messages")
    _, ids, _ = await off_loop(limiters.tokenize, render_chat, engine, chat)
    return Response(msgspec.json.encode(TokenCount(len(ids))), media_type="application/json")
