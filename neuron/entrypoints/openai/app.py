"""The ASGI app: routes, authentication, body limits and the error envelope around every handler."""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import time
import traceback
from contextlib import asynccontextmanager
from dataclasses import dataclass, fields

import anyio
import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import neuron
from neuron.config import check, from_settings
from neuron.engine.async_engine import AsyncEngine, EngineState
from neuron.engine.host import HostedModel, HostError, ModelHost
from neuron.engine.pooling import GENERATE
from neuron.entrypoints.openai.admin import admin_routes, host_error
from neuron.entrypoints.openai.api_errors import APIError, bad_request, internal
from neuron.entrypoints.openai.api_types import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    ModelCard,
    ModelList,
    SamplingRequest,
    TokenizeRequest,
)
from neuron.entrypoints.openai.common import check_ready, check_serves, request_salt
from neuron.entrypoints.openai.connections import (
    BodyTimeout,
    EchoRequestId,
    RequestGuard,
    header_request_id,
    parse_origins,
)
from neuron.entrypoints.openai.llamacpp import llamacpp_routes
from neuron.entrypoints.openai.lora_routes import lora_routes
from neuron.entrypoints.openai.messages_types import CountTokensRequest, MessagesRequest
from neuron.entrypoints.openai.ollama import Served, ollama_error, ollama_routes
from neuron.entrypoints.openai.prompt_input import Limiters
from neuron.entrypoints.openai.request_body import read_body, require_json
from neuron.entrypoints.openai.response_store import OwnedResponses, ResponseStore
from neuron.entrypoints.openai.responses_types import ResponsesRequest
from neuron.entrypoints.openai.serving_chat import create_chat_completion
from neuron.entrypoints.openai.serving_completions import create_completion
from neuron.entrypoints.openai.serving_embeddings import create_embedding
from neuron.entrypoints.openai.serving_messages import (
    count_tokens,
    create_message,
    error_response,
    is_anthropic,
    model_object,
    model_page,
)
from neuron.entrypoints.openai.serving_responses import create_response, delete_response, retrieve_response
from neuron.entrypoints.openai.serving_score import (
    ClassifyRequest,
    RerankRequest,
    ScoreRequest,
    create_classify,
    create_rerank,
    create_score,
)
from neuron.entrypoints.openai.serving_tokenization import detokenize, tokenize, tokenizer_info
from neuron.errors import ConfigError

log = logging.getLogger("neuron.server")

# The status counted, as nginx does, for a client that went away before its request was answered.
CLIENT_CLOSED_REQUEST = 499
_BEARER = "bearer "


@dataclass(slots=True)
class ServerConfig:
    """The HTTP server. A field left out takes the setting of its name (neuron.config)."""

    host: str = from_settings("host")
    port: int = from_settings("port")
    api_key: str | None = from_settings("api_key")
    admin_key: str | None = from_settings("admin_key")  # the admin API (/admin/models) is on with it, off without
    memory_budget: int | None = from_settings("memory_budget")  # per device, for the models a host loads
    prefix_cache_isolation: str = from_settings("prefix_cache_isolation")  # which requests share cached prefixes
    max_body_bytes: int = from_settings("max_body_bytes")
    keepalive_s: float = from_settings("keepalive_s")  # SSE comment interval while a stream has nothing to say
    shutdown_grace_s: float = from_settings("shutdown_grace_s")  # for in-flight requests
    max_waiting: int = from_settings("max_waiting")  # requests queued for a slot before 503
    max_connections: int = from_settings("max_connections")  # open connections; `neuron serve` may lower it
    header_timeout_s: float = from_settings("header_timeout_s")
    body_timeout_s: float = from_settings("body_timeout_s")  # longest pause between two reads of a body
    min_body_rate: int = from_settings("min_body_rate")  # bytes/s a body must average past its head start
    max_connections_per_client: int = from_settings("max_connections_per_client")
    allowed_origins: str | None = from_settings("allowed_origins")
    idle_timeout_s: float = from_settings("idle_timeout_s")  # keep-alive connections between requests
    allow_runtime_lora_updating: bool = from_settings("allow_runtime_lora_updating")  # vLLM's LoRA routes
    responses_max_stored: int = from_settings("responses_max_stored")  # the Responses API's store, by count
    responses_max_stored_bytes: int = from_settings("responses_max_stored_bytes")  # and by bytes

    def __post_init__(self) -> None:
        for f in fields(self):
            check(f.name, getattr(self, f.name))
        if self.prefix_cache_isolation == "api-key" and self.api_key is not None:
            raise ConfigError("--prefix-cache-isolation api-key keeps apart clients that present different API keys, "
                              "but --api-key makes every client present the same one, so it would keep apart nobody: "
                              "use --prefix-cache-isolation salt (each client sends a secret cache_salt of its own), "
                              "or leave --api-key unset behind a gateway that checks per-client keys and forwards "
                              "them")


def build_app(served: AsyncEngine | ModelHost, cfg: ServerConfig) -> Starlette:
    """The server of one engine, or of a host of models (engine/host.py)."""
    host = served if isinstance(served, ModelHost) else ModelHost.of_engine(served)
    api = _Api(host, cfg)
    routes = [
        Route("/health", api.health, methods=["GET"]),
        Route("/metrics", api.metrics, methods=["GET"]),
        # OpenAI's list and cards, or Anthropic's to its clients (they send `anthropic-version`)
        Route("/v1/models", api.either(api.endpoint("models", api.models),
                                       api.endpoint("models", api.anthropic_models, api.authenticate_either,
                                                    error_response)), methods=["GET"]),
        Route("/v1/models/{model:path}", api.either(api.endpoint("models", api.model_card),
                                                    api.endpoint("models", api.anthropic_model_card,
                                                                 api.authenticate_either, error_response)),
              methods=["GET"]),
        Route("/version", api.version, methods=["GET"]),
        Route("/v1/chat/completions", api.endpoint("chat", api.chat), methods=["POST"]),
        Route("/v1/completions", api.endpoint("completions", api.completions), methods=["POST"]),
        Route("/v1/embeddings", api.endpoint("embeddings", api.embeddings), methods=["POST"]),
        # vLLM's score and rerank APIs (Jina's and Cohere's rerank shape; llama-server's names too), for
        # embedding models and cross-encoders, and its classify API
        *[Route(path, api.endpoint("score", api.score), methods=["POST"]) for path in ("/score", "/v1/score")],
        *[Route(path, api.endpoint("rerank", api.rerank), methods=["POST"])
          for path in ("/rerank", "/v1/rerank", "/v2/rerank", "/reranking", "/v1/reranking")],
        Route("/classify", api.endpoint("classify", api.classify), methods=["POST"]),
        # Anthropic's Messages API: its clients send the key as x-api-key, and read its error shape
        Route("/v1/messages", api.endpoint("messages", api.messages, api.authenticate_either, error_response),
              methods=["POST"]),
        Route("/v1/messages/count_tokens", api.endpoint("count_tokens", api.count_tokens, api.authenticate_either,
                                                        error_response), methods=["POST"]),
        Route("/v1/responses", api.endpoint("responses", api.responses), methods=["POST"]),
        Route("/v1/responses/{response_id}", api.endpoint("responses", api.retrieve_response), methods=["GET"]),
        Route("/v1/responses/{response_id}", api.endpoint("responses", api.delete_response), methods=["DELETE"]),
        Route("/tokenize", api.endpoint("tokenize", api.tokenize), methods=["POST"]),
        Route("/detokenize", api.endpoint("detokenize", api.detokenize), methods=["POST"]),
        Route("/tokenizer_info", api.endpoint("tokenizer_info", api.tokenizer_info), methods=["GET"]),
    ]
    if cfg.allow_runtime_lora_updating:  # off without it: its paths are unknown (404), as vLLM's
        routes += lora_routes(host, api.endpoint, api._decode)
    served = Served(host, api.limiters, api._decode, api._engine, api._salt, api.started, cfg.keepalive_s,
                    api._named)
    routes += ollama_routes(served, api.endpoint)
    routes += llamacpp_routes(served, api.endpoint)
    if cfg.admin_key is not None:  # off without a key: its paths are unknown (404)
        routes += admin_routes(host, cfg.admin_key, api.endpoint)

    @asynccontextmanager
    async def lifespan(app):
        host.start()
        yield
        await anyio.to_thread.run_sync(host.stop)

    origins = parse_origins(cfg.allowed_origins)
    middleware = [Middleware(EchoRequestId), Middleware(RequestGuard, allowed_origins=origins),
                  Middleware(BodyTimeout, timeout_s=cfg.body_timeout_s, min_rate=cfg.min_body_rate)]
    if origins:  # browser pages of these origins may read the answers too
        middleware.insert(0, Middleware(CORSMiddleware, allow_origins=sorted(origins), allow_methods=["GET", "POST"],
                                        allow_headers=["authorization", "content-type", "x-request-id"]))
    return Starlette(routes=routes, lifespan=lifespan, middleware=middleware,
                     exception_handlers={HTTPException: _http_error})


async def _http_error(request: Request, exc: HTTPException) -> Response:
    """Unknown routes and methods, in the envelope of the API the path belongs to: Ollama's under
    /api/, Anthropic's under /v1/messages, OpenAI's elsewhere."""
    kind = "not_found" if exc.status_code == 404 else "method_not_allowed" if exc.status_code == 405 else None
    error = APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=kind,
                     headers=exc.headers)
    path = request.url.path
    if path.startswith("/api/"):
        return ollama_error(error)
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return error_response(error)
    return error.response()


class _Api:
    def __init__(self, host: ModelHost, cfg: ServerConfig):
        self.host = host
        self.cfg = cfg
        self.stats = host.metrics
        self.started = int(time.time())
        self.limiters = Limiters()
        self.responses_store = ResponseStore(cfg.responses_max_stored, cfg.responses_max_stored_bytes)

    def endpoint(self, name: str, handler, authenticate=None, errors=APIError.response):
        """Wrap a handler: authentication (the API key's, unless `authenticate` says otherwise), the
        error envelope (`errors` renders an APIError in the route's API: OpenAI's unless it says
        otherwise), and the request counter."""

        async def run(request: Request) -> Response:
            try:
                (authenticate or self._authenticate)(request)
                response = await handler(request)
            except APIError as exc:  # the path and the message may hold client text: quoted, one line
                log.info("%s %r refused: %d %s: %r", request.method, request.url.path, exc.status,
                         exc.code or exc.type, exc.message)
                response = errors(exc)
                # The traceback's frames hold the request (its params, a compiled grammar, its
                # streams) in reference cycles that only a full garbage collection would free.
                traceback.clear_frames(exc.__traceback__)
            except ClientDisconnect:  # the client's doing, not the server's: no 5xx, no traceback
                log.info("%s %r: the client disconnected before sending the whole body", request.method,
                         request.url.path)
                response = Response(status_code=CLIENT_CLOSED_REQUEST)
            except Exception:
                log.exception("%s %r failed", request.method, request.url.path)
                response = errors(internal("internal server error; see the server log"))
            self.stats.requests.labels(name, str(response.status_code)).inc()
            return response

        return run

    def _authenticate(self, request: Request) -> None:
        """Exactly `Bearer <key>`: one space, nothing around the key (the scheme's case is free, as
        RFC 9110 has it). The header's bytes (Starlette decodes them as latin-1) are compared with
        the key's UTF-8 in constant time."""
        if self.cfg.api_key is None:
            return
        if not self._is_key(_bearer(request)):
            raise APIError(401, "missing or invalid API key: send `Authorization: Bearer <key>`",
                           type="authentication_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})

    def authenticate_either(self, request: Request) -> None:
        """Anthropic's way, the key as `x-api-key`, or OpenAI's bearer token."""
        if self.cfg.api_key is None or self._is_key(request.headers.get("x-api-key")):
            return
        if not self._is_key(_bearer(request)):
            raise APIError(401, "missing or invalid API key: send `x-api-key: <key>` or `Authorization: Bearer <key>`",
                           type="authentication_error", code="invalid_api_key")

    def _is_key(self, given: str | None) -> bool:
        """The header's bytes (Starlette decodes them as latin-1) equal the key's UTF-8, compared in
        constant time."""
        return given is not None and hmac.compare_digest(given.encode("latin-1"), self.cfg.api_key.encode())

    async def health(self, request: Request) -> Response:
        """200 when every model loaded at start-up is ready; else 503. A server of one model answers
        with that model's state (`status`), the failure (`error`) and, while recovering, what the
        recovery is doing (`reason`); once loaded, what runs each fused kernel, the quantization and
        speculative decoding's settings, where they apply, and each rank's memory (`memory`: weight,
        KV cache and resident bytes). A host of several models (or one whose
        admin API is on) adds each model's state and memory under `models`."""
        host = self.host
        single = host.single
        body = _engine_health(single.engine) if single is not None else \
            {"status": "ready" if host.startup_ready else "loading"}
        if single is None or self.cfg.admin_key is not None:
            body["models"] = {name: _model_health(m) for name, m in host.models.items()}
        # the code follows the status in the body, read once: the engine thread may change the
        # state between two reads (a rebuild ending), and a 200 must never say "recovering"
        ready = host.startup_ready and (single is None or body["status"] == EngineState.READY.value)
        return JSONResponse(body, 200 if ready else 503)

    async def metrics(self, request: Request) -> Response:
        return Response(self.stats.render(), media_type=self.stats.content_type)

    async def models(self, request: Request) -> Response:
        """Every model the server knows, with its state; a server of one model answers 503 while it
        is not ready, as before there were several."""
        return Response(msgspec.json.encode(ModelList(self._cards())), media_type="application/json")

    async def model_card(self, request: Request) -> Response:
        """GET /v1/models/{model}: one model's card (OpenAI's `models.retrieve`), 404 naming those served."""
        return Response(msgspec.json.encode(self._card(request.path_params["model"])), media_type="application/json")

    def _card(self, name: str) -> ModelCard:
        """The card of the model named `name`; 404 naming those served."""
        cards = self._cards()
        card = next((c for c in cards if c.id == name), None)
        if card is None:
            served = ", ".join(f"`{c.id}`" for c in cards) or "no model"
            raise APIError(404, f"the model `{name[:256]}` does not exist; this server serves {served}", param="model",
                           code="model_not_found")
        return card

    @staticmethod
    def either(openai, anthropic):
        """A route both APIs share: Anthropic's handler for its clients, OpenAI's for the rest."""

        async def run(request: Request) -> Response:
            return await (anthropic if is_anthropic(request) else openai)(request)

        return run

    async def anthropic_models(self, request: Request) -> Response:
        """GET /v1/models as Anthropic's `models.list`: a page of the served models (and adapters)."""
        return JSONResponse(model_page([c.id for c in self._cards()], self.started, request.query_params))

    async def anthropic_model_card(self, request: Request) -> Response:
        """GET /v1/models/{model} as Anthropic's `models.retrieve`."""
        return JSONResponse(model_object(self._card(request.path_params["model"]).id, self.started))

    async def version(self, request: Request) -> Response:
        """GET /version, as vLLM answers it: the server's version."""
        return JSONResponse({"version": neuron.__version__})

    def _cards(self) -> list[ModelCard]:
        single = self.host.single
        if single is not None and self.cfg.admin_key is None:
            check_ready(single.engine)
        cards = [ModelCard(name, self.started, info.get("max_model_len"), info.get("quantization"),
                           status=info["status"], tp=info["tp"], devices=info["devices"],
                           weight_bytes=info.get("weight_bytes"), error=info.get("error"))
                 for name, info in self.host.describe().items()]
        described = {card.id: card for card in cards}
        cards += [ModelCard(name, self.started, described[base].max_model_len, described[base].quantization,
                            parent=base, root=path) for name, base, path in self.host.adapters()]
        return cards

    async def chat(self, request: Request) -> Response:
        req = await self._decode(request, ChatCompletionRequest)
        req.request_id = header_request_id(request.headers) or req.request_id
        engine = await self._engine(req.model)
        check_serves(engine, GENERATE)
        return await create_chat_completion(request, engine, req, self.cfg.keepalive_s, self.limiters,
                                            self._salt(request, req))

    async def completions(self, request: Request) -> Response:
        req = await self._decode(request, CompletionRequest)
        req.request_id = header_request_id(request.headers) or req.request_id
        engine = await self._engine(req.model)
        check_serves(engine, GENERATE)
        return await create_completion(request, engine, req, self.cfg.keepalive_s, self.limiters,
                                       self._salt(request, req))

    async def embeddings(self, request: Request) -> Response:
        req = await self._decode(request, EmbeddingRequest)
        engine = await self._engine(req.model)
        return await create_embedding(request, engine, req, self.limiters.tokenize, self._salt(request, req))

    async def score(self, request: Request) -> Response:
        req = await self._decode(request, ScoreRequest)
        engine = await self._named(req.model or None)  # vLLM's and llama-server's leave it out
        return await create_score(request, engine, req, self.limiters.tokenize, self._salt(request, req))

    async def rerank(self, request: Request) -> Response:
        req = await self._decode(request, RerankRequest)
        engine = await self._named(req.model or None)  # vLLM's, Jina's and llama-server's leave it out
        return await create_rerank(request, engine, req, self.limiters.tokenize, self._salt(request, req))

    async def classify(self, request: Request) -> Response:
        req = await self._decode(request, ClassifyRequest)
        engine = await self._engine(req.model)
        return await create_classify(request, engine, req, self.limiters.tokenize, self._salt(request, req))

    async def messages(self, request: Request) -> Response:
        req = await self._decode(request, MessagesRequest)
        engine = await self._engine(req.model)
        return await create_message(request, engine, req, self.cfg.keepalive_s, self.limiters,
                                    self._salt(request, req))

    async def count_tokens(self, request: Request) -> Response:
        req = await self._decode(request, CountTokensRequest)
        return await count_tokens(await self._engine(req.model), req, self.limiters)

    async def responses(self, request: Request) -> Response:
        req = await self._decode(request, ResponsesRequest)
        engine = await self._engine(req.model)
        check_serves(engine, GENERATE)
        return await create_response(request, engine, req, self.cfg.keepalive_s, self.limiters,
                                     self._responses(request), self._salt(request, req))

    async def retrieve_response(self, request: Request) -> Response:
        stream = request.query_params.get("stream", "false").lower() not in ("false", "0")
        return await retrieve_response(self._responses(request), request.path_params["response_id"], stream)

    async def delete_response(self, request: Request) -> Response:
        return await delete_response(self._responses(request), request.path_params["response_id"])

    def _responses(self, request: Request) -> OwnedResponses:
        """The stored responses this request may see: under --prefix-cache-isolation api-key, those
        made with the key it presented; otherwise all."""
        owner = ""
        if self.cfg.prefix_cache_isolation == "api-key":
            owner = hashlib.sha256(_presented_key(request).encode()).hexdigest()
        return OwnedResponses(self.responses_store, owner)

    async def _engine(self, name: str | None) -> AsyncEngine:
        """The engine of the model a request names (loading an on-demand one); 400 without a name,
        404 listing the names served, 503 for a model not ready."""
        if not name:
            raise bad_request("you must provide a model parameter", param="model")
        try:
            return await self.host.engine_for(name)
        except HostError as exc:
            raise host_error(exc, param="model") from None

    def _salt(self, request: Request,
              req: SamplingRequest | MessagesRequest | EmbeddingRequest | ResponsesRequest) -> str | None:
        """The request's cache salt under this server's isolation."""
        return request_salt(req, self.cfg.prefix_cache_isolation, _presented_key(request))

    async def tokenize(self, request: Request) -> Response:
        req = await self._decode(request, TokenizeRequest)
        return await tokenize(await self._named(req.model), req, self.limiters.tokenize)

    async def detokenize(self, request: Request) -> Response:
        req = await self._decode(request, DetokenizeRequest)
        return await detokenize(await self._named(req.model), req, self.limiters.tokenize)

    async def tokenizer_info(self, request: Request) -> Response:
        return tokenizer_info(await self._named(request.query_params.get("model")))

    async def _named(self, name: str | None) -> AsyncEngine:
        """The engine of a tokenizer, score or rerank route or a llama-server one: the model named, or the
        server's one model."""
        if name is None and self.host.single is not None:
            return self.host.single.engine
        return await self._engine(name)

    async def _decode(self, request: Request, kind: type):
        decoded = decode_body(await read_body(request, self.cfg.max_body_bytes), kind)
        require_json(request)
        return decoded


def _engine_health(engine: AsyncEngine) -> dict:
    body = {"status": engine.state.value}
    if engine.error:
        body["error"] = engine.error
    if engine.reason:
        body["reason"] = engine.reason
    if engine.loaded and (kernels := engine.kernels()):  # what runs each fused piece, and why
        body["kernels"] = kernels
    if engine.loaded and engine.quantization:
        body["quantization"] = engine.quantization
    if engine.loaded and engine.speculative:
        body["speculative"] = engine.speculative
    if engine.loaded and (memory := engine.memory()):  # per rank: weight, KV cache and resident bytes
        body["memory"] = memory
    return body


def _model_health(m: HostedModel) -> dict:
    out = {"status": m.status}
    error = m.error or (m.engine.error if m.engine is not None else None)
    if error and m.status == "failed":
        out["error"] = error
    if m.engine is not None and m.engine.reason:
        out["reason"] = m.engine.reason
    if m.engine is not None and m.engine.loaded and (memory := m.engine.memory()):
        out["memory"] = memory  # per rank: weight, KV cache and resident bytes
    return out


def _presented_key(request: Request) -> str:
    """The key a request presented: the bearer token, else the x-api-key header, else the
    Authorization header as sent ("" without any: keyless requests share)."""
    token = _bearer(request)
    if token is None:
        token = request.headers.get("x-api-key")
    return token if token is not None else request.headers.get("authorization", "")


def _bearer(request: Request) -> str | None:
    """The token of an `Authorization: Bearer <token>` header; None without one."""
    given = request.headers.get("authorization", "")
    return given[len(_BEARER):] if given[:len(_BEARER)].lower() == _BEARER else None


_AT = re.compile(r"at `\$\.?([^`]*)`")
_MISSING = re.compile(r"missing required field `([^`]+)`")


def decode_body(body: bytes, kind: type):
    """The body as `kind`; anything else is a 400, whatever the bytes are."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        message = str(exc)
        found = _AT.search(message) or _MISSING.search(message)
        raise bad_request(f"invalid request: {message}", param=found.group(1) if found else None) from None
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:  # msgspec raises the latter for bad UTF-8 in a string
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:  # msgspec refuses nesting deeper than Python's recursion limit this way
        raise bad_request("the request body nests JSON arrays or objects too deeply") from None
