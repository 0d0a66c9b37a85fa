"""POST /v1/chat/completions."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import Response

from neuron.engine.async_engine import AsyncEngine, RequestStream
from neuron.engine.output_processor import LogprobRenderer, OutputParser, Parsed, Update
from neuron.engine.tokenizer import TokenizerError
from neuron.entrypoints.openai.api_errors import APIError, bad_request, unsupported
from neuron.entrypoints.openai.api_types import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    TokenLogprob,
    ToolCall,
)
from neuron.entrypoints.openai.chat_utils import normalise_messages, template_content_chars
from neuron.entrypoints.openai.common import (
    check_common,
    check_model,
    new_id,
    now,
    open_stream,
    ready_engine,
    sampling_params,
    sse,
    stream_error,
    usage,
)
from neuron.entrypoints.openai.prompt_input import check_prompt_chars, off_loop
from neuron.entrypoints.openai.streaming import (
    DONE,
    KEEPALIVE,
    EventStreamResponse,
    json_unless_disconnected,
    updates_with_keepalive,
)
from neuron.multimodal.image import ImageError, ImageInput


class ChatRequestContext:
    """Everything about one chat request that its response needs."""

    def __init__(self, req: ChatCompletionRequest, model: str, tokenizer, prompt: str, top_logprobs: int | None):
        self.req = req
        self.id = new_id("chatcmpl")
        self.created = now()
        self.model = model
        self.top_logprobs = top_logprobs
        self.render = LogprobRenderer(tokenizer, req.return_tokens_as_token_ids)
        self.parser = OutputParser.for_chat(tokenizer, prompt, tools=_uses_tools(req))
        self.num_tool_calls = 0

    def logprobs(self, update: Update) -> ChatLogprobs | None:
        if self.top_logprobs is None or update.logprobs is None:
            return None
        entries = self.render.chat(update.token_ids, update.logprobs, self.top_logprobs)
        return ChatLogprobs(msgspec.convert(entries, list[TokenLogprob], from_attributes=True))

    def tool_calls(self, parsed: Parsed) -> list[ToolCall]:
        self.num_tool_calls += len(parsed.tool_calls)
        return [ToolCall(f"call_{uuid.uuid4().hex[:24]}", FunctionCall(c.name, c.arguments)) for c in parsed.tool_calls]

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.num_tool_calls else reason


# Set by the server itself when it renders the template.
_TEMPLATE_ARGS = frozenset({"messages", "tools", "add_generation_prompt"})


def _uses_tools(req: ChatCompletionRequest) -> bool:
    return bool(req.tools) and req.tool_choice != "none"


def _check(req: ChatCompletionRequest) -> None:
    check_common(req)
    choice = req.tool_choice
    if choice not in (None, "auto", "none"):
        raise unsupported("tool_choice", "tool_choice must be \"auto\" or \"none\"; forcing a tool is not supported")
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise unsupported("response_format", "structured output (response_format) is not supported")
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", param="top_logprobs")
    reserved = _TEMPLATE_ARGS & set(req.chat_template_kwargs or ())
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(sorted(reserved))}",
                          param="chat_template_kwargs")


def _render(llm, req: ChatCompletionRequest) -> tuple[str, list[int], list[ImageInput]]:
    """The prompt and its token ids, each image placeholder expanded to the image's tokens. Images
    are decoded and checked here (CPU work, so off the event loop), before any device work. The
    rendered prompt is bounded by its length before it is tokenized."""
    messages, uris = normalise_messages(req.messages, vision=llm.vision is not None)
    tools = req.tools if _uses_tools(req) else None
    try:
        prompt = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools,
                                                   **(req.chat_template_kwargs or {}))
    except TokenizerError as exc:
        raise bad_request(str(exc), param="messages") from None
    check_prompt_chars(llm, len(prompt), "messages")
    ids = llm.tokenizer.encode(prompt)
    if not uris:
        return prompt, ids, []
    try:
        images = llm.check_images(uris)
        return prompt, llm.expand_images(ids, images), images
    except ImageError as exc:
        kind = "server_error" if exc.status >= 500 else "invalid_request_error"
        raise APIError(exc.status, str(exc), type=kind, code=exc.code, param="messages") from None


async def create_chat_completion(request: Request, engine: AsyncEngine, req: ChatCompletionRequest,
                                 keepalive_s: float, limiter: anyio.CapacityLimiter) -> Response:
    """`limiter` bounds how many chats are rendered and tokenized at once."""
    check_model(req, engine.model_name)
    _check(req)
    llm = ready_engine(engine)
    if llm.tokenizer is None:
        raise bad_request("this model has no tokenizer, so it cannot chat; use /v1/completions with token ids",
                          param="messages")
    top_logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    params = sampling_params(req, llm.default_sampling(), max_tokens=getattr(req, max_name), logprobs=top_logprobs,
                             renames={"logprobs": "top_logprobs", "max_tokens": max_name})
    check_prompt_chars(llm, template_content_chars(req.messages), "messages")  # at once, before the template
    prompt, prompt_ids, images = await off_loop(limiter, _render, llm, req)
    ctx = ChatRequestContext(req, engine.model_name, llm.tokenizer, prompt, top_logprobs)
    stream = open_stream(engine, ctx.id, prompt_ids, params, prompt_param="messages", images=images)
    if req.stream:
        return EventStreamResponse(_events(ctx, stream, keepalive_s), on_close=stream.close)
    return await json_unless_disconnected(request, stream, _collect(ctx, stream))


async def _collect(ctx: ChatRequestContext, stream: RequestStream) -> bytes:
    parsed, logprobs, last = Parsed(), [], None
    async for update in stream:
        parsed.extend(ctx.parser.feed(update.text))
        if (lp := ctx.logprobs(update)) is not None:
            logprobs += lp.content
        last = update
    if last.finish_reason == "error":
        raise stream_error(stream, last.error)
    parsed.extend(ctx.parser.finish())
    calls = ctx.tool_calls(parsed)
    content = parsed.content if parsed.content or not (calls or parsed.reasoning) else None
    message = ChatMessage("assistant", content, parsed.reasoning or None, calls)
    choice = ChatChoice(0, message, ChatLogprobs(logprobs) if ctx.top_logprobs is not None else None,
                        ctx.finish_reason(last.finish_reason), last.stop_reason)
    return msgspec.json.encode(ChatCompletionResponse(ctx.id, ctx.created, ctx.model, [choice], usage(stream)))


def _chunk(ctx: ChatRequestContext, choice: ChatChunkChoice | None, stream: RequestStream | None = None) -> bytes:
    return sse(ChatCompletionChunk(ctx.id, ctx.created, ctx.model, [choice] if choice else [],
                                   usage(stream) if stream else None))


def _delta(ctx: ChatRequestContext, parsed: Parsed) -> DeltaMessage:
    first = ctx.num_tool_calls
    calls = [DeltaToolCall(first + i, c.id, c.function) for i, c in enumerate(ctx.tool_calls(parsed))]
    return DeltaMessage(content=parsed.content or None, reasoning_content=parsed.reasoning or None,
                        tool_calls=calls or None)


async def _events(ctx: ChatRequestContext, stream: RequestStream, keepalive_s: float) -> AsyncIterator[bytes]:
    try:
        yield _chunk(ctx, ChatChunkChoice(0, DeltaMessage(role="assistant", content="")))
        async for update in updates_with_keepalive(stream, keepalive_s):
            if update is None:
                yield KEEPALIVE
                continue
            if update.finish_reason == "error":
                yield sse(stream_error(stream, update.error).body())
                return
            parsed = ctx.parser.feed(update.text)
            if update.finished:
                parsed.extend(ctx.parser.finish())
            logprobs = ctx.logprobs(update)
            if parsed or logprobs:
                yield _chunk(ctx, ChatChunkChoice(0, _delta(ctx, parsed), logprobs))
            if update.finished:
                reason = ctx.finish_reason(update.finish_reason)
                yield _chunk(ctx, ChatChunkChoice(0, DeltaMessage(), None, reason, update.stop_reason))
        if ctx.req.stream_options and ctx.req.stream_options.include_usage:
            yield _chunk(ctx, None, stream)
        yield DONE
    finally:
        stream.close()
