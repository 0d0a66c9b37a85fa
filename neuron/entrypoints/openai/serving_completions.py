"""POST /v1/completions (the legacy text-completion API)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import Response

from neuron.engine.async_engine import AsyncEngine, RequestStream
from neuron.engine.llm_engine import RequestError
from neuron.engine.output_processor import Update
from neuron.engine.parallel_sampling import cumulative_logprob
from neuron.entrypoints.openai.api_errors import bad_request
from neuron.entrypoints.openai.api_types import (
    CompletionChoice,
    CompletionChoiceWithIds,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
)
from neuron.entrypoints.openai.beam import BeamRun, beam_params, best_beams, check_beams, run_beams
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
from neuron.entrypoints.openai.echo import echo_logprobs, prompt_topk, vllm_prompt_logprobs, with_prompt_logprobs
from neuron.entrypoints.openai.guided import compile_guided
from neuron.entrypoints.openai.logprobs import LogprobRenderer
from neuron.entrypoints.openai.prompt_input import Limiters, check_prompt_chars, check_prompt_ids, off_loop
from neuron.entrypoints.openai.streaming import EventStreamResponse, json_unless_disconnected

# OpenAI's default for this endpoint.
DEFAULT_MAX_TOKENS = 16


def _is_ids(value) -> bool:
    ints = isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    return ints and bool(value)


def _prompt_list(prompt) -> list:
    """The request's prompts: a string or a list of token ids is one; a list of those is several."""
    if isinstance(prompt, str) or _is_ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_ids(p) for p in prompt):
        return prompt
    raise bad_request("prompt must be a non-empty string, a non-empty list of token ids, or a non-empty list of "
                      "either", param="prompt")


async def prompt_ids(engine: AsyncEngine, prompt, limiter: anyio.CapacityLimiter, bounded: bool = True,
                     add_special_tokens: bool = True) -> list[int]:
    """One prompt's token ids; text is bounded by its length (unless the request truncates it to
    fit: `bounded` false), then tokenized off the event loop, with the special tokens the
    tokenizer adds unless `add_special_tokens` is false (vLLM's field)."""
    if bounded:
        check_prompt_ids(engine, prompt, "prompt")
    if isinstance(prompt, list):
        return prompt
    if bounded:
        check_prompt_chars(engine, len(prompt), "prompt")
    try:
        return await off_loop(limiter, engine.encode_prompt, prompt, add_special_tokens)
    except RequestError as exc:
        raise bad_request(str(exc), param="prompt") from None


async def _token_prompts(engine: AsyncEngine, req: CompletionRequest, prompts: list,
                         limiter: anyio.CapacityLimiter) -> tuple[list[list[int]], list]:
    """Each prompt's token ids, cut to its last `truncate_prompt_tokens`, and the prompts as echo
    shows them: a cut one as the tokens the model read."""
    keep = req.truncate_prompt_tokens
    whole = [await prompt_ids(engine, prompt, limiter, keep is None, req.add_special_tokens) for prompt in prompts]
    ids = [truncated(engine, w, keep) for w in whole]
    return ids, [p if len(i) == len(w) else i for p, w, i in zip(prompts, whole, ids)]


def _echo_text(tokenizer, prompt) -> str:
    """What echo puts before a completion: a text prompt as sent, token ids decoded ("" without a tokenizer)."""
    if isinstance(prompt, str):
        return prompt
    return tokenizer.decode(prompt, skip_special_tokens=False) if tokenizer is not None else ""


def _check(req: CompletionRequest) -> None:
    check_common(req)


def fill_in_the_middle(engine: AsyncEngine, prompt, suffix: str) -> str:
    """`suffix`: the prompt that asks for the text between `prompt` and it, in the model's
    fill-in-the-middle format; a 400 for a model without one."""
    if not isinstance(prompt, str):
        raise bad_request("suffix needs one text prompt (the text before the gap)", param="suffix")
    text = engine.tokenizer.fill_in_the_middle(prompt, suffix) if engine.tokenizer is not None else None
    if text is None:
        raise bad_request("this model's tokenizer has no fill-in-the-middle tokens, so it cannot take a suffix (code "
                          "models such as Qwen2.5-Coder, StarCoder, DeepSeek-Coder and Codestral have them)",
                          param="suffix")
    return text


class _Context:
    def __init__(self, req: CompletionRequest, model: str, tokenizer, prompts: list, ids: list[list[int]]):
        self.req = req
        self.id, self.engine_id = request_ids("cmpl", req.request_id)
        self.created = now()
        self.model = model
        self.tokenizer = tokenizer
        self.prompts, self.ids = prompts, ids
        self.per_prompt = 1  # streams per prompt, once opened: stream k serves prompt k // per_prompt
        self.echoed: set[int] = set()  # streams whose prompt text went out already
        # Text offsets run on within a choice, so each sample has its own renderer.
        self.renders = defaultdict(lambda: LogprobRenderer(tokenizer, req.return_tokens_as_token_ids))

    def text(self, k: int, update: Update) -> str:
        """The update's text, after the prompt's on a stream's first update when echoing."""
        if not self.req.echo or k in self.echoed:
            return update.text
        self.echoed.add(k)
        return _echo_text(self.tokenizer, self.prompts[k // self.per_prompt]) + update.text

    def logprobs(self, k: int, update: Update) -> CompletionLogprobs | None:
        """The update's tokens in the completions shape, the echoed prompt's first."""
        if self.req.logprobs is None:
            return None
        out = None
        if self.req.echo and update.prompt_logprobs is not None:
            out = echo_logprobs(self.renders[k], self.ids[k // self.per_prompt], update.prompt_logprobs)
        if update.logprobs is not None:
            rendered = self.renders[k].completion(update.token_ids, update.logprobs)
            part = msgspec.convert(rendered, CompletionLogprobs, from_attributes=True)
            out = part if out is None else _joined(out, part)
        return out

    def prompt_logprobs(self, k: int, update: Update) -> list | None:
        if self.req.prompt_logprobs is None or update.prompt_logprobs is None:
            return None
        return vllm_prompt_logprobs(self.renders[k], self.ids[k // self.per_prompt], update.prompt_logprobs,
                                    update.prompt_token_ranks)


def _joined(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        getattr(a, name).extend(getattr(b, name))
    return a


async def create_completion(request: Request, engine: AsyncEngine, req: CompletionRequest, keepalive_s: float,
                            limiters: Limiters, cache_salt: str | None = None) -> Response:
    """`limiters` bound how many prompts are tokenized, and grammars compiled, at once; `cache_salt` is
    the request's, as the server's isolation makes it (common.request_salt). Choice p * n + i is the
    i-th sample of prompt p (vLLM's order)."""
    check_model(req, engine.model_name)
    _check(req)
    check_ready(engine)
    prompts = _prompt_list(req.prompt)
    if req.suffix:
        if len(prompts) != 1 or req.echo:
            raise bad_request("suffix takes one text prompt, without echo", param="suffix")
        prompts = [fill_in_the_middle(engine, prompts[0], req.suffix)]
    max_tokens = DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    if req.use_beam_search:
        return await _beam_completion(request, engine, req, prompts, max_tokens, limiters, cache_salt)
    params = sampling_params(req, engine.default_sampling(), max_tokens=max_tokens, logprobs=req.logprobs, renames={})
    params = with_prompt_logprobs(params, prompt_topk(req))
    check_sequences(engine, len(prompts), params)  # before compiling or tokenizing anything
    grammar = await compile_guided(engine, req, limiters.grammar)
    ids, prompts = await _token_prompts(engine, req, prompts, limiters.tokenize)
    ctx = _Context(req, engine.model_name, engine.tokenizer, prompts, ids)
    samples = open_samples(engine, ctx.engine_id, ids, params, "prompt", grammar=grammar, cache_salt=cache_salt)
    ctx.per_prompt = samples.per_prompt
    if req.stream:
        return EventStreamResponse(_events(ctx, samples, keepalive_s), on_close=samples.close)
    return await json_unless_disconnected(request, samples, _collect(ctx, samples))


async def _beam_completion(request: Request, engine: AsyncEngine, req: CompletionRequest, prompts: list,
                           max_tokens: int, limiters: Limiters, cache_salt: str | None) -> Response:
    """use_beam_search: the n best beams of each prompt, choice p * n + i the i-th best of prompt p."""
    params = beam_params(req, max_tokens)
    check_beams(engine, len(prompts), params)
    ids, shown = await _token_prompts(engine, req, prompts, limiters.tokenize)
    (shown_id, engine_id), run = request_ids("cmpl", req.request_id), BeamRun()

    def echoed(p: int) -> str:
        return _echo_text(engine.tokenizer, shown[p]) if req.echo else ""

    async def collect() -> bytes:
        searches = await run_beams(engine, engine_id, ids, params, run, cache_salt, "prompt")
        beams, usage = best_beams(engine, searches, req.skip_special_tokens)
        choices = [CompletionChoice(i, echoed(i // params.beam_width) + text, None, beam.finish_reason,
                                    beam.stop_reason) for i, (beam, text) in enumerate(beams)]
        return await encoded(CompletionResponse(shown_id, now(), engine.model_name, choices, usage))

    return await json_unless_disconnected(request, run, collect())


@dataclass(slots=True)
class _Sample:
    """One sample's whole output."""

    text: list[str] = field(default_factory=list)
    logprobs: CompletionLogprobs = field(default_factory=CompletionLogprobs)
    cumulative_logprob: float = 0.0
    last: Update | None = None
    prompt_logprobs: list | None = None
    token_ids: list[int] = field(default_factory=list)


async def _rendered(ctx: _Context, k: int, update: Update) -> tuple[CompletionLogprobs | None, list | None]:
    """The update's logprobs and prompt logprobs in the API's shapes. A prompt's (thousands of
    tokens times top-k) are rendered in a worker thread: the event loop keeps answering meanwhile."""
    if update.prompt_logprobs is None:
        return ctx.logprobs(k, update), None
    return await anyio.to_thread.run_sync(lambda: (ctx.logprobs(k, update), ctx.prompt_logprobs(k, update)))


async def _read(ctx: _Context, k: int, stream: RequestStream) -> _Sample:
    out = _Sample()
    async for update in stream:
        out.text.append(ctx.text(k, update))
        lp, prompt_lp = await _rendered(ctx, k, update)
        if lp is not None:
            _joined(out.logprobs, lp)
        out.prompt_logprobs = out.prompt_logprobs or prompt_lp
        out.token_ids += update.token_ids
        if update.logprobs is not None:
            out.cumulative_logprob += cumulative_logprob(update.token_ids, update.logprobs)
        out.last = update
    if out.last.finish_reason == "error":
        raise stream_error(stream, out.last.error)
    return out


async def _collect(ctx: _Context, samples: Samples) -> bytes:
    outs = [await _read(ctx, k, stream) for k, stream in enumerate(samples.streams)]
    chosen = samples.chosen([o.cumulative_logprob for o in outs])
    choices = []
    for index, k in enumerate(chosen):
        o = outs[k]
        fields = (index, "".join(o.text), o.logprobs if ctx.req.logprobs is not None else None, o.last.finish_reason,
                  o.last.stop_reason, o.prompt_logprobs)
        choices.append(CompletionChoiceWithIds(*fields, ctx.ids[k // ctx.per_prompt], o.token_ids)
                       if ctx.req.return_token_ids else CompletionChoice(*fields))
    return await encoded(CompletionResponse(ctx.id, ctx.created, ctx.model, choices, samples.usage(chosen)))


def _chunk(ctx: _Context, choice: CompletionChoice | None, usage: UsageInfo | None = None) -> bytes:
    return sse(CompletionResponse(ctx.id, ctx.created, ctx.model, [choice] if choice else [], usage))


async def _events(ctx: _Context, samples: Samples, keepalive_s: float) -> AsyncIterator[bytes]:
    """Every sample is returned when streaming (best_of > n is refused), so stream k is choice k."""
    running = samples.running_usage(ctx.req.stream_options)
    ids = StreamedIds(len(samples.streams)) if ctx.req.return_token_ids else None

    async def chunks(k: int, update: Update) -> list[bytes]:
        text, (logprobs, prompt_logprobs) = ctx.text(k, update), await _rendered(ctx, k, update)
        usage_so_far = running(k, update) if running else None
        if ids is not None:
            ids.hold(k, update)
        if not (text or logprobs or update.finished):
            return []
        reason, stop_reason = (update.finish_reason, update.stop_reason) if update.finished else (None, None)
        fields = (k, text, logprobs, reason, stop_reason, prompt_logprobs)
        if ids is None:
            return [_chunk(ctx, CompletionChoice(*fields), usage_so_far)]
        token_ids, first = ids.take(k)
        prompt_ids = ctx.ids[k // ctx.per_prompt] if first else None
        return [_chunk(ctx, CompletionChoiceWithIds(*fields, prompt_ids, token_ids), usage_so_far)]

    wants_usage = ctx.req.stream_options and ctx.req.stream_options.include_usage
    usage = (lambda u: _chunk(ctx, None, u)) if wants_usage else None
    async for event in stream_events(samples, keepalive_s, chunks, usage):
        yield event
