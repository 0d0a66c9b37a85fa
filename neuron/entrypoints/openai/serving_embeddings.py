"""POST /v1/embeddings in OpenAI's shape, onto the one engine path.

Each input becomes one pooling request (LLMEngine.add_request with PoolingParams): prefilled in the ordinary
batched step beside whatever else runs, its final update carrying the pooled vector. A request
keeps at most `max_per_request` inputs in the engine at once and queues the next as each
finishes, so a client that sends a thousand inputs neither takes every place nor gets refused.
`dimensions` keeps each vector's first values, normalized again where the model normalizes (the
engine cuts them; vLLM's `use_activation` false leaves every vector as pooled); `encoding_format`
base64 sends them as little-endian float32 bytes, as OpenAI does.
"""

from __future__ import annotations

import base64
import struct

import anyio
from starlette.requests import Request
from starlette.responses import Response

from neuron.engine.async_engine import AsyncEngine, RequestStream
from neuron.engine.llm_engine import RequestError
from neuron.engine.pooling import EMBED, PoolingParams
from neuron.engine.request_stream import wait_any
from neuron.engine.sampling_params import InvalidParams
from neuron.entrypoints.openai.api_errors import bad_request
from neuron.entrypoints.openai.api_types import EmbeddingData, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from neuron.entrypoints.openai.common import admitted, check_serves, encoded, new_id, now, stream_error, truncated
from neuron.entrypoints.openai.prompt_input import check_prompt_chars, off_loop
from neuron.entrypoints.openai.streaming import json_unless_disconnected

MAX_INPUTS = 2048  # inputs one request may hold, as OpenAI allows
_FORMATS = ("float", "base64")


async def create_embedding(request: Request, engine: AsyncEngine, req: EmbeddingRequest,
                           limiter: anyio.CapacityLimiter, cache_salt: str | None = None) -> Response:
    """`limiter` bounds how many inputs are tokenized at once; `cache_salt` is the request's, as
    the server's isolation makes it (common.request_salt)."""
    check_serves(engine, EMBED)
    inputs = embedding_inputs(req.input)
    if req.encoding_format not in _FORMATS:
        raise bad_request(f"encoding_format must be float or base64, got {req.encoding_format!r}",
                          param="encoding_format")
    check_dimensions(engine, req.dimensions)
    params = pooling_params(req.dimensions, req.truncate_prompt_tokens, use_activation=req.use_activation)
    ids = await tokenized_inputs(engine, inputs, limiter, params.truncate_prompt_tokens)
    batch = EmbeddingBatch(engine, new_id("embd"), ids, params, cache_salt)
    return await json_unless_disconnected(request, batch, _respond(engine, req, batch))


def pooling_params(dimensions: int | None = None, keep: int | None = None, task: str = EMBED,
                   use_activation: bool | None = None) -> PoolingParams:
    """The request's PoolingParams (`keep`: truncate_prompt_tokens), or a 400 naming the bad field."""
    try:
        return PoolingParams(dimensions, keep, task, use_activation)
    except InvalidParams as exc:
        raise bad_request(str(exc), param=exc.param) from None


def check_dimensions(engine: AsyncEngine, dimensions: int | None) -> None:
    """`dimensions` (Matryoshka) within the model's embedding size, or a 400."""
    if dimensions is not None and not 0 < dimensions <= engine.hidden_size:
        raise bad_request(f"dimensions must be in 1..{engine.hidden_size} (this model's embedding size), got "
                          f"{dimensions}", param="dimensions")


def embedding_inputs(value) -> list:
    """The request's inputs: a string or a list of token ids is one; a list of either is several."""
    if isinstance(value, str) or _is_ids(value):
        inputs = [value]
    elif isinstance(value, list) and value and (all(isinstance(v, str) for v in value)
                                                or all(_is_ids(v) for v in value)):
        inputs = value
    else:
        raise bad_request("input must be a non-empty string, a non-empty list of token ids, or a non-empty list of "
                          "strings or of token-id lists", param="input")
    if len(inputs) > MAX_INPUTS:
        raise bad_request(f"the request has {len(inputs)} inputs; at most {MAX_INPUTS} are taken at once",
                          param="input")
    if any(v == "" for v in inputs):
        raise bad_request("input must not hold an empty string", param="input")
    return inputs


def _is_ids(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in value)


async def tokenized_inputs(engine: AsyncEngine, inputs: list, limiter: anyio.CapacityLimiter,
                           keep: int | None, keep_start: bool = False) -> list[list[int]]:
    """Each input's token ids (text bounded by its length, then tokenized off the event loop, as a
    completion's prompt is; `keep`, truncate_prompt_tokens, cuts each to its last tokens instead,
    or with `keep_start` to its first, as Ollama does), each checked against the model's length
    and vocabulary."""
    out = []
    for value in inputs:
        if isinstance(value, str):
            if keep is None:
                check_prompt_chars(engine, len(value), "input")
            try:
                value = await off_loop(limiter, engine.encode_prompt, value)
            except RequestError as exc:
                raise bad_request(str(exc), param="input") from None
        value = value[:keep] if keep_start and keep is not None else truncated(engine, value, keep)
        try:
            engine.validate_embedding(value)
        except RequestError as exc:
            raise bad_request(str(exc), param="input", code=exc.code) from None
        out.append(value)
    return out


class EmbeddingBatch:
    """The engine requests behind one embeddings request, at most `max_per_request` in flight."""

    def __init__(self, engine: AsyncEngine, request_id: str, ids: list[list[int]], params: PoolingParams,
                 cache_salt: str | None, types_from: list[int | None] | None = None):
        self.engine, self.request_id, self.ids, self.params, self.cache_salt = engine, request_id, ids, params, cache_salt
        self.types_from = types_from or [None] * len(ids)  # a cross-encoder's pairs: LLMEngine.add_request's
        self.window = engine.max_per_request
        self.open: dict[int, RequestStream] = {}
        self.vectors: list[list[float] | None] = [None] * len(ids)
        self.queued = 0  # inputs handed to the engine so far

    async def run(self) -> list[list[float]]:
        self._fill()
        while self.open:
            await wait_any(list(self.open.values()))
            for k, stream in list(self.open.items()):
                for update in stream.take():
                    if not update.finished:
                        continue
                    del self.open[k]
                    stream.close()
                    if update.finish_reason == "error":
                        raise stream_error(stream, update.error)
                    self.vectors[k] = update.embedding
            self._fill()
        return self.vectors

    def _fill(self) -> None:
        """Queue inputs while the window has room; a full server only delays them while some of
        this request's are in flight (their end makes room), else it is a 503."""
        while self.queued < len(self.ids) and len(self.open) < self.window:
            if self.open and len(self.engine.open_streams) >= self.engine.capacity:
                return
            k = self.queued
            rid = self.request_id if len(self.ids) == 1 else f"{self.request_id}-{k}"
            self.open[k] = admitted(lambda: self.engine.open(rid, self.ids[k], self.params, cache_salt=self.cache_salt,
                                                             types_from=self.types_from[k]), "input")
            self.queued += 1

    def close(self) -> None:
        for stream in self.open.values():
            stream.close()
        self.open.clear()


async def _respond(engine: AsyncEngine, req: EmbeddingRequest, batch: EmbeddingBatch) -> bytes:
    """The response body once every input has its vector; shaping thousands of vectors runs in a
    worker thread, as their JSON is encoded."""
    vectors = await batch.run()
    data = await anyio.to_thread.run_sync(_data, vectors, req.encoding_format)
    tokens = sum(map(len, batch.ids))
    return await encoded(EmbeddingResponse(batch.request_id, now(), engine.model_name, data,
                                           EmbeddingUsage(tokens, tokens)))


def _data(vectors: list[list[float]], encoding_format: str) -> list[EmbeddingData]:
    return [EmbeddingData(k, _encoded(v, encoding_format)) for k, v in enumerate(vectors)]


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
