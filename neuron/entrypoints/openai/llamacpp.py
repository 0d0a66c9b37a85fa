"""llama.cpp's own server API: POST /completion and /infill, GET /props, POST /apply-template and
/embedding (and /embeddings), for the clients written against llama-server (front ends, editor
plugins' code completion, scripts, its embedding clients). /tokenize and /detokenize take its shapes
too (serving_tokenization).

A translation, not a second server: a request becomes the completions path's (`CompletionRequest`):
its sampling fields in neuron's names, `grammar` (GBNF) and `json_schema` through structured output,
its prompt tokenized as llama-server tokenizes it (text with the tokenizer's BOS, token ids as they
are, a list mixing the two joined). What comes back is the same engine stream, written as llama-server
writes it: one object (an array of them for several prompts), or server-sent events of `content`
deltas, the last closing each answer with its `stop_type`, counts and timings.

Sampling fields a request leaves out take the model's generation_config.json, as on the other routes,
not llama-server's command-line defaults; /props shows what they are. Samplers neuron does not have
(Mirostat, DRY, XTC, typical, dynamic temperature, top-n-sigma) are refused by name unless off; the
repetition penalty covers the last `repeat_last_n` tokens, as llama-server's does. The server's own
settings (`id_slot`, `cache_prompt`, `n_keep`, the `samplers`' order, ...) are ignored, as are fields
it does not know.
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import msgspec
import numpy as np
from msgspec import Struct
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import neuron
from neuron.engine.async_engine import AsyncEngine, RequestStream
from neuron.engine.pooling import EMBED, GENERATE
from neuron.engine.sampling_params import LOGIT_BIAS_RANGE, MAX_TOKEN_LIST, SamplingParams
from neuron.entrypoints.openai.api_errors import APIError, bad_request, renamed, unsupported
from neuron.entrypoints.openai.api_types import CompletionRequest
from neuron.entrypoints.openai.common import (
    Samples,
    check_ready,
    check_serves,
    new_id,
    open_samples,
    sampling_params,
    stream_error,
    stream_events,
)
from neuron.entrypoints.openai.guided import compile_guided
from neuron.entrypoints.openai.logprobs import LogprobRenderer, clamp_logprob
from neuron.entrypoints.openai.ollama import Served
from neuron.entrypoints.openai.ollama.translate import repetition
from neuron.entrypoints.openai.prompt_input import check_prompt_ids, check_vocabulary, off_loop
from neuron.entrypoints.openai.serving_completions import fill_in_the_middle, prompt_ids
from neuron.entrypoints.openai.serving_embeddings import MAX_INPUTS, EmbeddingBatch, pooling_params, tokenized_inputs
from neuron.entrypoints.openai.serving_tokenization import rendered_chat
from neuron.entrypoints.openai.streaming import EventStreamResponse, json_unless_disconnected


class LlamaCompletionRequest(Struct, kw_only=True):
    """A /completion or /infill body: the fields neuron reads. Others are ignored, as llama-server
    ignores fields it does not know."""

    prompt: Any = ""
    model: str | None = None
    n_predict: int | None = None
    max_tokens: int | None = None  # llama-server's other name for n_predict
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int = -1
    stop: list[str] | str | None = None
    ignore_eos: bool = False
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: list | dict | None = None
    n_probs: int = 0
    n_cmpl: int = 1
    stream: bool = False
    return_tokens: bool = False
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None
    response_fields: list[str] | None = None
    cache_salt: str | None = None  # neuron's, as on its other routes
    # /infill
    input_prefix: str | None = None
    input_suffix: str | None = None
    input_extra: list[Any] | None = None
    # what neuron cannot do, refused unless at the value that turns it off
    typical_p: float | None = None
    dynatemp_range: float | None = None
    top_n_sigma: float | None = None
    mirostat: int | None = None
    dry_multiplier: float | None = None
    xtc_probability: float | None = None
    n_indent: int | None = None
    t_max_predict_ms: int | None = None
    post_sampling_probs: bool = False
    lora: list[Any] | None = None
    image_data: Any = None
    multimodal_data: Any = None


class LlamaEmbeddingRequest(Struct, kw_only=True):
    """A /embedding or /embeddings body, llama-server's own (not OpenAI's /v1/embeddings): `content`
    (or `input`) a text, token ids, or a list of those; `embd_normalize` how each pooled vector is
    scaled: -1 not at all, 0 to an int16 range by its largest value, 1 by its sum of magnitudes, 2
    (the default) to unit length, p > 2 by its p-norm."""

    content: Any = None
    input: Any = None
    model: str | None = None
    embd_normalize: int = 2
    encoding_format: str = "float"  # checked as llama-server checks it; the answer holds floats
    cache_salt: str | None = None  # neuron's, as on its other routes


_MAX_NORM = 1 << 10  # the largest p of a p-norm


# (field, the value that turns it off, what to say)
_OFF = (("typical_p", 1.0, "locally typical sampling"), ("dynatemp_range", 0.0, "dynamic temperature"),
        ("top_n_sigma", -1.0, "top-n-sigma sampling"), ("mirostat", 0, "Mirostat sampling"),
        ("dry_multiplier", 0.0, "DRY sampling"), ("xtc_probability", 0.0, "XTC sampling"),
        ("n_indent", 0, "a minimum indentation"), ("t_max_predict_ms", 0, "a time limit on generation"))
_SAMPLES = "neuron samples with temperature, top_k, top_p, min_p and the repetition, presence and frequency penalties"
# The completions path's names for what a llama.cpp request calls otherwise, in the errors it raises.
_NAMES = {"max_tokens": "n_predict", "repetition_penalty": "repeat_penalty", "repetition_window": "repeat_last_n",
          "logprobs": "n_probs", "n": "n_cmpl", "guided_grammar": "grammar", "response_format": "json_schema",
          "response_format.json_schema.schema": "json_schema"}
# llama-server's error types by status
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                501: "not_supported_error", 503: "unavailable_error"}


def llamacpp_error(exc: APIError) -> Response:
    """An error as llama-server writes one: `{"error": {"code", "message", "type"}}`, the code the status."""
    return JSONResponse(_error_body(exc), exc.status, exc.headers)


def _error_body(exc: APIError) -> dict:
    kind = _ERROR_TYPES.get(exc.status, "server_error" if exc.status >= 500 else "invalid_request_error")
    return {"error": {"code": exc.status, "message": exc.message, "type": kind}}


def llamacpp_routes(served: Served, endpoint: Callable) -> list[Route]:
    """Every route through `endpoint` (admission, limits, the API key, the guards), its errors in
    llama-server's shape."""
    api = _LlamaCpp(served)

    def route(path: str, handler, method: str = "POST") -> Route:
        name = "llamacpp_" + path.strip("/").replace("-", "_")  # the request counter's label
        return Route(path, endpoint(name, handler, errors=llamacpp_error), methods=[method])

    return [route("/completion", api.completion), route("/infill", api.infill), route("/props", api.props, "GET"),
            route("/apply-template", api.apply_template), route("/embedding", api.embedding),
            route("/embeddings", api.embedding)]


class _LlamaCpp:
    def __init__(self, served: Served):
        self.served = served

    async def completion(self, request: Request) -> Response:
        req = await self.served.decode(request, LlamaCompletionRequest)
        engine = await self.served.named(req.model or None)
        if req.input_prefix is not None or req.input_suffix is not None or req.input_extra:
            raise bad_request("input_prefix, input_suffix and input_extra belong to /infill", param="input_prefix")
        return await self._generate(request, engine, req, await self._prompts(engine, req.prompt))

    async def infill(self, request: Request) -> Response:
        """The model's fill-in-the-middle prompt for `input_prefix` and `input_suffix`, after the
        files of `input_extra` (in the repository layout where the vocabulary has its tokens), and
        `prompt` after the prompt's middle token, as llama-server builds it."""
        req = await self.served.decode(request, LlamaCompletionRequest)
        engine = await self.served.named(req.model or None)
        check_ready(engine)
        if not isinstance(req.prompt, str):
            raise bad_request("an infill's prompt is text, written after the middle", param="prompt")
        text = _extra(engine, req.input_extra) + fill_in_the_middle(engine, req.input_prefix or "",
                                                                    req.input_suffix or "") + req.prompt
        return await self._generate(request, engine, req, await self._prompts(engine, text))

    async def embedding(self, request: Request) -> Response:
        """Each input's pooled vector, scaled as `embd_normalize` says, as llama-server answers:
        `[{"index": i, "embedding": [vector]}]` (one vector an input: neuron pools every model)."""
        req = await self.served.decode(request, LlamaEmbeddingRequest)
        engine = await self.served.named(req.model or None)
        value = req.input if req.input is not None else req.content
        if value is None:
            raise bad_request('"input" or "content" must be provided', param="content")
        norm = req.embd_normalize
        if isinstance(norm, bool) or not isinstance(norm, int) or not -1 <= norm <= _MAX_NORM:
            raise bad_request(f"embd_normalize must be an integer in -1..{_MAX_NORM}, got {norm!r:.40}",
                              param="embd_normalize")
        if req.encoding_format not in ("float", "base64"):
            raise bad_request("encoding_format must be float or base64", param="encoding_format")
        check_serves(engine, EMBED)
        inputs = [value] if isinstance(value, str) or _is_one(value) else value
        if not isinstance(inputs, list) or not inputs or len(inputs) > MAX_INPUTS or not all(map(_embeddable, inputs)):
            raise bad_request(f"content must be a non-empty text, token ids, or a list of at most {MAX_INPUTS} of "
                              "those", param="content")
        ids = await tokenized_inputs(engine, inputs, self.served.limiters.tokenize, None)
        raw = pooling_params(use_activation=False)  # as pooled: embd_normalize scales it
        batch = EmbeddingBatch(engine, new_id("embd"), ids, raw, self.served.salt(request, req))

        async def collect() -> bytes:  # thousands of vectors are scaled and encoded off the event loop
            vectors = await batch.run()
            return await anyio.to_thread.run_sync(_embedding_body, vectors, norm)

        return await json_unless_disconnected(request, batch, collect())

    async def _prompts(self, engine: AsyncEngine, prompt: Any) -> list[tuple[str, list[int]]]:
        """Each prompt as text (as the answer shows it) and token ids: a string is one prompt, its
        tokens with the tokenizer's BOS; a list of ids one; a list mixing ids and strings one, its
        strings tokenized without special tokens but for a leading one; a list of those several."""
        check_ready(engine)
        if isinstance(prompt, (str, dict)) or _is_one(prompt):
            prompts = [prompt]
        elif isinstance(prompt, list) and prompt:
            prompts = prompt
        else:
            raise bad_request("prompt must be a string, token ids, a list mixing both, or a list of those",
                              param="prompt")
        if len(prompts) > engine.max_per_request:  # before tokenizing any (n_cmpl is checked when they are opened)
            raise bad_request(f"the request has {len(prompts)} prompts; one request may hold at most "
                              f"{engine.max_per_request} of this server's {engine.capacity} places", param="prompt")
        out = []
        for i, p in enumerate(prompts):
            where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            if isinstance(p, dict):
                if p.get("multimodal_data"):
                    raise unsupported(f"{where}.multimodal_data", "multimodal_data is not supported on /completion; "
                                                                  "send images to /v1/chat/completions")
                p = p.get("prompt_string")
            if isinstance(p, str):
                p = [p]
            if not isinstance(p, list) or not p or not all(_is_id(t) or isinstance(t, str) for t in p):
                raise bad_request(f"{where} must be a non-empty string, token ids or a list mixing both", param=where)
            ids: list[int] = []
            for j, piece in enumerate(p):
                if isinstance(piece, str):
                    ids += await prompt_ids(engine, piece, self.served.limiters.tokenize, add_special_tokens=j == 0)
                else:
                    ids.append(piece)
            check_prompt_ids(engine, ids, where)
            check_vocabulary(engine, ids, where)
            out.append((await self._shown(engine, p, ids), ids))
        return out

    async def _shown(self, engine: AsyncEngine, pieces: list, ids: list[int]) -> str:
        """A prompt as the answer shows it: its text, or where it holds ids, their text."""
        if all(isinstance(t, str) for t in pieces):
            return "".join(pieces)
        if engine.tokenizer is None:
            return ""
        return await off_loop(self.served.limiters.tokenize, engine.tokenizer.decode, ids, False)

    async def _generate(self, request: Request, engine: AsyncEngine, req: LlamaCompletionRequest,
                        prompts: list[tuple[str, list[int]]]) -> Response:
        check_serves(engine, GENERATE)
        completion, warm = await self._completion_request(engine, req)
        params = sampling_params(completion, engine.default_sampling(), max_tokens=completion.max_tokens,
                                 logprobs=req.n_probs or None, renames=_NAMES)
        try:
            grammar = await compile_guided(engine, completion, self.served.limiters.grammar)
            samples = open_samples(engine, new_id("cmpl"), [ids for _, ids in prompts], params, "prompt",
                                   grammar=grammar, cache_salt=self.served.salt(request, completion))
        except APIError as exc:
            raise renamed(exc, _NAMES) from None
        answer = _Answer(engine, req, params, prompts, samples, warm, self.served.keepalive_s)
        if req.stream:
            return EventStreamResponse(answer.events(), on_close=samples.close)
        return await json_unless_disconnected(request, samples, answer.collect())

    async def _completion_request(self, engine: AsyncEngine, req: LlamaCompletionRequest) -> tuple[CompletionRequest,
                                                                                                      bool]:
        """The completions path's request, and whether it only fills the cache (`n_predict` 0: its
        one token is left out of the answer)."""
        for field, off, what in _OFF:
            value = getattr(req, field)
            if value is not None and value != off:
                raise unsupported(field, f"{field} ({what}) is not supported: {_SAMPLES}; leave it at {off}")
        if req.post_sampling_probs:
            raise unsupported("post_sampling_probs", "post_sampling_probs is not supported: n_probs gives the "
                                                     "model's log-probabilities before sampling")
        if req.lora:
            raise unsupported("lora", "lora is not supported per request on /completion: name a loaded adapter as "
                                      "the model")
        if req.image_data or req.multimodal_data:
            raise unsupported("image_data", "images are not supported on /completion; send them to "
                                            "/v1/chat/completions")
        penalty, window = repetition(req.repeat_penalty, req.repeat_last_n, "repeat_last_n")
        n_predict = req.n_predict if req.n_predict is not None else req.max_tokens
        if n_predict is not None and n_predict < -2:
            raise bad_request(f"n_predict must be -1 (no limit) or >= 0, got {n_predict}", param="n_predict")
        if req.seed < -1:
            raise bad_request(f"seed must be -1 (random) or >= 0, got {req.seed}", param="seed")
        if req.n_probs < 0:
            raise bad_request(f"n_probs must be >= 0, got {req.n_probs}", param="n_probs")
        warm = n_predict == 0  # llama-server evaluates the prompt into its cache and writes nothing
        fmt = {"type": "json_schema", "json_schema": {"name": "json_schema", "schema": req.json_schema}} \
            if req.json_schema is not None else None
        completion = CompletionRequest(
            model=req.model, prompt="", temperature=req.temperature, top_k=req.top_k, top_p=req.top_p,
            min_p=req.min_p, seed=None if req.seed == -1 else req.seed, stop=req.stop, ignore_eos=req.ignore_eos,
            repetition_penalty=penalty, repetition_window=window, presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty, n=req.n_cmpl, stream=req.stream,
            max_tokens=1 if warm else n_predict if n_predict is not None and n_predict > 0 else None,
            logit_bias=await self._logit_bias(engine, req.logit_bias), guided_grammar=req.grammar,
            response_format=fmt, cache_salt=req.cache_salt)
        return completion, warm

    async def _logit_bias(self, engine: AsyncEngine, bias: list | dict | None) -> dict[str, float] | None:
        """llama-server's logit_bias, `[[token, bias], ...]` or `{token: bias}`, a token an id or a
        text (each of its tokens biased), a bias a number or false (never sampled), as OpenAI's
        `{id: bias}`."""
        if not bias:
            return None
        pairs = list(bias.items()) if isinstance(bias, dict) else bias
        texts = sum(1 for p in pairs if isinstance(p, (list, tuple)) and p and isinstance(p[0], str)
                    and not _ID.fullmatch(p[0]))
        if len(pairs) > MAX_TOKEN_LIST or texts > _MAX_BIASED_TEXTS:
            raise bad_request(f"logit_bias may hold at most {MAX_TOKEN_LIST} tokens, {_MAX_BIASED_TEXTS} of them "
                              f"texts; it has {len(pairs)}, {texts} texts", param="logit_bias")
        out: dict[str, float] = {}
        for i, pair in enumerate(pairs):
            where = f"logit_bias[{i}]"
            if not (isinstance(pair, (list, tuple)) and len(pair) == 2):
                raise bad_request("logit_bias must be [[token, bias], ...] or {token: bias}", param=where)
            token, value = pair
            if value is False:
                value = LOGIT_BIAS_RANGE[0]
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise bad_request(f"{where}'s bias must be a number or false", param=where)
            if isinstance(token, str) and _ID.fullmatch(token):
                ids = [int(token)]
            elif isinstance(token, str):
                ids = await prompt_ids(engine, token, self.served.limiters.tokenize, add_special_tokens=False)
            elif _is_id(token):
                ids = [token]
            else:
                raise bad_request(f"{where}'s token must be an id or a text", param=where)
            out.update((str(t), float(value)) for t in ids)
        return out

    async def props(self, request: Request) -> Response:
        """The server's defaults for /completion, its slots, the model's chat template and path."""
        name = request.query_params.get("model")
        engine = await self.served.named(name or None)
        check_ready(engine)
        defaults = sampling_params(CompletionRequest(model=name, prompt=""), engine.default_sampling(),
                                   max_tokens=None, logprobs=None, renames={})
        tok = engine.tokenizer
        return JSONResponse({
            "default_generation_settings": {"id": 0, "id_task": -1, "n_ctx": engine.max_model_len,
                                            "speculative": bool(engine.speculative), "is_processing": False,
                                            "params": _settings(defaults, stream=False), "prompt": ""},
            "total_slots": engine.max_running,
            "model_alias": engine.model_name,
            "model_path": engine.model_path,
            "chat_template": tok.chat_template if tok is not None else None,
            "modalities": {"vision": engine.vision is not None, "audio": False},
            "bos_token": tok.named_tokens.get("bos_token") if tok is not None else None,
            "eos_token": tok.named_tokens.get("eos_token") if tok is not None else None,
            "build_info": f"neuron {neuron.__version__}",
            "is_sleeping": False,
        })

    async def apply_template(self, request: Request) -> Response:
        """The chat as the model's template renders it for a reply, without generating."""
        req = await self.served.decode(request, _TemplateRequest)
        engine = await self.served.named(req.model or None)
        check_ready(engine)
        text = await off_loop(self.served.limiters.tokenize, rendered_chat, engine, req.messages, True, False,
                              None, None)
        return JSONResponse({"prompt": text})


class _TemplateRequest(Struct, kw_only=True):
    messages: list[dict[str, Any]]
    model: str | None = None


_ID = re.compile(r"-?[0-9]{1,12}")  # a token id written as a JSON object's key
_MAX_BIASED_TEXTS = 1024  # texts to tokenize for logit_bias, each its own pass


def _is_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def _embedding_body(vectors: list[list[float]], norm: int) -> bytes:
    return msgspec.json.encode([{"index": i, "embedding": [_scaled(v, norm)]} for i, v in enumerate(vectors)])


def _embeddable(value: Any) -> bool:
    """One input of /embedding: a non-empty text or token ids."""
    return isinstance(value, str) and value != "" or isinstance(value, list) and bool(value) and all(map(_is_id, value))


def _scaled(vector: list[float], norm: int) -> list[float]:
    """A pooled vector scaled as llama-server's `embd_normalize` says (-1: as it is; 0: its largest
    magnitude to 32,760; p >= 1: to unit p-norm); a zero vector stays zero."""
    if norm == -1:
        return vector
    v = np.asarray(vector, dtype=np.float64)
    top = float(np.abs(v).max(initial=0.0))
    if top == 0.0:
        return [0.0] * len(vector)
    # the p-norm with the largest magnitude taken out first, so a large p neither overflows nor underflows
    size = top / 32760.0 if norm == 0 else top * float(np.sum((np.abs(v) / top) ** norm) ** (1.0 / norm))
    return (v / size).astype(np.float32).tolist()


def _is_one(prompt: Any) -> bool:
    """A list that is one prompt: token ids, or ids and strings mixed (several prompts hold no ids
    at the top level)."""
    return isinstance(prompt, list) and bool(prompt) and any(_is_id(t) for t in prompt)


def _extra(engine: AsyncEngine, extra: list | None) -> str:
    """`input_extra`'s files before the fill-in-the-middle prompt: in the repository layout where the
    vocabulary has its tokens (Qwen2.5-Coder's), else their texts as they are."""
    if not extra:
        return ""
    chunks = []
    for i, chunk in enumerate(extra):
        if not (isinstance(chunk, dict) and isinstance(chunk.get("text", ""), str)
                and isinstance(chunk.get("filename", ""), str)):
            raise bad_request('input_extra must be a list of {"filename": ..., "text": ...}',
                              param=f"input_extra[{i}]")
        chunks.append((chunk.get("filename", ""), chunk.get("text", "")))
    tok = engine.tokenizer
    if tok is not None and tok.token_to_id(_REPO) is not None and tok.token_to_id(_FILE) is not None:
        files = "".join(f"{_FILE}{name}\n{text}" for name, text in chunks)
        return f"{_REPO}myproject\n{files}{_FILE}filename\n"
    return "".join(text for _, text in chunks)


_REPO, _FILE = "<|repo_name|>", "<|file_sep|>"


def _settings(params: SamplingParams, stream: bool) -> dict:
    """Sampling params in llama-server's names (its `generation_settings`)."""
    limit = -1 if params.max_tokens is None else params.max_tokens
    stop = [params.stop] if isinstance(params.stop, str) else list(params.stop or [])
    return {"n_predict": limit, "max_tokens": limit, "seed": -1 if params.seed is None else params.seed,
            "temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p, "min_p": params.min_p,
            "repeat_penalty": params.repetition_penalty,
            "repeat_last_n": -1 if params.repetition_window is None else params.repetition_window,
            "presence_penalty": params.presence_penalty, "frequency_penalty": params.frequency_penalty,
            "stop": stop, "ignore_eos": params.ignore_eos, "stream": stream, "n_probs": params.logprobs or 0,
            "samplers": ["penalties", "top_k", "top_p", "min_p", "temperature"]}


class _Answer:
    """What one request's samples come back as: stream k is answer k (prompt k // n_cmpl)."""

    def __init__(self, engine: AsyncEngine, req: LlamaCompletionRequest, params: SamplingParams,
                 prompts: list[tuple[str, list[int]]], samples: Samples, warm: bool, keepalive_s: float):
        self.req, self.samples, self.warm, self.keepalive_s = req, samples, warm, keepalive_s
        self.model = engine.model_name
        self.prompts = prompts
        self.settings = _settings(params, req.stream) | {"n_ctx": engine.max_model_len, "model": self.model}
        if warm:
            self.settings.update(n_predict=0, max_tokens=0)
        n = len(samples.streams)
        self.text = [[] for _ in range(n)]
        self.ids: list[list[int]] = [[] for _ in range(n)]
        self.render = LogprobRenderer(engine.tokenizer, False) if req.n_probs else None

    def _probs(self, update) -> list[dict]:
        if self.render is None or update.logprobs is None:
            return []
        out = []
        for token, entry in zip(update.token_ids, update.logprobs):
            top = sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:self.req.n_probs]
            out.append({**self._prob(token, entry[token]), "top_logprobs": [self._prob(t, v) for t, v in top]})
        return out

    def _prob(self, token: int, logprob: float) -> dict:
        return {"id": token, "token": self.render.token(token), "bytes": self.render.token_bytes(token),
                "logprob": clamp_logprob(logprob)}

    def _final(self, k: int, update, probs: list[dict]) -> dict:
        """Answer k's closing object: its whole content (or, streamed, none), why it stopped, counts, timings."""
        stream: RequestStream = self.samples.streams[k]
        predicted = 0 if self.warm else stream.num_output_tokens
        reason = update.finish_reason
        word = update.stop_reason if reason == "stop" and isinstance(update.stop_reason, str) else ""
        stop_type = "word" if word else "limit" if reason == "length" or self.warm else "eos"
        text = "".join(self.text[k])
        body = {"index": k, "content": "" if self.req.stream else text,
                "tokens": [] if self.req.stream or not self.req.return_tokens else self.ids[k],
                "id_slot": -1, "stop": True, "model": self.model, "tokens_predicted": predicted,
                "tokens_evaluated": stream.num_prompt_tokens, "generation_settings": self.settings,
                "prompt": self.prompts[k // self.samples.per_prompt][0], "has_new_line": "\n" in text,
                "truncated": False, "stop_type": stop_type, "stopping_word": word,
                "timings": _timings(stream, predicted)}
        if self.render is not None and not self.req.stream:
            body["completion_probabilities"] = probs
        if self.req.response_fields is not None and not self.req.stream:
            body = _only(body, self.req.response_fields)
        return body

    async def collect(self) -> bytes:
        answers = []
        for k, stream in enumerate(self.samples.streams):
            probs: list[dict] = []
            async for update in stream:
                if update.finish_reason == "error":
                    raise stream_error(stream, update.error)
                if not self.warm:
                    self.text[k].append(update.text)
                    self.ids[k] += update.token_ids
                    probs += self._probs(update)
                last = update
            answers.append(self._final(k, last, probs))
        return msgspec.json.encode(answers[0] if len(answers) == 1 else answers)

    async def events(self) -> AsyncIterator[bytes]:
        running = [0] * len(self.samples.streams)

        async def chunks(k: int, update) -> list[bytes]:
            out = []
            if not self.warm and (update.text or update.token_ids):
                running[k] += len(update.token_ids)
                self.text[k].append(update.text)
                part = {"index": k, "content": update.text, "tokens": update.token_ids, "stop": False,
                        "id_slot": -1, "tokens_predicted": running[k],
                        "tokens_evaluated": self.samples.streams[k].num_prompt_tokens}
                if self.render is not None:
                    part["completion_probabilities"] = self._probs(update)
                out.append(_sse(part))
            if update.finished:
                out.append(_sse(self._final(k, update, [])))
            return out

        async for event in stream_events(self.samples, self.keepalive_s, chunks, None, error_event=_error_event,
                                         done=b""):
            yield event


def _sse(obj) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


def _error_event(exc: APIError) -> bytes:
    return _sse(_error_body(exc))


def _timings(stream: RequestStream, predicted: int) -> dict:
    """llama-server's timings: the prompt's from the request's arrival at the engine to its first
    token, the rest's from there to the last."""
    now = time.monotonic()
    first = stream.first_token_at or now
    prompt_ms = (first - stream.arrival) * 1e3
    predicted_ms = ((stream.last_token_at or first) - first) * 1e3
    n = stream.num_prompt_tokens
    return {"prompt_n": n, "prompt_ms": prompt_ms, "prompt_per_token_ms": prompt_ms / n if n else 0.0,
            "prompt_per_second": n * 1e3 / prompt_ms if prompt_ms > 0 else 0.0,
            "predicted_n": predicted, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / predicted if predicted else 0.0,
            "predicted_per_second": predicted * 1e3 / predicted_ms if predicted_ms > 0 else 0.0}


def _only(body: dict, fields: list[str]) -> dict:
    """`response_fields`: the fields named, a nested one (`generation_settings/n_predict`) at the top
    under its path; a field the answer lacks is left out."""
    out = {}
    for path in fields:
        value: Any = body
        for part in path.split("/"):
            if not (isinstance(value, dict) and part in value):
                break
            value = value[part]
        else:
            out[path] = value
    return out
