"""Ollama's API: /api/chat, /api/generate, /api/tags, /api/ps, /api/show and /api/version, for
the apps that speak it.

A translation, not a second server: a chat or a templated generate becomes the chat path's request
(`ChatCompletionRequest`: its template, tools, reasoning switch, structured output and images) and
is opened by `open_chat`; a raw generate is tokenized and opened as /v1/completions opens a text
prompt. What comes back is the same engine stream, parsed by the chat path's parser and written
as Ollama writes it: one JSON object a line (NDJSON) while it streams, the default, or one object
with `"stream": false`, the last carrying `done`, `done_reason` and the counts and durations
(nanoseconds). Errors are Ollama's `{"error": "..."}` with the status the OpenAI routes would give.

Options map onto the sampling params; those neuron cannot honour are refused by name, those that
are the server's own settings (num_ctx, num_gpu, num_thread, ...) are ignored, as Ollama ignores
options it does not know. `keep_alive` sets how long an on-demand model stays loaded once idle
(the host's keep_alive); a model loaded at start-up stays loaded. neuron never downloads, pushes
or creates models: those routes answer a clear error.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import msgspec
from msgspec import Struct
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import neuron
from neuron.engine.async_engine import AsyncEngine, RequestStream
from neuron.engine.host import HostedModel, HostError, ModelHost
from neuron.engine.output_processor import Update
from neuron.entrypoints.openai.admin import host_error
from neuron.entrypoints.openai.api_errors import APIError, bad_request, unsupported
from neuron.entrypoints.openai.api_types import ChatCompletionRequest, CompletionRequest, TokenLogprob
from neuron.entrypoints.openai.common import (
    Samples,
    check_model,
    check_ready,
    new_id,
    open_samples,
    sampling_params,
    stream_error,
)
from neuron.entrypoints.openai.guided import compile_guided
from neuron.entrypoints.openai.logprobs import LogprobRenderer
from neuron.entrypoints.openai.prompt_input import Limiters
from neuron.entrypoints.openai.response_parser import THINK_CLOSE, THINK_OPEN, Parsed, tool_format
from neuron.entrypoints.openai.serving_chat import ChoiceState, open_chat
from neuron.entrypoints.openai.serving_completions import prompt_ids
from neuron.entrypoints.openai.streaming import NDJSONResponse, json_unless_disconnected, merged_updates

# The Ollama release whose API these routes follow; /api/version answers it, since clients compare
# it with the versions that brought the features they use.
OLLAMA_API_VERSION = "0.12.0"
_FOREVER = "2318-01-01T00:00:00Z"  # expires_at of a model that stays loaded, as Ollama writes it
_THINK_LEVELS = ("low", "medium", "high")
# The engine's names for what Ollama's requests call otherwise, for the errors the chat path raises.
_OLLAMA_NAMES = {"temperature": "options.temperature", "top_p": "options.top_p", "top_k": "options.top_k",
                 "min_p": "options.min_p", "seed": "options.seed", "stop": "options.stop",
                 "repetition_penalty": "options.repeat_penalty", "presence_penalty": "options.presence_penalty",
                 "frequency_penalty": "options.frequency_penalty", "max_tokens": "options.num_predict",
                 "response_format": "format", "response_format.json_schema.schema": "format",
                 "chat_template_kwargs": "think"}


# ---- requests ----


class Options(Struct, kw_only=True):
    """The options neuron reads. Others (num_ctx, num_gpu, num_thread, num_batch, use_mmap, ...) set
    up Ollama's runner; neuron's are its command line's, so they are ignored, as are unknown keys."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    typical_p: float | None = None
    tfs_z: float | None = None
    num_predict: int | None = None
    stop: list[str] | str | None = None
    seed: int | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    mirostat: int | None = None


class _Common(Struct, kw_only=True):
    model: str = ""
    format: str | dict[str, Any] | None = None
    options: Options | None = None
    stream: bool = True
    keep_alive: float | str | None = None
    think: bool | str | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class OllamaChatRequest(_Common, kw_only=True):
    messages: list[Any] = []
    tools: list[dict[str, Any]] | None = None


class OllamaGenerateRequest(_Common, kw_only=True):
    prompt: str = ""
    system: str | None = None
    images: list[str] | None = None
    raw: bool = False
    suffix: str | None = None
    template: str | None = None
    context: list[int] | None = None


class OllamaShowRequest(Struct, kw_only=True):
    model: str = ""
    name: str = ""  # the older clients' name for `model`


# ---- the routes ----


def ollama_error(exc: APIError) -> Response:
    """Ollama's error shape: the message alone, with the status (and headers) the API chose."""
    return JSONResponse({"error": exc.message}, exc.status, exc.headers or None)


@dataclass(slots=True)
class Served:
    """What the routes borrow from the server: its models, its places for client-controlled work,
    and how it decodes a body, finds a model's engine and salts a request's cache."""

    host: ModelHost
    limiters: Limiters
    decode: Callable[[Request, type], Awaitable[Any]]
    engine: Callable[[str], Awaitable[AsyncEngine]]
    salt: Callable[[Request, Any], str | None]
    keepalive_s: float
    started: float


def ollama_routes(served: Served, endpoint: Callable) -> list[Route]:
    """Every route through `endpoint` (admission, limits, the API key, the guards), its errors in
    Ollama's shape."""
    api = _Ollama(served)

    def route(path: str, handler, method: str = "POST") -> Route:
        name = "ollama_" + path.rsplit("/", 1)[1]  # the request counter's label: ollama_chat, ...
        return Route(path, endpoint(name, handler, shape=ollama_error), methods=[method])

    routes = [route("/api/chat", api.chat), route("/api/generate", api.generate), route("/api/show", api.show),
              route("/api/tags", api.tags, "GET"), route("/api/ps", api.ps, "GET"),
              route("/api/version", api.version, "GET")]
    for path, method in _REFUSED.items():
        routes.append(route(path, api.refused, method))
    return routes


_NO_DOWNLOADS = ("neuron serves the models it was started with (or that its admin API loads) and never downloads, "
                 "pushes, creates, copies or deletes models; /api/tags lists the models served")
_REFUSED = {"/api/pull": "POST", "/api/push": "POST", "/api/create": "POST", "/api/copy": "POST",
            "/api/delete": "DELETE", "/api/embed": "POST", "/api/embeddings": "POST"}


class _Ollama:
    def __init__(self, served: Served):
        self.s = served

    async def chat(self, request: Request) -> Response:
        started = time.monotonic()
        req = await self.s.decode(request, OllamaChatRequest)
        name, engine, load_s = await self._model(req)
        if not req.messages:  # Ollama's way to load (or, with keep_alive 0, unload) a model
            return self._loaded(name, engine, "message")
        chat = _chat_request(name, req, engine)
        ctx, samples = await _opened(open_chat(engine, chat, self.s.limiters, self.s.salt(request, chat)))
        state = ChoiceState(ctx)
        reply = _Reply(name, "message", state.parser, state, started, load_s)
        return await self._respond(request, req.stream, samples, reply)

    async def generate(self, request: Request) -> Response:
        started = time.monotonic()
        req = await self.s.decode(request, OllamaGenerateRequest)
        _check_generate(req)
        name, engine, load_s = await self._model(req)
        if not req.prompt and not req.images:
            return self._loaded(name, engine, "response")
        if req.raw:
            samples, reply = await self._raw(request, name, engine, req, started, load_s)
        else:
            chat = _chat_request(name, req, engine, _prompt_messages(req))
            ctx, samples = await _opened(open_chat(engine, chat, self.s.limiters, self.s.salt(request, chat)))
            state = ChoiceState(ctx)
            reply = _Reply(name, "response", state.parser, state, started, load_s)
        return await self._respond(request, req.stream, samples, reply)

    async def _raw(self, request: Request, name: str, engine: AsyncEngine, req: OllamaGenerateRequest,
                   started: float, load_s: float) -> tuple[Samples, _Reply]:
        """The prompt as it is, no template (as /v1/completions takes a text prompt); the reply is text."""
        if req.images:
            raise bad_request("images need the chat template, which raw leaves out; send raw false", param="images")
        if req.think:
            raise bad_request("think needs the chat template, which raw leaves out; send raw false", param="think")
        fields = _sampling_fields(req)
        completion = CompletionRequest(model=name, prompt=req.prompt, **fields)
        check_model(completion, engine.model_name)
        check_ready(engine)
        top = (req.top_logprobs or 0) if req.logprobs else None
        try:
            params = sampling_params(completion, engine.default_sampling(), max_tokens=completion.max_tokens,
                                     logprobs=top, renames={})
            grammar = await compile_guided(engine, completion, self.s.limiters.grammar)
            ids = await prompt_ids(engine, req.prompt, self.s.limiters.tokenize)
            samples = open_samples(engine, new_id("cmpl"), [ids], params, "prompt", grammar=grammar,
                                   cache_salt=self.s.salt(request, completion))
        except APIError as exc:
            raise _renamed(exc) from None
        return samples, _Reply(name, "response", _Text(), _RawLogprobs(engine.tokenizer, top), started, load_s)

    async def _model(self, req: _Common) -> tuple[str, AsyncEngine, float]:
        """The model a request names (Ollama's `name:latest` is `name`), its engine, loaded first if
        it loads on demand (and how long that took), and the request's keep_alive applied to it."""
        keep = parse_keep_alive(req.keep_alive)
        name = served_name(self.s.host, req.model)
        began = time.monotonic()
        engine = await self.s.engine(name)
        load_s = time.monotonic() - began
        m = self.s.host.models.get(name)
        if m is not None:
            m.keep_for(m.spec.keep_alive_s if keep is _DEFAULT else keep)
        return name, engine, load_s

    def _loaded(self, name: str, engine: AsyncEngine, field: str) -> Response:
        """The answer to a request with nothing to generate: the model is loaded now, or it will be
        unloaded at once (keep_alive 0 on a model that loads on demand)."""
        check_ready(engine)
        m = self.s.host.models.get(name)
        unloads = m is not None and m.spec.load == "on_demand" and m.keep_alive_s == 0
        body = {"model": name, "created_at": _now()}
        body[field] = {"role": "assistant", "content": ""} if field == "message" else ""
        body.update(done=True, done_reason="unload" if unloads else "load")
        return JSONResponse(body)

    async def _respond(self, request: Request, stream: bool, samples: Samples, reply: _Reply) -> Response:
        if stream:
            return NDJSONResponse(_lines(reply, samples, self.s.keepalive_s), on_close=samples.close)
        return await json_unless_disconnected(request, samples, _collect(reply, samples))

    async def show(self, request: Request) -> Response:
        req = await self.s.decode(request, OllamaShowRequest)
        name = served_name(self.s.host, req.model or req.name)
        try:
            m = self.s.host.model(name)
        except HostError as exc:
            raise host_error(exc, param="model") from None
        return JSONResponse(_show(m, self.s.started))

    async def tags(self, request: Request) -> Response:
        return JSONResponse({"models": [_card(m, self.s.started) for m in self.s.host.models.values()]})

    async def ps(self, request: Request) -> Response:
        loaded = [m for m in self.s.host.models.values() if m.engine is not None and m.engine.loaded]
        return JSONResponse({"models": [_running(m, self.s.started) for m in loaded]})

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": OLLAMA_API_VERSION, "neuron": neuron.__version__})

    async def refused(self, request: Request) -> Response:
        path = request.url.path
        if path in ("/api/embed", "/api/embeddings"):
            raise APIError(400, f"{path} is not served: neuron serves embeddings at /v1/embeddings (OpenAI's API)",
                           code="unsupported_endpoint")
        raise APIError(403, f"{path} is refused: {_NO_DOWNLOADS}", code="unsupported_endpoint")


async def _opened(opening: Awaitable):
    """The chat path's opening, its errors naming the Ollama request's fields."""
    try:
        return await opening
    except APIError as exc:
        raise _renamed(exc) from None


def _renamed(exc: APIError) -> APIError:
    name = _OLLAMA_NAMES.get(exc.param or "")
    if name is None:
        return exc
    exc.message = exc.message.replace(exc.param, name, 1)
    exc.param = name
    return exc


# ---- model names and keep_alive ----


def served_name(host: ModelHost, name: str) -> str:
    """The served model a request means: its name, or Ollama's `NAME:latest` for NAME."""
    if name in host.models or not name.endswith(":latest"):
        return name
    stem = name.removesuffix(":latest")
    return stem if stem in host.models else name


_DEFAULT = object()  # no keep_alive in the request: the model's own
_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_MAX_KEEP_S = 1e9


def parse_keep_alive(value: float | str | None):
    """Seconds to stay loaded once idle, None for good (any negative value), or _DEFAULT when the
    request says nothing. A number is seconds; a string is a Go duration ("5m", "1h30m", "-1s") or a
    number of seconds."""
    if value is None:
        return _DEFAULT
    seconds = value if not isinstance(value, str) else _duration_s(value)
    if seconds is None or seconds != seconds:
        raise bad_request(f'keep_alive must be seconds or a duration such as "5m", got {value!r:.40}',
                          param="keep_alive")
    return None if seconds < 0 else min(float(seconds), _MAX_KEEP_S)


def _duration_s(text: str) -> float | None:
    text = text.strip()
    sign, body = (-1, text[1:]) if text.startswith("-") else (1, text.removeprefix("+"))
    try:
        return sign * float(body)
    except ValueError:
        pass
    parts = _DURATION.findall(body)
    if not parts or "".join(n + u for n, u in parts) != body:
        return None
    return sign * sum(float(n) * _UNIT_S[u] for n, u in parts)


# ---- requests into the chat path's ----


def _check_generate(req: OllamaGenerateRequest) -> None:
    if req.suffix:
        raise unsupported("suffix", "suffix (fill in the middle) is not supported")
    if req.template:
        raise unsupported("template", "template is not supported: neuron renders the checkpoint's own chat template "
                                      "(Jinja); send raw true with a prompt you rendered yourself")
    if req.context:
        raise unsupported("context", "context (deprecated by Ollama) is not supported: send the conversation to "
                                     "/api/chat as messages")


def _prompt_messages(req: OllamaGenerateRequest) -> list[dict]:
    """A templated generate is a chat of one user turn, after the system prompt when it has one."""
    user = {"role": "user", "content": req.prompt}
    if req.images:
        user["images"] = req.images
    return ([{"role": "system", "content": req.system}] if req.system else []) + [user]


def _chat_request(name: str, req: _Common, engine: AsyncEngine, messages: list | None = None) -> ChatCompletionRequest:
    """The chat path's request for an Ollama chat (or templated generate): the same messages, tools,
    sampling, structured output and reasoning switch, in its names."""
    check_ready(engine)
    tools = getattr(req, "tools", None) or None
    if tools and engine.tokenizer is not None and tool_format(engine.tokenizer) is None:
        raise bad_request("this model's chat template shows no tool-call format neuron reads (Qwen's <tool_call> "
                          "tags, Llama 3.1's JSON or Mistral's [TOOL_CALLS]), so it cannot take tools", param="tools")
    kwargs = _think(req, engine)
    return ChatCompletionRequest(
        model=name, messages=[_message(m, i) for i, m in enumerate(messages or req.messages)], tools=tools,
        logprobs=req.logprobs, top_logprobs=req.top_logprobs, response_format=_format(req.format),
        chat_template_kwargs=kwargs, **_sampling_fields(req))


def _message(m: Any, i: int) -> dict:
    """An Ollama message as the chat path takes it: images become image parts (data: URIs), tool
    calls the OpenAI shape with their arguments left as objects (chat templates take either), and
    a tool result's `tool_name` its `name` too."""
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad_request(f"{where} must be an object with a role and content", param=where)
    out = {k: v for k, v in m.items() if k not in ("images", "tool_calls")}
    out.setdefault("content", "")  # Ollama's messages may leave it out (a turn that only calls tools)
    if m.get("tool_name") is not None:
        out.setdefault("name", m["tool_name"])
    images = m.get("images")
    if images:
        if not isinstance(images, list) or not all(isinstance(x, str) for x in images):
            raise bad_request(f"{where}.images must be a list of base64 strings", param=f"{where}.images")
        if not isinstance(out["content"], str):
            raise bad_request(f"{where}.content must be a string", param=f"{where}.content")
        parts = [{"type": "image_url", "image_url": {"url": _data_uri(x)}} for x in images]
        out["content"] = parts + [{"type": "text", "text": out["content"]}]
    if m.get("tool_calls") is not None:
        out["tool_calls"] = _tool_calls(m["tool_calls"], where)
    return out


def _data_uri(image: str) -> str:
    return image if image.startswith("data:") else f"data:image/*;base64,{image}"


def _tool_calls(calls: Any, where: str) -> list[dict]:
    if not isinstance(calls, list):
        raise bad_request(f"{where}.tool_calls must be a list", param=f"{where}.tool_calls")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f'{where}.tool_calls[{j}] must be {{"function": {{"name": ..., "arguments": {{...}}}}}}',
                              param=f"{where}.tool_calls[{j}]")
        out.append({"id": call.get("id") or f"call_{j}", "type": "function",
                    "function": {"name": fn["name"], "arguments": fn.get("arguments", {})}})
    return out


def _format(fmt: str | dict | None) -> dict | None:
    """`format`: "json" (any JSON object) or a JSON schema, as the chat path's response_format."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    raise bad_request(f'format must be "json" or a JSON schema object, got {fmt!r:.40}', param="format")


def _think(req: _Common, engine: AsyncEngine) -> dict | None:
    """`think` as the chat template's reasoning switch (`enable_thinking`, and gpt-oss's
    `reasoning_effort` for a level); a model that cannot think is refused it, as Ollama refuses."""
    think = req.think
    if think is None:
        return None
    if isinstance(think, str) and think not in _THINK_LEVELS:
        raise bad_request(f"think must be true, false, or one of {', '.join(_THINK_LEVELS)}, got {think!r:.40}",
                          param="think")
    tok = engine.tokenizer
    if think and (tok is None or tok.token_to_id(THINK_OPEN) is None or tok.token_to_id(THINK_CLOSE) is None):
        raise bad_request(f'"{engine.model_name}" does not support thinking', param="think")
    if isinstance(think, str):
        return {"enable_thinking": True, "reasoning_effort": think}
    return {"enable_thinking": think}


def _sampling_fields(req: _Common) -> dict:
    """The options as the OpenAI request's fields; those neuron cannot honour are refused by name."""
    o = req.options or Options()
    for name, off in (("mirostat", 0), ("tfs_z", 1.0), ("typical_p", 1.0)):
        if getattr(o, name) not in (None, off):
            raise unsupported(f"options.{name}", f"options.{name} is not supported (neuron samples with "
                                                 f"temperature, top_k, top_p and min_p); leave it at {off}")
    penalty = o.repeat_penalty
    if o.repeat_last_n == 0:  # Ollama's way to turn the penalty off
        penalty = None
    elif o.repeat_last_n not in (None, -1) and penalty not in (None, 1.0):
        raise unsupported("options.repeat_last_n", "options.repeat_last_n is not supported: repeat_penalty applies "
                                                   "to the whole context (repeat_last_n -1)")
    if o.num_predict is not None and not (o.num_predict >= 1 or o.num_predict in (-1, -2)):
        raise bad_request(f"options.num_predict must be >= 1, or -1 for no limit, got {o.num_predict}",
                          param="options.num_predict")
    max_tokens = o.num_predict if o.num_predict is not None and o.num_predict > 0 else None
    return dict(temperature=o.temperature, top_p=o.top_p, top_k=o.top_k, min_p=o.min_p, seed=o.seed, stop=o.stop,
                repetition_penalty=penalty, presence_penalty=o.presence_penalty,
                frequency_penalty=o.frequency_penalty, max_tokens=max_tokens, stream=req.stream)


# ---- what comes back ----


class _Text:
    """A raw generate's parser: its text is all response."""

    def feed(self, text: str) -> Parsed:
        return Parsed(content=text)

    def finish(self) -> Parsed:
        return Parsed()


class _RawLogprobs:
    def __init__(self, tokenizer, top: int | None):
        self.top = top
        self.render = LogprobRenderer(tokenizer, False)

    def logprobs(self, update: Update):
        if self.top is None or update.logprobs is None:
            return None
        entries = self.render.chat(update.token_ids, update.logprobs, self.top)
        return _Logprobs(msgspec.convert(entries, list[TokenLogprob], from_attributes=True))


@dataclass(slots=True)
class _Logprobs:
    content: list[TokenLogprob]


class _Reply:
    """One answer as Ollama writes it: `message` (chat) or `response` (generate) deltas with their
    thinking, tool calls and logprobs, the last object closing it with the counts and durations."""

    def __init__(self, model: str, field: str, parser, state, started: float, load_s: float):
        """`parser` splits the text (feed, finish); `state` renders logprobs, and tool calls on a chat."""
        self.model, self.field, self.parser, self.state = model, field, parser, state
        self.started, self.load_s = started, load_s

    def parse(self, update: Update) -> tuple[Parsed, list[TokenLogprob]]:
        """What one update adds: its text split, and its tokens' logprobs when asked for."""
        parsed = self.parser.feed(update.text)
        if update.finished:
            parsed.extend(self.parser.finish())
        lp = self.state.logprobs(update)
        return parsed, lp.content if lp is not None else []

    def part(self, parsed: Parsed, logprobs: list[TokenLogprob]) -> dict:
        """An object of the answer, not its last."""
        body = {"model": self.model, "created_at": _now(), **self._text(parsed), "done": False}
        if logprobs:
            body["logprobs"] = logprobs
        return body

    def last(self, parsed: Parsed, logprobs: list[TokenLogprob], stream: RequestStream, final: Update) -> dict:
        """The closing object: what it still says, why it ended, and Ollama's counts and durations
        (nanoseconds; the prompt's from the request's arrival at the engine to its first token)."""
        now = time.monotonic()
        first = stream.first_token_at or now
        body = self.part(parsed, logprobs)
        body.update(done=True, done_reason="length" if final.finish_reason == "length" else "stop",
                    total_duration=_ns(now - self.started), load_duration=_ns(self.load_s),
                    prompt_eval_count=stream.num_prompt_tokens, prompt_eval_duration=_ns(first - stream.arrival),
                    eval_count=stream.num_output_tokens, eval_duration=_ns((stream.last_token_at or first) - first))
        return body

    def _text(self, parsed: Parsed) -> dict:
        if self.field == "response":
            return {"response": parsed.content, **({"thinking": parsed.reasoning} if parsed.reasoning else {})}
        message = {"role": "assistant", "content": parsed.content}
        if parsed.reasoning:
            message["thinking"] = parsed.reasoning
        if parsed.tool_calls:
            first = self.state.num_tool_calls
            message["tool_calls"] = [
                {"function": {"index": first + i, "name": c.function.name, "arguments": json.loads(c.function.arguments)}}
                for i, c in enumerate(self.state.tool_calls(parsed))]
        return {"message": message}


def _line(obj) -> bytes:
    return msgspec.json.encode(obj) + b"\n"


async def _lines(reply: _Reply, samples: Samples, every_s: float) -> AsyncIterator[bytes]:
    """The NDJSON body: an object per update that adds something, the closing object, or an
    `{"error": ...}` line (and the end) when the request fails. NDJSON has no comments, so a quiet
    stream sends nothing until it has something to say."""
    [stream] = samples.streams
    try:
        async for batch in merged_updates(samples.streams, every_s):
            out = []
            for _, update in batch or ():
                if update.finish_reason == "error":
                    yield b"".join(out) + _line({"error": stream_error(stream, update.error).message})
                    return
                parsed, logprobs = reply.parse(update)
                if update.finished:
                    out.append(_line(reply.last(parsed, logprobs, stream, update)))
                elif parsed or logprobs:
                    out.append(_line(reply.part(parsed, logprobs)))
            if out:
                yield b"".join(out)
    finally:
        samples.close()


async def _collect(reply: _Reply, samples: Samples) -> bytes:
    """The one object of `"stream": false`: the whole answer and its counts."""
    [stream] = samples.streams
    whole, logprobs = Parsed(), []
    async for update in stream:
        if update.finish_reason == "error":
            raise stream_error(stream, update.error)
        parsed, lp = reply.parse(update)
        whole.extend(parsed)
        logprobs += lp
        final = update
    return msgspec.json.encode(reply.last(whole, logprobs, stream, final))


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _ns(seconds: float) -> int:
    return max(0, int(seconds * 1e9))


# ---- the models ----


def _config(m: HostedModel):
    """The model's resolved configuration (ModelConfig) while it is loaded; None otherwise."""
    return m.engine.engine.model if m.engine is not None and m.engine.loaded else None


def _details(m: HostedModel) -> dict:
    cfg = _config(m)
    spec = cfg.spec if cfg is not None else m.spec.engine
    family = cfg.model_type if cfg is not None else ""
    gguf = cfg.gguf is not None if cfg is not None else str(spec.model).endswith(".gguf")
    level = (cfg.quantization if cfg is not None else None) or spec.quantization or spec.dtype
    return {"parent_model": "", "format": "gguf" if gguf else "safetensors", "family": family,
            "families": [family] if family else None, "parameter_size": "",
            "quantization_level": _LEVELS.get(level, str(level or "").upper())}


_LEVELS = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}  # Ollama's names of the dense dtypes


def _modified_at(m: HostedModel, started: float) -> str:
    """When the checkpoint's folder last changed; the server's start for a model not loaded."""
    cfg = _config(m)
    try:
        at = Path(cfg.model_dir).stat().st_mtime if cfg is not None and cfg.model_dir else started
    except OSError:
        at = started
    return datetime.fromtimestamp(at, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _digest(m: HostedModel) -> str:
    """An identifier of the model as served (its name and where it comes from), not of its files."""
    return hashlib.sha256(f"{m.name}\n{m.spec.engine.model}".encode()).hexdigest()


def _card(m: HostedModel, started: float) -> dict:
    """A model as /api/tags lists it, with neuron's state of it (`status`)."""
    info = m.describe()
    return {"name": m.name, "model": m.name, "modified_at": _modified_at(m, started),
            "size": info.get("weight_bytes") or 0, "digest": _digest(m), "details": _details(m),
            "status": info["status"]}


def _running(m: HostedModel, started: float) -> dict:
    """A loaded model as /api/ps lists it: what it holds (weights and KV cache), on GPUs or not,
    and when keep_alive will unload it."""
    held = sum(r["weight_bytes"] + r["kv_bytes"] for r in m.engine.memory())
    on_gpu = any(d.startswith("cuda") for d in m.devices or m.engine.engine.footprint()["devices"])
    card = _card(m, started)
    card.update(size=held, size_vram=held if on_gpu else 0, expires_at=_expires_at(m),
                context_length=m.engine.max_model_len)
    return card


def _expires_at(m: HostedModel) -> str:
    if m.keep_alive_s is None:
        return _FOREVER
    idle_from = time.time() - max(0.0, time.monotonic() - m.last_used)
    at = idle_from + m.keep_alive_s if not m.in_flight else time.time() + m.keep_alive_s
    return datetime.fromtimestamp(at, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _show(m: HostedModel, started: float) -> dict:
    """/api/show: the model's template, default parameters, details, architecture and capabilities
    (`completion`, and `tools`, `thinking`, `vision` where the checkpoint has them); a model not
    loaded shows what its spec says."""
    cfg = _config(m)
    body: dict[str, Any] = {"modelfile": "", "parameters": "", "template": "", "details": _details(m),
                            "model_info": {}, "capabilities": ["completion"],
                            "modified_at": _modified_at(m, started)}
    if cfg is None:
        return body
    engine, tok = m.engine, m.engine.tokenizer
    if tok is not None:
        body["template"] = tok.chat_template or ""
        if tool_format(tok) is not None:
            body["capabilities"].append("tools")
        if tok.token_to_id(THINK_OPEN) is not None and tok.token_to_id(THINK_CLOSE) is not None:
            body["capabilities"].append("thinking")
    if engine.vision is not None:
        body["capabilities"].append("vision")
    defaults = engine.default_sampling().items()
    body["parameters"] = "\n".join(f"{_PARAMETER_NAMES.get(k, k)} {v}" for k, v in defaults)
    arch, hf = cfg.model_type, cfg.hf_config
    info = {"general.architecture": arch, f"{arch}.context_length": engine.max_model_len}
    info.update({f"{arch}.{name}": hf[key] for key, name in _ARCH_INFO.items() if isinstance(hf.get(key), (int, float))})
    body["model_info"] = info
    return body


_PARAMETER_NAMES = {"repetition_penalty": "repeat_penalty"}
_ARCH_INFO = {"hidden_size": "embedding_length", "num_hidden_layers": "block_count",
              "intermediate_size": "feed_forward_length", "num_attention_heads": "attention.head_count",
              "num_key_value_heads": "attention.head_count_kv", "rms_norm_eps": "attention.layer_norm_rms_epsilon",
              "rope_theta": "rope.freq_base", "vocab_size": "vocab_size"}
