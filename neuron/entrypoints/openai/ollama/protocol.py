"""Ollama's request bodies, as msgspec structs, and its error shape. Requests ignore fields they do
not know, as Ollama does; the handlers refuse by name the known ones neuron cannot honour."""

from __future__ import annotations

from typing import Any

from msgspec import Struct
from starlette.responses import JSONResponse, Response

from neuron.entrypoints.openai.api_errors import APIError

# The Ollama release whose API these routes follow; /api/version answers it, since clients compare
# it with the versions that brought the features they use.
OLLAMA_API_VERSION = "0.12.0"


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


class OllamaRequest(Struct, kw_only=True):
    model: str = ""
    format: str | dict[str, Any] | None = None
    options: Options | None = None
    stream: bool = True
    keep_alive: float | str | None = None
    think: bool | str | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class OllamaChatRequest(OllamaRequest, kw_only=True):
    messages: list[Any] = []
    tools: list[dict[str, Any]] | None = None


class OllamaGenerateRequest(OllamaRequest, kw_only=True):
    prompt: str = ""
    system: str | None = None
    images: list[str] | None = None
    raw: bool = False
    suffix: str | None = None
    template: str | None = None
    context: list[int] | None = None


class OllamaEmbedRequest(Struct, kw_only=True):
    """/api/embed: `input` a text or a list; `truncate` (Ollama's default) cuts each to the context
    from its end; `dimensions` keeps the first values."""

    model: str = ""
    input: str | list[str] = ""
    truncate: bool = True
    dimensions: int | None = None
    options: Options | None = None
    keep_alive: float | str | None = None
    cache_salt: str | None = None


class OllamaEmbeddingsRequest(Struct, kw_only=True):
    """The older /api/embeddings: one `prompt`."""

    model: str = ""
    prompt: str = ""
    options: Options | None = None
    keep_alive: float | str | None = None
    cache_salt: str | None = None


class OllamaShowRequest(Struct, kw_only=True):
    model: str = ""
    name: str = ""  # the older clients' name for `model`


def ollama_error(exc: APIError) -> Response:
    """Ollama's error shape: the message alone, with the status (and headers) the API chose."""
    return JSONResponse({"error": exc.message}, exc.status, exc.headers or None)
