"""The ASGI app: routes, authentication, body limits and the error envelope around every handler."""

from __future__ import annotations

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

from neuron.config import check, from_settings
from neuron.engine.async_engine import AsyncEngine, EngineState
from neuron.entrypoints.openai.api_errors import APIError, bad_request, internal
from neuron.entrypoints.openai.api_types import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    SamplingRequest,
    TokenizeRequest,
)
from neuron.entrypoints.openai.common import check_ready, request_salt
from neuron.entrypoints.openai.connections import BodyTimeout, RequestGuard, parse_origins
from neuron.entrypoints.openai.prompt_input import Limiters
from neuron.entrypoints.openai.serving_chat import create_chat_completion
from neuron.entrypoints.openai.serving_completions import create_completion
from neuron.entrypoints.openai.serving_tokenization import detokenize, tokenize
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

    def __post_init__(self) -> None:
        for f in fields(self):
            check(f.name, getattr(self, f.name))
        if self.prefix_cache_isolation == "api-key" and self.api_key is not None:
            raise ConfigError("--prefix-cache-isolation api-key keeps apart clients that present different API keys, "
                              "but --api-key makes every client present the same one, so it would keep apart nobody: "
                              "use --prefix-cache-isolation salt (each client sends a secret cache_salt of its own), "
                              "or leave --api-key unset behind a gateway that checks per-client keys and forwards "
                              "them")


def build_app(engine: AsyncEngine, cfg: ServerConfig) -> Starlette:
    api = _Api(engine, cfg)
    routes = [
        Route("/health", api.health, methods=["GET"]),
        Route("/metrics", api.metrics, methods=["GET"]),
        Route("/v1/models", api.endpoint("models", api.models), methods=["GET"]),
        Route("/v1/chat/completions", api.endpoint("chat", api.chat), methods=["POST"]),
        Route("/v1/completions", api.endpoint("completions", api.completions), methods=["POST"]),
        Route("/tokenize", api.endpoint("tokenize", api.tokenize), methods=["POST"]),
        Route("/detokenize", api.endpoint("detokenize", api.detokenize), methods=["POST"]),
    ]

    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        await anyio.to_thread.run_sync(engine.stop)

    origins = parse_origins(cfg.allowed_origins)
    middleware = [Middleware(RequestGuard, allowed_origins=origins),
                  Middleware(BodyTimeout, timeout_s=cfg.body_timeout_s, min_rate=cfg.min_body_rate)]
    if origins:  # browser pages of these origins may read the answers too
        middleware.insert(0, Middleware(CORSMiddleware, allow_origins=sorted(origins), allow_methods=["GET", "POST"],
                                        allow_headers=["authorization", "content-type"]))
    return Starlette(routes=routes, lifespan=lifespan, middleware=middleware,
                     exception_handlers={HTTPException: _http_error})


async def _http_error(request: Request, exc: HTTPException) -> Response:
    """Unknown routes and methods, in the same envelope as everything else."""
    kind = "not_found" if exc.status_code == 404 else "method_not_allowed" if exc.status_code == 405 else None
    return APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=kind).response()


class _Api:
    def __init__(self, engine: AsyncEngine, cfg: ServerConfig):
        self.engine = engine
        self.cfg = cfg
        self.stats = engine.metrics
        self.started = int(time.time())
        self.limiters = Limiters()

    def endpoint(self, name: str, handler):
        """Wrap a /v1 handler: authentication, the error envelope, and the request counter."""

        async def run(request: Request) -> Response:
            try:
                self._authenticate(request)
                response = await handler(request)
            except APIError as exc:  # the path and the message may hold client text: quoted, one line
                log.info("%s %r refused: %d %s: %r", request.method, request.url.path, exc.status,
                         exc.code or exc.type, exc.message)
                response = exc.response()
                # The traceback's frames hold the request (its params, a compiled grammar, its
                # streams) in reference cycles that only a full garbage collection would free.
                traceback.clear_frames(exc.__traceback__)
            except ClientDisconnect:  # the client's doing, not the server's: no 5xx, no traceback
                log.info("%s %r: the client disconnected before sending the whole body", request.method,
                         request.url.path)
                response = Response(status_code=CLIENT_CLOSED_REQUEST)
            except Exception:
                log.exception("%s %r failed", request.method, request.url.path)
                response = internal("internal server error; see the server log").response()
            self.stats.requests.labels(name, str(response.status_code)).inc()
            return response

        return run

    def _authenticate(self, request: Request) -> None:
        """Exactly `Bearer <key>`: one space, nothing around the key (the scheme's case is free, as
        RFC 9110 has it). The header's bytes (Starlette decodes them as latin-1) are compared with
        the key's UTF-8 in constant time."""
        if self.cfg.api_key is None:
            return
        token = _bearer(request)
        if token is None or not hmac.compare_digest(token.encode("latin-1"), self.cfg.api_key.encode()):
            raise APIError(401, "missing or invalid API key: send `Authorization: Bearer <key>`",
                           type="authentication_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})

    async def health(self, request: Request) -> Response:
        """200 when ready; else 503 with the state, the failure (`error`) and, while recovering, what
        the recovery is doing (`reason`: rebuilding, or waiting to retry and why). Once loaded, what
        runs each fused kernel, the quantization and speculative decoding's settings, where they apply."""
        state = self.engine.state
        body = {"status": state.value}
        if self.engine.error:
            body["error"] = self.engine.error
        if self.engine.reason:
            body["reason"] = self.engine.reason
        if self.engine.loaded and (kernels := self.engine.kernels()):  # what runs each fused piece, and why
            body["kernels"] = kernels
        if self.engine.loaded and self.engine.quantization:
            body["quantization"] = self.engine.quantization
        if self.engine.loaded and self.engine.speculative:
            body["speculative"] = self.engine.speculative
        return JSONResponse(body, 200 if state is EngineState.READY else 503)

    async def metrics(self, request: Request) -> Response:
        return Response(self.stats.render(), media_type=self.stats.content_type)

    async def models(self, request: Request) -> Response:
        check_ready(self.engine)
        card = ModelCard(self.engine.model_name, self.started, self.engine.max_model_len, self.engine.quantization)
        return Response(msgspec.json.encode(ModelList([card])), media_type="application/json")

    async def chat(self, request: Request) -> Response:
        req = await self._decode(request, ChatCompletionRequest)
        return await create_chat_completion(request, self.engine, req, self.cfg.keepalive_s, self.limiters,
                                            self._salt(request, req))

    async def completions(self, request: Request) -> Response:
        req = await self._decode(request, CompletionRequest)
        return await create_completion(request, self.engine, req, self.cfg.keepalive_s, self.limiters,
                                       self._salt(request, req))

    def _salt(self, request: Request, req: SamplingRequest) -> str | None:
        """The request's cache salt under this server's isolation. The key it presented: the bearer
        token, else the Authorization header as sent ("" without one: keyless requests share)."""
        token = _bearer(request)
        presented = token if token is not None else request.headers.get("authorization", "")
        return request_salt(req, self.cfg.prefix_cache_isolation, presented)

    async def tokenize(self, request: Request) -> Response:
        return await tokenize(self.engine, await self._decode(request, TokenizeRequest), self.limiters.tokenize)

    async def detokenize(self, request: Request) -> Response:
        return await detokenize(self.engine, await self._decode(request, DetokenizeRequest), self.limiters.tokenize)

    async def _decode(self, request: Request, kind: type):
        decoded = decode_body(await read_body(request, self.cfg.max_body_bytes), kind)
        require_json(request)
        return decoded


def _bearer(request: Request) -> str | None:
    """The token of an `Authorization: Bearer <token>` header; None without one."""
    given = request.headers.get("authorization", "")
    return given[len(_BEARER):] if given[:len(_BEARER)].lower() == _BEARER else None


def require_json(request: Request) -> None:
    """415 unless the body is declared JSON. A browser page may send text/plain or form bodies to any
    origin without asking first (a CORS "simple" request), but never `application/json`. A body that
    is not JSON at all is a 400 before this, whatever its type says."""
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        shown = repr(media_type) if media_type else "none"
        raise APIError(415, f"the request body must be sent as Content-Type: application/json, not {shown}",
                       code="unsupported_media_type")


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with a 413 as soon as it is known to exceed `limit` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise bad_request(f"invalid Content-Length header {declared!r}")
        if int(declared) > limit:
            raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than this server's limit of {limit} bytes",
                    code="request_too_large")


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
