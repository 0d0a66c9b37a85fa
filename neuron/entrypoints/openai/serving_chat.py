"""POST /v1/chat/completions."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from neuron.engine.async_engine import AsyncEngine, RequestStream
from neuron.engine.output_processor import Update
from neuron.engine.parallel_sampling import cumulative_logprob
from neuron.engine.tokenizer import TokenizerError
from neuron.entrypoints.openai.api_errors import APIError, bad_request, unsupported
from neuron.entrypoints.openai.api_types import (
    ChatChoice,
    ChatChoiceWithIds,
    ChatChunkChoice,
    ChatChunkChoiceWithIds,
    ChatCompletionChunk,
    ChatCompletionChunkWithIds,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseWithIds,
    ChatLogprobs,
    ChatMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    TokenLogprob,
    ToolCall,
    UsageInfo,
)
from neuron.entrypoints.openai.beam import BeamRun, beam_params, best_beams, check_beams, run_beams
from neuron.entrypoints.openai.chat_utils import (
    check_template_kwargs,
    message_text,
    normalise_messages,
    template_content_chars,
)
from neuron.entrypoints.openai.common import (
    Samples,
    StreamedIds,
    check_common,
    check_model,
    check_ready,
    check_sequences,
    encoded,
    now,
    open_samples,
    request_ids,
    sampling_params,
    sse,
    stream_error,
    stream_events,
    truncated,
)
from neuron.entrypoints.openai.echo import vllm_prompt_logprobs, with_prompt_logprobs
from neuron.entrypoints.openai.guided import compile_guided, function_tools, named_tool
from neuron.entrypoints.openai.logprobs import LogprobRenderer
from neuron.entrypoints.openai.prompt_input import Limiters, check_prompt_chars, off_loop
from neuron.entrypoints.openai.response_parser import (
    GRAMMAR_CALLS,
    TOOL_FORMATS,
    ForcedCallParser,
    OutputParser,
    Parsed,
    tool_format,
)
from neuron.entrypoints.openai.streaming import EventStreamResponse, json_unless_disconnected
from neuron.multimodal.image import ImageError, ImageInput


class ChatRequestContext:
    """Everything about one chat request that its response needs."""

    def __init__(self, req: ChatCompletionRequest, model: str, tokenizer, prompt: str, top_logprobs: int | None,
                 tools: str | None, id_prefix: str = "chatcmpl"):
        """`tools`: the format the reply's tool calls come in (TOOL_FORMATS, or GRAMMAR_CALLS); None
        when it offers none."""
        self.req = req
        self.echo = echoed(req)
        self.tools = tools
        self.id, self.engine_id = request_ids(id_prefix, getattr(req, "request_id", None))
        self.created = now()
        self.model = model
        self.tokenizer = tokenizer
        self.prompt = prompt
        self.top_logprobs = top_logprobs
        self.prompt_ids: list[int] = []  # the rendered prompt's tokens, once opened


class ChoiceState:
    """One choice's output so far: its logprob renderer, its parser and its tool calls."""

    def __init__(self, ctx: ChatRequestContext):
        self.top_logprobs = ctx.top_logprobs
        self.render = LogprobRenderer(ctx.tokenizer, ctx.req.return_tokens_as_token_ids)
        forced, name = ctx.tools == GRAMMAR_CALLS, named_tool(ctx.req)
        self.named = forced and name is not None
        self.parser = (ForcedCallParser(name) if forced
                       else OutputParser.for_chat(ctx.tokenizer, ctx.prompt, tools=ctx.tools))
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
        # A named call the grammar wrote ends as "stop", as OpenAI and vLLM end a named tool_choice.
        return "tool_calls" if reason == "stop" and self.num_tool_calls and not self.named else reason


# Set by the server itself when it renders the template.
def echoed(req: ChatCompletionRequest) -> str:
    """vLLM's `echo`: the last message's text, put before the reply's where that message is the
    reply's role (an assistant's: the reply continues it, or follows it); "" otherwise."""
    last = req.messages[-1] if req.echo and req.messages else None
    if not isinstance(last, dict) or last.get("role") != "assistant":
        return ""
    return message_text(last.get("content"))


def _uses_tools(req: ChatCompletionRequest) -> bool:
    return bool(req.tools) and req.tool_choice != "none"


def _tool_format(req: ChatCompletionRequest, tokenizer) -> str | None:
    """The format of the reply's tool calls. For a model whose format neuron does not know, a
    forced tool_choice is the grammar's JSON alone (GRAMMAR_CALLS), as vLLM serves any model; the
    model deciding (`auto`) is refused, rather than answered with its calls left in the text."""
    if not _uses_tools(req):
        return None
    fmt = tool_format(tokenizer)
    if fmt is None and req.tool_choice in (None, "auto"):
        raise bad_request(f"this model's tokenizer and chat template show no tool-call format neuron reads (it reads "
                          f"{', '.join(TOOL_FORMATS)}: Qwen's <tool_call> tags, Llama 3.1's JSON and Mistral's "
                          '[TOOL_CALLS]), so it cannot decide on tools itself; send tool_choice "required", a named '
                          'function or "none"', param="tools")
    return fmt or GRAMMAR_CALLS


def _check(req: ChatCompletionRequest) -> None:
    check_common(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", param="top_logprobs")
    if req.prompt_logprobs is not None and req.stream:
        raise bad_request("prompt_logprobs come on a whole response; send stream false", param="prompt_logprobs")
    if req.continue_final_message and req.add_generation_prompt:
        raise bad_request("continue_final_message continues the last message, so it needs add_generation_prompt "
                          "false", param="continue_final_message")
    if req.chat_template is not None:
        raise unsupported("chat_template", "chat_template in a request is not accepted: a template is code the "
                                           "server runs; the operator sets one with --chat-template")
    check_template_kwargs(req.chat_template_kwargs)
    if req.tools:
        function_tools(req.tools)


def render_chat(engine: AsyncEngine, req: ChatCompletionRequest) -> tuple[str, list[int], list[ImageInput]]:
    """The prompt and its token ids, each image placeholder expanded to the image's tokens. Images
    are decoded and checked here (CPU work, so off the event loop), before any device work. The
    rendered prompt is bounded by its length before it is tokenized, unless the request cuts it
    to fit (truncate_prompt_tokens: its last tokens are kept)."""
    messages, uris = normalise_messages(req.messages, vision=engine.vision is not None)
    tools = req.tools if _uses_tools(req) else None
    try:
        extra = {"documents": req.documents} if req.documents is not None else {}
        extra |= req.chat_template_kwargs or {}  # which may set documents too, and then wins (as in vLLM)
        prompt = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt,
                                                   continue_final_message=req.continue_final_message, tools=tools,
                                                   **extra)
    except TokenizerError as exc:
        raise bad_request(str(exc), param="messages") from None
    keep = req.truncate_prompt_tokens
    if keep is None:
        check_prompt_chars(engine, len(prompt), "messages")
    ids = engine.tokenizer.encode(prompt, add_special_tokens=req.add_special_tokens)
    if not uris:
        return prompt, truncated(engine, ids, keep), []
    try:
        images = engine.check_images(uris, ids.count(engine.vision.image_token_id))
        return prompt, truncated(engine, engine.expand_images(ids, images), keep, images), images
    except ImageError as exc:
        kind = "server_error" if exc.status >= 500 else "invalid_request_error"
        raise APIError(exc.status, str(exc), type=kind, code=exc.code, param="messages") from None


async def create_chat_completion(request: Request, engine: AsyncEngine, req: ChatCompletionRequest,
                                 keepalive_s: float, limiters: Limiters, cache_salt: str | None = None) -> Response:
    """`limiters` bound how many chats are rendered and tokenized, and grammars compiled, at once;
    `cache_salt` is the request's, as the server's isolation makes it (common.request_salt)."""
    if req.use_beam_search:
        return await _beam_chat(request, engine, req, limiters, cache_salt)
    ctx, samples = await open_chat(engine, req, limiters, cache_salt)
    if req.stream:
        return EventStreamResponse(_events(ctx, samples, keepalive_s), on_close=samples.close)
    return await json_unless_disconnected(request, samples, _collect(ctx, samples))


async def _beam_chat(request: Request, engine: AsyncEngine, req: ChatCompletionRequest, limiters: Limiters,
                     cache_salt: str | None) -> Response:
    """use_beam_search: the n best beams, each reply parsed as a chat's (reasoning apart)."""
    check_model(req, engine.model_name)
    _check(req)
    check_ready(engine)
    _need_tokenizer(engine)
    max_tokens, _ = _max_tokens(req)
    params = beam_params(req, max_tokens or engine.default_sampling().get("max_tokens") or engine.max_model_len)
    check_beams(engine, 1, params)
    prompt, ids, images = await _rendered(engine, req, limiters)
    if images:
        raise bad_request("use_beam_search takes text messages, not images", param="messages")
    ctx, run = ChatRequestContext(req, engine.model_name, engine.tokenizer, prompt, None, None), BeamRun()

    async def collect() -> bytes:
        searches = await run_beams(engine, ctx.engine_id, [ids], params, run, cache_salt, "messages")
        beams, usage = best_beams(engine, searches, req.skip_special_tokens)
        choices = []
        for i, (beam, text) in enumerate(beams):
            parser = OutputParser.for_chat(engine.tokenizer, prompt, tools=None)
            parsed = parser.feed(text)
            parsed.extend(parser.finish())
            message = ChatMessage("assistant", _content(ctx, parsed, []), parsed.reasoning or None, None)
            choices.append(ChatChoice(i, message, None, beam.finish_reason, beam.stop_reason))
        return await encoded(ChatCompletionResponse(ctx.id, ctx.created, ctx.model, choices, usage))

    return await json_unless_disconnected(request, run, collect())


async def _rendered(engine: AsyncEngine, req: ChatCompletionRequest,
                    limiters: Limiters) -> tuple[str, list[int], list[ImageInput]]:
    """render_chat off the event loop, the messages' text bounded at once before it (unless the
    request truncates the prompt to fit)."""
    if req.truncate_prompt_tokens is None:
        check_prompt_chars(engine, template_content_chars(req.messages), "messages")
    return await off_loop(limiters.tokenize, render_chat, engine, req)


def _need_tokenizer(engine: AsyncEngine) -> None:
    if engine.tokenizer is None:
        raise bad_request("this model has no tokenizer, so it cannot chat; use /v1/completions with token ids",
                          param="messages")


def _max_tokens(req: ChatCompletionRequest) -> tuple[int | None, str]:
    """The request's token budget (None: as much as the context leaves) and the field it came in."""
    name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    value = getattr(req, name)
    if value is not None and value < 1:  # only /v1/completions scores a prompt without generating (echo)
        raise bad_request(f"{name} must be >= 1 or null, got {value}", param=name)
    return value, name


async def open_chat(engine: AsyncEngine, req: ChatCompletionRequest, limiters: Limiters,
                    cache_salt: str | None = None, id_prefix: str = "chatcmpl") -> tuple[ChatRequestContext, Samples]:
    """Check, render and queue a chat: its context (its id `id_prefix-...`) and its samples, which
    the caller answers in its API's shape (OpenAI's here, Anthropic's in serving_messages) and closes."""
    check_model(req, engine.model_name)
    _check(req)
    check_ready(engine)
    _need_tokenizer(engine)
    top_logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens, max_name = _max_tokens(req)
    tools = _tool_format(req, engine.tokenizer)
    params = sampling_params(req, engine.default_sampling(), max_tokens=max_tokens, logprobs=top_logprobs,
                             renames={"logprobs": "top_logprobs", "max_tokens": max_name})
    params = with_prompt_logprobs(params, req.prompt_logprobs)
    if tools == "mistral":  # its calls open with a special token, which the parser must see
        params.skip_special_tokens = False
    check_sequences(engine, 1, params)  # before compiling or rendering anything
    grammar = await compile_guided(engine, req, limiters.grammar)
    prompt, prompt_ids, images = await _rendered(engine, req, limiters)
    ctx = ChatRequestContext(req, engine.model_name, engine.tokenizer, prompt, top_logprobs, tools, id_prefix)
    ctx.prompt_ids = prompt_ids
    samples = open_samples(engine, ctx.engine_id, [prompt_ids], params, "messages", images, grammar, cache_salt)
    return ctx, samples


@dataclass(slots=True)
class _Sample:
    """One sample's whole output."""

    state: ChoiceState
    parsed: Parsed = field(default_factory=Parsed)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    last: Update | None = None
    first: Update | None = None  # it carries the prompt's logprobs, where asked
    token_ids: list[int] = field(default_factory=list)


async def read_sample(ctx: ChatRequestContext, stream: RequestStream) -> _Sample:
    out = _Sample(ChoiceState(ctx))
    async for update in stream:
        out.parsed.extend(out.state.parser.feed(update.text))
        if (lp := out.state.logprobs(update)) is not None:
            out.logprobs += lp.content
        if update.logprobs is not None:
            out.cumulative_logprob += cumulative_logprob(update.token_ids, update.logprobs)
        out.first = out.first or update
        out.token_ids += update.token_ids
        out.last = update
    if out.last.finish_reason == "error":
        raise stream_error(stream, out.last.error)
    out.parsed.extend(out.state.parser.finish())
    return out


def _choice(ctx: ChatRequestContext, index: int, out: _Sample) -> ChatChoice:
    parsed = out.parsed
    calls = out.state.tool_calls(parsed)
    message = ChatMessage("assistant", _content(ctx, parsed, calls), parsed.reasoning or None, calls or None)
    fields = (index, message, ChatLogprobs(out.logprobs) if ctx.top_logprobs is not None else None,
              out.state.finish_reason(out.last.finish_reason), out.last.stop_reason)
    return ChatChoiceWithIds(*fields, out.token_ids) if ctx.req.return_token_ids else ChatChoice(*fields)


def _content(ctx: ChatRequestContext, parsed: Parsed, calls: list[ToolCall]) -> str | None:
    """A reply's content: null where it is only calls or reasoning, as OpenAI's; the echoed text first."""
    if ctx.echo or parsed.content or not (calls or parsed.reasoning):
        return ctx.echo + parsed.content
    return None


async def _collect(ctx: ChatRequestContext, samples: Samples) -> bytes:
    outs = [await read_sample(ctx, stream) for stream in samples.streams]
    chosen = samples.chosen([o.cumulative_logprob for o in outs])
    choices = [_choice(ctx, index, outs[k]) for index, k in enumerate(chosen)]
    first = outs[0].first
    prompt_logprobs = None
    if ctx.req.prompt_logprobs is not None and first is not None and first.prompt_logprobs is not None:
        render = LogprobRenderer(ctx.tokenizer, ctx.req.return_tokens_as_token_ids)
        prompt_logprobs = vllm_prompt_logprobs(render, ctx.prompt_ids, first.prompt_logprobs, first.prompt_token_ranks)
    if ctx.req.return_token_ids:
        return await encoded(ChatCompletionResponseWithIds(ctx.id, ctx.created, ctx.model, choices,
                                                           samples.usage(chosen), prompt_logprobs=prompt_logprobs,
                                                           prompt_token_ids=ctx.prompt_ids))
    return await encoded(ChatCompletionResponse(ctx.id, ctx.created, ctx.model, choices, samples.usage(chosen),
                                                prompt_logprobs=prompt_logprobs))


def _chunk(ctx: ChatRequestContext, choice: ChatChunkChoice | None, usage: UsageInfo | None = None,
           prompt_token_ids: list[int] | None = None) -> bytes:
    """A chunk; with `prompt_token_ids` (return_token_ids, a choice's first chunk) carrying them."""
    choices = [choice] if choice else []
    if prompt_token_ids is not None:
        return sse(ChatCompletionChunkWithIds(ctx.id, ctx.created, ctx.model, choices, usage,
                                              prompt_token_ids=prompt_token_ids))
    return sse(ChatCompletionChunk(ctx.id, ctx.created, ctx.model, choices, usage))


def _chunk_choice(ids: StreamedIds | None, index: int, delta: DeltaMessage, logprobs: ChatLogprobs | None = None,
                  reason: str | None = None, stop_reason: int | str | None = None) -> ChatChunkChoice:
    """A chunk's choice; with return_token_ids (`ids`), the tokens since the choice's last chunk."""
    if ids is None:
        return ChatChunkChoice(index, delta, logprobs, reason, stop_reason)
    return ChatChunkChoiceWithIds(index, delta, logprobs, reason, stop_reason, ids.take(index)[0])


def _delta(state: ChoiceState, parsed: Parsed) -> DeltaMessage:
    first = state.num_tool_calls
    calls = [DeltaToolCall(first - 1, DeltaFunctionCall(arguments=parsed.arguments))] if parsed.arguments else []
    calls += [DeltaToolCall(first + i, DeltaFunctionCall(c.function.name, c.function.arguments), c.id, c.type)
              for i, c in enumerate(state.tool_calls(parsed))]
    return DeltaMessage(content=parsed.content or None, reasoning_content=parsed.reasoning or None,
                        tool_calls=calls or None)


def _update_chunks(ctx: ChatRequestContext, state: ChoiceState, index: int, update: Update,
                   usage: UsageInfo | None = None, ids: StreamedIds | None = None) -> list[bytes]:
    """The chunks one update of choice `index` makes: its delta, then its finish reason once done;
    each with `usage` (continuous_usage_stats), and with `ids` its tokens (return_token_ids)."""
    parsed = state.parser.feed(update.text)
    if update.finished:
        parsed.extend(state.parser.finish())
    logprobs = state.logprobs(update)
    chunks = []
    if ids is not None:
        ids.hold(index, update)
    if parsed or logprobs:
        chunks.append(_chunk(ctx, _chunk_choice(ids, index, _delta(state, parsed), logprobs), usage))
    if update.finished:
        reason = state.finish_reason(update.finish_reason)
        chunks.append(_chunk(ctx, _chunk_choice(ids, index, DeltaMessage(), None, reason, update.stop_reason), usage))
    return chunks


async def _events(ctx: ChatRequestContext, samples: Samples, keepalive_s: float) -> AsyncIterator[bytes]:
    """Every sample is returned when streaming (best_of > n is refused), so stream k is choice k;
    each choice opens with its role, then chunks of all choices interleave as they come."""
    states = [ChoiceState(ctx) for _ in samples.streams]
    running = samples.running_usage(ctx.req.stream_options)
    ids = StreamedIds(len(states)) if ctx.req.return_token_ids else None
    opening = [_chunk(ctx, _chunk_choice(ids, i, DeltaMessage(role="assistant", content="")),
                      running(i, None) if running else None, ctx.prompt_ids if ids is not None else None)
               for i in range(len(states))]
    if ctx.echo:
        opening += [_chunk(ctx, ChatChunkChoice(i, DeltaMessage(content=ctx.echo))) for i in range(len(states))]

    async def chunks(k: int, update: Update) -> list[bytes]:
        return _update_chunks(ctx, states[k], k, update, running(k, update) if running else None, ids)

    wants_usage = ctx.req.stream_options and ctx.req.stream_options.include_usage
    usage = (lambda u: _chunk(ctx, None, u)) if wants_usage else None
    async for event in stream_events(samples, keepalive_s, chunks, usage, opening):
        yield event
