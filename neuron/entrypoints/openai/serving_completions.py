"""POST /v1/completions (the legacy text-completion API)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import Response

from neuron.engine.async_engine import AsyncEngine, RequestStream
from neuron.engine.llm_engine import RequestError, encode_prompt
from neuron.engine.output_processor import LogprobRenderer, Update
from neuron.entrypoints.openai.api_errors import bad_request, unsupported
from neuron.entrypoints.openai.api_types import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
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
from neuron.entrypoints.openai.prompt_input import check_prompt_chars, check_prompt_ids, off_loop
from neuron.entrypoints.openai.streaming import (
    DONE,
    KEEPALIVE,
    EventStreamResponse,
    json_unless_disconnected,
    updates_with_keepalive,
)

# OpenAI's default for this endpoint.
DEFAULT_MAX_TOKENS = 16


def _is_ids(value) -> bool:
    ints = isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    return ints and bool(value)


async def prompt_ids(llm, prompt, limiter: anyio.CapacityLimiter) -> list[int]:
    """A string, a list of token ids, or a one-element list holding either; text is bounded by its
    length, then tokenized off the event loop."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    check_prompt_ids(llm, prompt, "prompt")
    if isinstance(prompt, str):
        check_prompt_chars(llm, len(prompt), "prompt")
        try:
            return await off_loop(limiter, encode_prompt, llm, prompt)
        except RequestError as exc:
            raise bad_request(str(exc), param="prompt") from None
    if _is_ids(prompt):
        return prompt
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise unsupported("prompt", "batched prompts are not supported; send one prompt per request")
    raise bad_request("prompt must be a non-empty string or a non-empty list of token ids", param="prompt")


def _check(req: CompletionRequest) -> None:
    check_common(req)
    if req.echo:
        raise unsupported("echo", "echo is not supported")
    if req.best_of not in (None, 1):
        raise unsupported("best_of", "best_of > 1 is not supported")
    if req.suffix:
        raise unsupported("suffix", "suffix is not supported")


class _Context:
    def __init__(self, req: CompletionRequest, model: str, tokenizer):
        self.req = req
        self.id = new_id("cmpl")
        self.created = now()
        self.model = model
        self.render = LogprobRenderer(tokenizer, req.return_tokens_as_token_ids)

    def logprobs(self, update: Update) -> CompletionLogprobs | None:
        if self.req.logprobs is None or update.logprobs is None:
            return None
        rendered = self.render.completion(update.token_ids, update.logprobs)
        return msgspec.convert(rendered, CompletionLogprobs, from_attributes=True)


async def create_completion(request: Request, engine: AsyncEngine, req: CompletionRequest, keepalive_s: float,
                            limiter: anyio.CapacityLimiter) -> Response:
    """`limiter` bounds how many prompts are tokenized at once."""
    check_model(req, engine.model_name)
    _check(req)
    llm = ready_engine(engine)
    ids = await prompt_ids(llm, req.prompt, limiter)
    ctx = _Context(req, engine.model_name, llm.tokenizer)
    max_tokens = DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    params = sampling_params(req, llm.default_sampling(), max_tokens=max_tokens, logprobs=req.logprobs, renames={})
    stream = open_stream(engine, ctx.id, ids, params, prompt_param="prompt")
    if req.stream:
        return EventStreamResponse(_events(ctx, stream, keepalive_s), on_close=stream.close)
    return await json_unless_disconnected(request, stream, _collect(ctx, stream))


async def _collect(ctx: _Context, stream: RequestStream) -> bytes:
    text, logprobs, last = [], CompletionLogprobs(), None
    async for update in stream:
        text.append(update.text)
        if (lp := ctx.logprobs(update)) is not None:
            for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                getattr(logprobs, name).extend(getattr(lp, name))
        last = update
    if last.finish_reason == "error":
        raise stream_error(stream, last.error)
    choice = CompletionChoice(0, "".join(text), logprobs if ctx.req.logprobs is not None else None,
                              last.finish_reason, last.stop_reason)
    return msgspec.json.encode(CompletionResponse(ctx.id, ctx.created, ctx.model, [choice], usage(stream)))


def _chunk(ctx: _Context, choice: CompletionChoice | None, stream: RequestStream | None = None) -> bytes:
    return sse(CompletionResponse(ctx.id, ctx.created, ctx.model, [choice] if choice else [],
                                  usage(stream) if stream else None))


async def _events(ctx: _Context, stream: RequestStream, keepalive_s: float) -> AsyncIterator[bytes]:
    try:
        async for update in updates_with_keepalive(stream, keepalive_s):
            if update is None:
                yield KEEPALIVE
                continue
            if update.finish_reason == "error":
                yield sse(stream_error(stream, update.error).body())
                return
            logprobs = ctx.logprobs(update)
            if update.text or logprobs or update.finished:
                reason = update.finish_reason if update.finished else None
                stop_reason = update.stop_reason if update.finished else None
                yield _chunk(ctx, CompletionChoice(0, update.text, logprobs, reason, stop_reason))
        if ctx.req.stream_options and ctx.req.stream_options.include_usage:
            yield _chunk(ctx, None, stream)
        yield DONE
    finally:
        stream.close()
