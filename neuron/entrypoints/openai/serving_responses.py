"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API.

A thin translation onto the chat path: `input` (with `instructions`, and the conversation a
`previous_response_id` ends) becomes chat messages, the function tools and `text.format` become
the chat request's tools and structured output, and `reasoning.effort` the template's thinking
switch; serving_chat.open_chat renders and queues it. What the model writes is split by the chat
path's parser into reasoning, text and function calls, which become the response's output items,
in the order the model wrote them, and, when streaming, the typed events the SDK reads.
Responses are kept (`store`, true unless the request says otherwise) in a ResponseStore.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from neuron.engine.async_engine import AsyncEngine
from neuron.engine.llm_engine import Update
from neuron.entrypoints.openai.api_errors import APIError, bad_request, renamed, unsupported
from neuron.entrypoints.openai.api_types import ChatCompletionRequest
from neuron.entrypoints.openai.common import Samples, check_ready, encoded, now, stream_error
from neuron.entrypoints.openai.prompt_input import Limiters, off_loop
from neuron.entrypoints.openai.response_parser import Parsed, ParsedToolCall
from neuron.entrypoints.openai.response_store import OwnedResponses, StoredResponse
from neuron.entrypoints.openai.responses_types import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ContentPartEvent,
    DeletedResponse,
    ErrorEvent,
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    LifecycleEvent,
    MessageItem,
    OutputItem,
    OutputItemEvent,
    OutputText,
    OutputTextDelta,
    OutputTextDone,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    ReasoningTextDelta,
    ReasoningTextDone,
    ResponseError,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from neuron.entrypoints.openai.serving_chat import ChatRequestContext, ChoiceState, open_chat, render_chat
from neuron.entrypoints.openai.streaming import KEEPALIVE, EventStreamResponse, json_unless_disconnected, merged_updates

_REFUSED_FIELDS = {
    "background": "background responses are not supported; send the request and wait for it, or stream it",
    "conversation": "conversations are not supported; continue a response with previous_response_id",
    "prompt": "prompt templates are not supported; send input and instructions",
    "top_logprobs": "top_logprobs is not supported on /v1/responses; use /v1/chat/completions for logprobs",
}
_TEXT_PARTS = ("input_text", "output_text", "text")
_TOOL_CHOICES = ("none", "auto", "required")
# Efforts that turn the template's thinking off; any other turns it on.
_NO_THINKING = ("none", "minimal")
# The chat path's names for what a Responses request calls otherwise, in the errors it raises.
# "messages" is also an ordinary word in the chat path's errors, so only its param is renamed.
_RENAMES = {"max_completion_tokens": "max_output_tokens", "response_format.json_schema.schema": "text.format.schema",
            "response_format": "text.format", "messages": "input"}


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ---- the request, translated ----


def _refuse_unsupported(req: ResponsesRequest) -> None:
    for name, why in _REFUSED_FIELDS.items():
        if getattr(req, name) not in (None, False, 0):
            raise unsupported(name, why)
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise bad_request(f"max_output_tokens must be >= 1 or null, got {req.max_output_tokens}",
                          param="max_output_tokens")


def input_messages(items: str | list[dict] | None, vision: bool) -> list[dict]:
    """The chat messages of a request's `input`: a string is one user message; items are messages,
    function calls (an assistant turn's `tool_calls`, consecutive calls in one turn),
    function call outputs (tool messages) and reasoning (the next assistant turn's
    `reasoning_content`). Anything else is a 400 naming the item."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not items:
        raise bad_request("input must be a string or a non-empty list of items", param="input")
    out: list[dict] = []
    names: dict[str, str] = {}  # call_id: function name, for the tool messages that answer them
    reasoning = ""
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None) if isinstance(item, dict) else None
        if kind == "message":
            out.append(_message(item, where, vision))
        elif kind == "function_call":
            call = _function_call(item, where)
            names[call["id"]] = call["function"]["name"]
            if not out or out[-1]["role"] != "assistant":
                out.append({"role": "assistant", "content": None})
            out[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            out.append(_call_output(item, where, names))
        elif kind == "reasoning":
            reasoning += _reasoning_text(item, where)
            continue
        else:
            raise bad_request(f"{where}.type {kind!r} is not supported: neuron reads message, function_call, "
                              "function_call_output and reasoning items", param=f"{where}.type")
        if reasoning and out[-1]["role"] == "assistant":
            out[-1]["reasoning_content"], reasoning = reasoning, ""
    return out


def _message(item: dict, where: str, vision: bool) -> dict:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise bad_request(f"{where}.role must be user, assistant, system or developer; got {role!r}",
                          param=f"{where}.role")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of content parts", param=f"{where}.content")
    return {"role": role, "content": [_part(p, f"{where}.content[{j}]", vision) for j, p in enumerate(content)]}


def _part(part, where: str, vision: bool) -> dict:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
        return {"type": "text", "text": part["text"]}
    if kind == "refusal" and isinstance(part.get("refusal"), str):
        return {"type": "text", "text": part["refusal"]}
    if kind == "input_image":
        if not vision:
            raise APIError(400, "this model does not accept images; send text content only", param=where,
                           code="vision_unsupported")
        if not isinstance(part.get("image_url"), str):
            raise bad_request(f"{where} needs image_url, a data: or http(s) URL (file_id is not supported)",
                              param=f"{where}.image_url")
        return {"type": "image_url", "image_url": {"url": part["image_url"]}}
    raise bad_request(f"{where} must be an input_text, output_text or input_image part with its text or "
                      f"image_url; got type {kind!r}", param=where)


def _function_call(item: dict, where: str) -> dict:
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str):
            raise bad_request(f"{where}.{key} must be a string", param=f"{where}.{key}")
    return {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}


def _call_output(item: dict, where: str, names: dict[str, str]) -> dict:
    call_id, output = item.get("call_id"), item.get("output")
    if not isinstance(call_id, str):
        raise bad_request(f"{where}.call_id must be a string", param=f"{where}.call_id")
    if isinstance(output, list) and all(isinstance(p, dict) and p.get("type") == "input_text"
                                        and isinstance(p.get("text"), str) for p in output):
        output = "".join(p["text"] for p in output)
    if not isinstance(output, str):
        raise bad_request(f"{where}.output must be a string or a list of input_text parts", param=f"{where}.output")
    message = {"role": "tool", "tool_call_id": call_id, "content": output}
    if call_id in names:  # templates that name the function a result answers
        message["name"] = names[call_id]
    return message


def _reasoning_text(item: dict, where: str) -> str:
    """A reasoning item's text (its content, else its summary); one with encrypted content alone
    (another server's) adds nothing."""
    for key in ("content", "summary"):
        parts = item.get(key) or []
        if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str)
                                                  for p in parts):
            raise bad_request(f"{where}.{key} must be a list of parts with text", param=f"{where}.{key}")
        if parts:
            return "".join(p["text"] for p in parts)
    return ""


def _chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """Function tools as the chat path takes them (`{"type": "function", "function": {...}}`)."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise unsupported(f"tools[{i}].type", f"tools[{i}] is of type {kind!r}; neuron serves function tools "
                                                  "only, which the client runs itself")
        name, params = tool.get("name"), tool.get("parameters")
        if not isinstance(name, str) or not name:
            raise bad_request(f"tools[{i}].name must be the function's name", param=f"tools[{i}].name")
        if params is not None and not isinstance(params, dict):
            raise bad_request(f"tools[{i}].parameters must be a JSON schema object", param=f"tools[{i}].parameters")
        function = {"name": name, "parameters": params if params is not None else {"type": "object", "properties": {}}}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _chat_tool_choice(choice: str | dict | None) -> str | dict | None:
    if choice is None or choice in _TOOL_CHOICES:
        return choice  # they mean the same on the chat path
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise unsupported("tool_choice", 'tool_choice must be "none", "auto", "required" or {"type": "function", '
                                     '"name": ...}; neuron serves function tools only')


def _response_format(req: ResponsesRequest) -> dict | None:
    """text.format as the chat path's response_format: text (none), json_object or json_schema."""
    fmt = req.text.format if req.text is not None else None
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind != "json_schema":
        raise bad_request(f"text.format.type must be text, json_object or json_schema, got {kind!r}",
                          param="text.format.type")
    if not isinstance(fmt.get("schema"), dict):
        raise bad_request("text.format of type json_schema needs schema, a JSON schema object",
                          param="text.format.schema")
    return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "response"), "schema": fmt["schema"],
                                                   "strict": fmt.get("strict")}}


def _chat_request(req: ResponsesRequest, messages: list[dict]) -> ChatCompletionRequest:
    effort = req.reasoning.effort if req.reasoning is not None else None
    thinking = {"enable_thinking": effort not in _NO_THINKING} if effort is not None else None
    return ChatCompletionRequest(
        model=req.model, messages=messages, max_completion_tokens=req.max_output_tokens,
        temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p, seed=req.seed,
        stop=req.stop, presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty, ignore_eos=req.ignore_eos, cache_salt=req.cache_salt,
        tools=_chat_tools(req.tools), tool_choice=_chat_tool_choice(req.tool_choice),
        parallel_tool_calls=req.parallel_tool_calls, response_format=_response_format(req),
        chat_template_kwargs=thinking)


# ---- the output ----


class _Output:
    """A response's output items, built from the parser's pieces, and (when streaming) the events
    that tell it, each encoded as it happens, numbered in order."""

    def __init__(self, streaming: bool):
        self.items: list[OutputItem] = []
        self._open: OutputItem | None = None
        self._events: list[bytes] | None = [] if streaming else None
        self._seq = 0

    def emit(self, event) -> None:
        if self._events is None:
            return
        event.sequence_number = self._seq
        self._seq += 1
        self._events.append(b"event: " + event.type.encode() + b"\ndata: " + msgspec.json.encode(event) + b"\n\n")

    def take(self) -> bytes:
        """The events emitted since the last take, as SSE bytes."""
        out = b"".join(self._events)
        self._events.clear()
        return out

    def feed(self, parsed: Parsed) -> None:
        if parsed.arguments:  # more of the call already open
            self._arguments(parsed.arguments)
        if parsed.reasoning:
            self._text(ReasoningItem, parsed.reasoning)
        if parsed.content:
            self._text(MessageItem, parsed.content)
        for call in parsed.tool_calls:
            self._call(call)

    def finish(self, complete: bool) -> None:
        self._close("completed" if complete else "incomplete")

    def _begin(self, item: OutputItem) -> int:
        self._close("completed")
        self.items.append(item)
        self._open = item
        self.emit(OutputItemEvent("response.output_item.added", len(self.items) - 1, item))
        return len(self.items) - 1

    def _text(self, kind: type, text: str) -> None:
        item, index = self._open, len(self.items) - 1
        if not isinstance(item, kind):
            item = kind(id=_id("msg" if kind is MessageItem else "rs"), status="in_progress")
            index = self._begin(item)
            item.content.append(OutputText("") if kind is MessageItem else ReasoningText(""))
            self.emit(ContentPartEvent("response.content_part.added", item.id, index, 0, item.content[0]))
        item.content[0].text += text
        delta = OutputTextDelta if kind is MessageItem else ReasoningTextDelta
        self.emit(delta(item.id, index, 0, text))

    def _call(self, call: ParsedToolCall) -> None:
        self._begin(FunctionCallItem(id=_id("fc"), call_id=f"call_{uuid.uuid4().hex[:24]}", name=call.name,
                                     arguments="", status="in_progress"))
        if call.arguments:
            self._arguments(call.arguments)

    def _arguments(self, text: str) -> None:
        item = self._open
        if isinstance(item, FunctionCallItem):
            item.arguments += text
            self.emit(ArgumentsDeltaEvent(item.id, len(self.items) - 1, text))

    def _close(self, status: str) -> None:
        item, index = self._open, len(self.items) - 1
        if item is None:
            return
        if isinstance(item, FunctionCallItem):
            self.emit(ArgumentsDoneEvent(item.id, index, item.name, item.arguments))
        else:
            part = item.content[0]
            done = OutputTextDone if isinstance(item, MessageItem) else ReasoningTextDone
            self.emit(done(item.id, index, 0, part.text))
            self.emit(ContentPartEvent("response.content_part.done", item.id, index, 0, part))
        item.status = status
        self.emit(OutputItemEvent("response.output_item.done", index, item))
        self._open = None


class _Run:
    """One response being made: the chat path's parser over the engine's updates, the output
    items they make, the tokens counted, and the response object at each stage."""

    def __init__(self, req: ResponsesRequest, ctx: ChatRequestContext, samples: Samples, engine: AsyncEngine,
                 history: list[dict]):
        self.req = req
        self.samples = samples
        self.history = history  # the conversation up to this response's output
        self.parser = ChoiceState(ctx).parser
        self.output = _Output(req.stream)
        self.tokens = self.reasoning_tokens = 0
        self.finish_reason: str | None = None
        defaults = engine.default_sampling()
        self.response = ResponseObject(
            id=ctx.id.replace("-", "_", 1),  # resp_<hex>: the engine's logs name it resp-<hex>
            created_at=now(), model=ctx.model, status="in_progress", output=[],
            instructions=req.instructions, max_output_tokens=req.max_output_tokens,
            previous_response_id=req.previous_response_id,
            parallel_tool_calls=req.parallel_tool_calls is not False,
            reasoning={"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
            store=req.store, temperature=_used(req.temperature, defaults, "temperature"),
            top_p=_used(req.top_p, defaults, "top_p"),
            text={"format": req.text.format if req.text and req.text.format else {"type": "text"}},
            tool_choice=req.tool_choice or "auto", tools=req.tools or [], metadata=req.metadata or {},
            user=req.user, truncation=req.truncation or "disabled")

    def update(self, update: Update) -> None:
        reasoning = self.parser.in_reasoning  # this update's tokens continue <think>
        pieces = self.parser.feed_in_order(update.text)
        if update.finished:
            pieces += self.parser.finish_in_order()
        self.tokens += len(update.token_ids)
        if reasoning or any(piece.reasoning for piece in pieces):  # up to the last reasoning token, tags included
            self.reasoning_tokens = self.tokens
        for piece in pieces:
            self.output.feed(piece)
        if update.finished:
            self.finish_reason = update.finish_reason
            self.output.finish(complete=update.finish_reason != "length")

    def final(self) -> ResponseObject:
        """The finished response, kept when the request asks to store it."""
        usage = self.samples.usage([0])
        incomplete = self.finish_reason == "length"
        self.response = msgspec.structs.replace(
            self.response, status="incomplete" if incomplete else "completed", output=self.output.items,
            completed_at=now(), incomplete_details=IncompleteDetails("max_output_tokens") if incomplete else None,
            usage=ResponseUsage(usage.prompt_tokens, InputTokensDetails(), usage.completion_tokens,
                                OutputTokensDetails(self.reasoning_tokens), usage.total_tokens))
        return self.response

    def stored(self, body: bytes) -> StoredResponse:
        return StoredResponse(body, msgspec.json.encode([*self.history, _assistant_turn(self.output.items)]))


def _used(value: float | None, defaults: dict, name: str) -> float:
    """The sampling value a response ran with: the request's, generation_config's, else OpenAI's (1)."""
    return value if value is not None else defaults.get(name, 1.0)


def _assistant_turn(items: list[OutputItem]) -> dict:
    """A response's output as the assistant message that continues its conversation."""
    text = "".join(p.text for item in items if isinstance(item, MessageItem) for p in item.content)
    reasoning = "".join(p.text for item in items if isinstance(item, ReasoningItem) for p in item.content)
    calls = [{"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
             for item in items if isinstance(item, FunctionCallItem)]
    turn = {"role": "assistant", "content": text if text or not calls else None}
    if reasoning:
        turn["reasoning_content"] = reasoning
    if calls:
        turn["tool_calls"] = calls
    return turn


# ---- the routes ----


async def create_response(request: Request, engine: AsyncEngine, req: ResponsesRequest, keepalive_s: float,
                          limiters: Limiters, store: OwnedResponses, cache_salt: str | None = None) -> Response:
    _refuse_unsupported(req)
    history = previous_conversation(store, req.previous_response_id)
    turn = input_messages(req.input, vision=engine.vision is not None)
    head = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    conversation = history + turn
    try:
        if req.truncation == "auto":
            conversation = await _fitted(engine, req, head, conversation, limiters)
        ctx, samples = await open_chat(engine, _chat_request(req, head + conversation), limiters, cache_salt,
                                       "resp")
    except APIError as exc:
        raise renamed(exc, _RENAMES, param_only=("messages",)) from None
    run = _Run(req, ctx, samples, engine, history + turn)
    if req.stream:
        return EventStreamResponse(_events(run, keepalive_s, store), on_close=samples.close)
    return await json_unless_disconnected(request, samples, _collect(run, store))


async def _fitted(engine: AsyncEngine, req: ResponsesRequest, head: list[dict], conversation: list[dict],
                  limiters: Limiters) -> list[dict]:
    """truncation "auto": the conversation with its oldest turns dropped, so that it opens at a user
    message, as few as leave the prompt room for the reply (max_output_tokens, else one token).
    Where even its last user message on does not fit, it is left whole, and refused as too long."""
    check_ready(engine)
    if engine.tokenizer is None:  # the chat path refuses it, saying why
        return conversation
    room = engine.max_model_len - (req.max_output_tokens or 1)

    async def fits(start: int) -> bool:
        chat = _chat_request(req, head + conversation[start:])
        try:
            _, ids, _ = await off_loop(limiters.tokenize, render_chat, engine, chat)
        except APIError:  # too long to render or tokenize: not this cut
            return False
        return len(ids) <= room

    if await fits(0):
        return conversation
    starts = [i for i, m in enumerate(conversation) if i > 0 and m.get("role") == "user"]
    lo, hi = 0, len(starts)  # the first start that fits is in starts[lo:hi], or none does (hi)
    while lo < hi:  # later starts leave less to render, so the ones that fit come after those that do not
        mid = (lo + hi) // 2
        if await fits(starts[mid]):
            hi = mid
        else:
            lo = mid + 1
    return conversation[starts[lo]:] if lo < len(starts) else conversation


def previous_conversation(store: OwnedResponses, response_id: str | None) -> list[dict]:
    """The conversation a stored response ends (without its instructions, as OpenAI continues
    one); a 404 in OpenAI's shape for an id never stored or evicted since."""
    if response_id is None:
        return []
    entry = store.get(response_id)
    if entry is None:
        raise APIError(404, f"Previous response with id {response_id!r} not found: it was never stored, was "
                            "deleted, or was evicted (the server keeps the most recently used)",
                       param="previous_response_id", code="previous_response_not_found")
    return msgspec.json.decode(entry.history)


async def _collect(run: _Run, store: OwnedResponses) -> bytes:
    [stream] = run.samples.streams
    async for update in stream:
        if update.finish_reason == "error":
            raise stream_error(stream, update.error)
        run.update(update)
    body = await encoded(run.final())
    if run.req.store:
        store.put(run.response.id, run.stored(body))
    return body


async def _events(run: _Run, keepalive_s: float, store: OwnedResponses) -> AsyncIterator[bytes]:
    """response.created and .in_progress, then each batch of updates' events in one write, a
    keep-alive comment whenever `keepalive_s` passes with nothing, and the end: response.completed
    or .incomplete, or an error event and response.failed when the generation fails."""
    out = run.output
    try:
        out.emit(LifecycleEvent("response.created", run.response))
        out.emit(LifecycleEvent("response.in_progress", run.response))
        yield out.take()
        async for batch in merged_updates(run.samples.streams, keepalive_s):
            if batch is None:
                yield KEEPALIVE
                continue
            for _, update in batch:
                if update.finish_reason == "error":
                    yield _failed(run, stream_error(run.samples.streams[0], update.error))
                    return
                run.update(update)
            if events := out.take():
                yield events
        final = run.final()
        out.emit(LifecycleEvent(f"response.{final.status}", final))
        if run.req.store:
            store.put(final.id, run.stored(msgspec.json.encode(final)))
        yield out.take()
    finally:
        run.samples.close()


def _failed(run: _Run, error: APIError) -> bytes:
    run.output.emit(ErrorEvent(error.code, error.message, error.param))
    failed = msgspec.structs.replace(run.response, status="failed", output=run.output.items,
                                     error=ResponseError(error.code or "server_error", error.message))
    run.output.emit(LifecycleEvent("response.failed", failed))
    return run.output.take()


async def retrieve_response(store: OwnedResponses, response_id: str, stream: bool) -> Response:
    if stream:
        raise unsupported("stream", "a stored response is returned whole; streaming it again is not supported")
    entry = store.get(response_id)
    if entry is None:
        raise _not_found(response_id)
    return Response(entry.body, media_type="application/json")


async def delete_response(store: OwnedResponses, response_id: str) -> Response:
    if not store.delete(response_id):
        raise _not_found(response_id)
    return Response(msgspec.json.encode(DeletedResponse(response_id)), media_type="application/json")


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id {response_id!r} not found: it was never stored, was deleted, or was "
                         "evicted (the server keeps the most recently used)", param="response_id",
                    code="response_not_found")
