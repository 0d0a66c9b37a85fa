"""The routes: each through the server's endpoint wrapper (admission, limits, the API key, the
guards), with its errors in Ollama's shape."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import neuron
from neuron.engine.async_engine import AsyncEngine
from neuron.engine.host import HostError, ModelHost
from neuron.engine.pooling import EMBED, normalized
from neuron.entrypoints.openai.admin import host_error
from neuron.entrypoints.openai.api_errors import APIError, bad_request
from neuron.entrypoints.openai.api_types import CompletionRequest
from neuron.entrypoints.openai.common import (
    Samples,
    check_model,
    check_ready,
    check_serves,
    new_id,
    open_samples,
    sampling_params,
)
from neuron.entrypoints.openai.guided import compile_guided
from neuron.entrypoints.openai.ollama.models import (
    SPEC_KEEP_ALIVE,
    adapter_card,
    card,
    parse_keep_alive,
    running,
    served_name,
    show_body,
)
from neuron.entrypoints.openai.ollama.protocol import (
    OLLAMA_API_VERSION,
    OllamaChatRequest,
    OllamaEmbeddingsRequest,
    OllamaEmbedRequest,
    OllamaGenerateRequest,
    OllamaRequest,
    OllamaShowRequest,
    ollama_error,
)
from neuron.entrypoints.openai.ollama.reply import PlainText, RawLogprobs, Reply, collect, ndjson_lines, ns, timestamp
from neuron.entrypoints.openai.ollama.translate import (
    chat_request,
    check_generate,
    in_ollama_names,
    opened,
    prompt_messages,
    response_format,
    sampling_fields,
)
from neuron.entrypoints.openai.prompt_input import Limiters
from neuron.entrypoints.openai.serving_chat import ChoiceState, open_chat
from neuron.entrypoints.openai.serving_completions import fill_in_the_middle, prompt_ids
from neuron.entrypoints.openai.serving_embeddings import (
    MAX_INPUTS,
    EmbeddingBatch,
    check_dimensions,
    pooling_params,
    tokenized_inputs,
)
from neuron.entrypoints.openai.streaming import NDJSONResponse, json_unless_disconnected


@dataclass(slots=True)
class Served:
    """What the routes borrow from the server: its models, its places for client-controlled work,
    and how it decodes a body, finds a model's engine and salts a request's cache."""

    host: ModelHost
    limiters: Limiters
    decode: Callable[[Request, type], Awaitable[Any]]
    engine: Callable[[str], Awaitable[AsyncEngine]]
    salt: Callable[[Request, Any], str | None]
    started: float  # the server's start (time.time()), when a model's files are not known
    keepalive_s: float  # how often a quiet SSE stream says something (NDJSON ones say nothing)
    # the engine of the model named, or of the server's one model where none is (llama-server's routes)
    named: Callable[[str | None], Awaitable[AsyncEngine]]


def ollama_routes(served: Served, endpoint: Callable) -> list[Route]:
    """Every route through `endpoint` (admission, limits, the API key, the guards), its errors in
    Ollama's shape."""
    api = _Ollama(served)

    def route(path: str, handler, method: str = "POST") -> Route:
        name = "ollama_" + path.rsplit("/", 1)[1]  # the request counter's label: ollama_chat, ...
        return Route(path, endpoint(name, handler, errors=ollama_error), methods=[method])

    routes = [route("/api/chat", api.chat), route("/api/generate", api.generate), route("/api/show", api.show),
              route("/api/tags", api.tags, "GET"), route("/api/ps", api.ps, "GET"),
              route("/api/embed", api.embed), route("/api/embeddings", api.embeddings),
              route("/api/version", api.version, "GET")]
    for path, method in _REFUSED.items():
        routes.append(route(path, api.refused, method))
    return routes


_NO_DOWNLOADS = ("neuron serves the models it was started with (or that its admin API loads) and never downloads, "
                 "pushes, creates, copies or deletes models; /api/tags lists the models served")
_REFUSED = {"/api/pull": "POST", "/api/push": "POST", "/api/create": "POST", "/api/copy": "POST",
            "/api/delete": "DELETE"}


class _Ollama:
    def __init__(self, served: Served):
        self.served = served

    async def chat(self, request: Request) -> Response:
        started = time.monotonic()
        req = await self.served.decode(request, OllamaChatRequest)
        name, engine, load_s = await self._model(req)
        if not req.messages:  # Ollama's way to load (or, with keep_alive 0, unload) a model
            return self._loaded(name, engine, "message")
        chat = chat_request(name, req, engine)
        ctx, samples = await opened(open_chat(engine, chat, self.served.limiters, self.served.salt(request, chat)))
        state = ChoiceState(ctx)
        reply = Reply(name, "message", state.parser, state, started, load_s)
        return await self._respond(request, req.stream, samples, reply)

    async def generate(self, request: Request) -> Response:
        started = time.monotonic()
        req = await self.served.decode(request, OllamaGenerateRequest)
        check_generate(req)
        name, engine, load_s = await self._model(req)
        if not req.prompt and not req.images:
            return self._loaded(name, engine, "response")
        if req.raw or req.suffix:  # a suffix asks for the middle, in the model's fill-in-the-middle format
            prompt = fill_in_the_middle(engine, req.prompt, req.suffix) if req.suffix else req.prompt
            samples, reply = await self._raw(request, name, engine, req, prompt, started, load_s)
        else:
            chat = chat_request(name, req, engine, prompt_messages(req))
            ctx, samples = await opened(open_chat(engine, chat, self.served.limiters, self.served.salt(request, chat)))
            state = ChoiceState(ctx)
            reply = Reply(name, "response", state.parser, state, started, load_s)
        return await self._respond(request, req.stream, samples, reply)

    async def _raw(self, request: Request, name: str, engine: AsyncEngine, req: OllamaGenerateRequest, prompt: str,
                   started: float, load_s: float) -> tuple[Samples, Reply]:
        """`prompt` as it is, no chat template (as /v1/completions takes a text prompt); the reply is text."""
        if req.images:
            raise bad_request("images need the chat template, which raw leaves out; send raw false", param="images")
        if req.think:
            raise bad_request("think needs the chat template, which raw leaves out; send raw false", param="think")
        completion = CompletionRequest(model=name, prompt=prompt, response_format=response_format(req.format),
                                       **sampling_fields(req))
        check_model(completion, engine.model_name)
        check_ready(engine)
        top = (req.top_logprobs or 0) if req.logprobs else None
        try:
            params = sampling_params(completion, engine.default_sampling(), max_tokens=completion.max_tokens,
                                     logprobs=top, renames={"logprobs": "top_logprobs"})
            grammar = await compile_guided(engine, completion, self.served.limiters.grammar)
            ids = await prompt_ids(engine, prompt, self.served.limiters.tokenize)
            samples = open_samples(engine, new_id("cmpl"), [ids], params, "prompt", grammar=grammar,
                                   cache_salt=self.served.salt(request, completion))
        except APIError as exc:
            raise in_ollama_names(exc) from None
        return samples, Reply(name, "response", PlainText(), RawLogprobs(engine.tokenizer, top), started, load_s)

    async def _model(self, req: OllamaRequest) -> tuple[str, AsyncEngine, float]:
        """The model a request names (Ollama's `name:latest` is `name`), its engine, loaded first if
        it loads on demand (and how long that took), and the request's keep_alive applied to it."""
        keep = parse_keep_alive(req.keep_alive)
        name = served_name(self.served.host, req.model)
        began = time.monotonic()
        engine = await self.served.engine(name)
        load_s = time.monotonic() - began
        host = self.served.host
        m = host.models.get(name)
        if m is not None:
            m.keep_for(m.spec.keep_alive_s if keep is SPEC_KEEP_ALIVE else keep)
        elif keep is not SPEC_KEEP_ALIVE:  # a LoRA adapter: how long its weights stay on the ranks once idle
            host.keep_adapter(name, keep, rest=True)
        return name, engine, load_s

    def _loaded(self, name: str, engine: AsyncEngine, field: str) -> Response:
        """The answer to a request with nothing to generate: the model is loaded now, or it will be
        unloaded at once (keep_alive 0 on a model that loads on demand)."""
        check_ready(engine)
        m = self.served.host.models.get(name)
        unloads = m is not None and m.spec.load == "on_demand" and m.keep_alive_s == 0
        body = {"model": name, "created_at": timestamp()}
        body[field] = {"role": "assistant", "content": ""} if field == "message" else ""
        body.update(done=True, done_reason="unload" if unloads else "load")
        return JSONResponse(body)

    async def _respond(self, request: Request, stream: bool, samples: Samples, reply: Reply) -> Response:
        if stream:
            return NDJSONResponse(ndjson_lines(reply, samples), on_close=samples.close)
        return await json_unless_disconnected(request, samples, collect(reply, samples))

    async def show(self, request: Request) -> Response:
        req = await self.served.decode(request, OllamaShowRequest)
        host = self.served.host
        name = served_name(host, req.model or req.name)
        if name not in host.models and (base := host.adapter_base(name)) is not None:
            body = show_body(base, self.served.started)
            body["details"]["parent_model"] = base.name
            return JSONResponse(body)
        try:
            m = host.model(name)
        except HostError as exc:
            raise host_error(exc, param="model") from None
        return JSONResponse(show_body(m, self.served.started))

    async def tags(self, request: Request) -> Response:
        host, started = self.served.host, self.served.started
        cards = [card(m, started) for m in host.models.values()]
        cards += [adapter_card(name, host.models[base], path, started) for name, base, path in host.adapters()]
        return JSONResponse({"models": cards})

    async def ps(self, request: Request) -> Response:
        """The loaded models, and the LoRA adapters their ranks serve (as their bases hold them)."""
        host, started = self.served.host, self.served.started
        loaded = [running(m, started) for m in host.models.values() if m.engine is not None and m.engine.loaded]
        by_name = {c["name"]: c for c in loaded}
        for name, base, path in host.adapters():
            if base in by_name and not host.adapter_resting(name):
                adapter = adapter_card(name, host.models[base], path, started)
                loaded.append({**by_name[base], **{k: adapter[k] for k in ("name", "model", "digest", "details")}})
        return JSONResponse({"models": loaded})

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": OLLAMA_API_VERSION, "neuron": neuron.__version__})

    async def embed(self, request: Request) -> Response:
        """/api/embed: each input's embedding, L2-normalized as Ollama's are, through the embeddings
        path; an input past the context is cut from its end unless `truncate` is false."""
        started = time.monotonic()
        req = await self.served.decode(request, OllamaEmbedRequest)
        name, engine, load_s = await self._model(req)
        texts = [req.input] if isinstance(req.input, str) else req.input
        if texts in ([], [""]):  # Ollama's way to load a model for embedding
            check_ready(engine)
            return JSONResponse({"model": name, "embeddings": []})
        batch = await self._embedding_batch(request, engine, texts, req.dimensions, req.truncate, req)

        async def collect() -> bytes:
            vectors = [normalized(v) for v in await batch.run()]
            return msgspec.json.encode({"model": name, "embeddings": vectors,
                                        "total_duration": ns(time.monotonic() - started), "load_duration": ns(load_s),
                                        "prompt_eval_count": sum(map(len, batch.ids))})

        return await json_unless_disconnected(request, batch, collect())

    async def embeddings(self, request: Request) -> Response:
        """The older /api/embeddings: one prompt's embedding, as the model pools it."""
        req = await self.served.decode(request, OllamaEmbeddingsRequest)
        name, engine, _ = await self._model(req)
        if not req.prompt:
            check_ready(engine)
            return JSONResponse({"embedding": []})
        batch = await self._embedding_batch(request, engine, [req.prompt], None, False, req)

        async def collect() -> bytes:
            return msgspec.json.encode({"embedding": (await batch.run())[0]})

        return await json_unless_disconnected(request, batch, collect())

    async def _embedding_batch(self, request: Request, engine: AsyncEngine, texts: list, dimensions: int | None,
                               cut: bool, req) -> EmbeddingBatch:
        if not all(isinstance(t, str) and t for t in texts) or len(texts) > MAX_INPUTS:
            raise bad_request(f"input must be a text or a list of at most {MAX_INPUTS} non-empty texts",
                              param="input")
        check_serves(engine, EMBED)
        check_dimensions(engine, dimensions)
        keep = engine.max_model_len if cut else None
        ids = await tokenized_inputs(engine, texts, self.served.limiters.tokenize, keep, keep_start=True)
        return EmbeddingBatch(engine, new_id("embd"), ids, pooling_params(dimensions), self.served.salt(request, req))

    async def refused(self, request: Request) -> Response:
        path = request.url.path
        raise APIError(403, f"{path} is refused: {_NO_DOWNLOADS}", code="unsupported_endpoint")
