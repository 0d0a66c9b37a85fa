"""What the chat and completions endpoints share: model check, sampling params, the cache salt,
admission of a request's samples (n, best_of, several prompts), usage."""

from __future__ import annotations

import dataclasses
import hashlib
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import anyio
import msgspec

from neuron.config import settings
from neuron.engine.async_engine import AsyncEngine, EngineState, NotReady, Overloaded, RequestStream
from neuron.engine.input_processor import check_cache_salt
from neuron.engine.llm_engine import RequestError, Update
from neuron.engine.parallel_sampling import num_samples, ranked, sample_id, sample_params
from neuron.engine.pooling import CLASSIFY, EMBED, GENERATE
from neuron.engine.sampling_params import LOGIT_BIAS_RANGE, REPETITION_PENALTY_RANGE, InvalidParams, SamplingParams
from neuron.engine.structured_output import CompiledGrammar
from neuron.entrypoints.openai.api_errors import (
    APIError,
    bad_request,
    generation_failed,
    internal,
    unavailable,
    unsupported,
)
from neuron.entrypoints.openai.api_types import EmbeddingRequest, SamplingRequest, UsageInfo
from neuron.entrypoints.openai.streaming import DONE, KEEPALIVE, merged_updates
from neuron.multimodal.image import ImageInput

# OpenAI's defaults, used where neither the request nor generation_config.json says otherwise.
_OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "presence_penalty": 0.0,
                    "frequency_penalty": 0.0, "repetition_penalty": 1.0}
_RETRY_AFTER_S = 1


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


_MAX_REQUEST_ID = 256


def request_ids(prefix: str, given: str | None) -> tuple[str, str]:
    """The response's id and the engine's for it: vLLM's `request_id` names the response
    (`prefix-<request_id>`), and the engine's, which must be unique among the requests running,
    adds a suffix of its own, so two clients that send the same id never meet."""
    if given is None:
        rid = new_id(prefix)
        return rid, rid
    if not 0 < len(given) <= _MAX_REQUEST_ID or not given.isprintable():
        raise bad_request(f"request_id must be 1 to {_MAX_REQUEST_ID} printable characters", param="request_id")
    shown = f"{prefix}-{given}"
    return shown, f"{shown}-{uuid.uuid4().hex[:12]}"


def now() -> int:
    return int(time.time())


async def encoded(response) -> bytes:
    """A whole response's JSON, encoded in a worker thread: with n samples and logprobs it can be
    megabytes, and the event loop keeps answering other clients (and /health) meanwhile."""
    return await anyio.to_thread.run_sync(msgspec.json.encode, response)


def sse(obj) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


def check_model(req: SamplingRequest, served_name: str) -> None:
    if not req.model:
        raise bad_request("you must provide a model parameter", param="model")
    if req.model != served_name:
        raise APIError(404, f"the model `{req.model}` does not exist; this server serves `{served_name}`",
                       param="model", code="model_not_found")


# vLLM's request extensions neuron does not implement (SamplingRequest names them to refuse them).
_NOT_IMPLEMENTED = ("structural_tag", "guided_whitespace_pattern", "guided_decoding_backend", "logits_processors",
                    "mm_processor_kwargs", "kv_transfer_params", "vllm_xargs")


def check_common(req: SamplingRequest) -> None:
    """Refuse what we would otherwise have to ignore."""
    n = 1 if req.n is None else req.n
    for name in _NOT_IMPLEMENTED:
        if getattr(req, name) is not None:
            raise unsupported(name, f"{name} is not supported by this server")
    if req.priority != 0:
        raise bad_request(f"priority must be 0, got {req.priority}: this server schedules requests first come, "
                          "first served", param="priority")
    if req.stream and req.best_of is not None and req.best_of > n:
        raise unsupported("best_of", "best_of > n cannot be streamed: which samples are the best is known only "
                                     "when all have finished")


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias (token ids as the JSON object's keys) as SamplingParams takes it, each
    bias clamped to [-100, 100] as vLLM clamps it."""
    if not bias:
        return None
    lo, hi = LOGIT_BIAS_RANGE
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(f"logit_bias's keys must be token ids, got {key!r:.40}", param="logit_bias") from None
        out[token] = min(hi, max(lo, value))
    return out


def request_salt(req: SamplingRequest | EmbeddingRequest, isolation: str, presented_key: str) -> str | None:
    """The cache salt every sequence of the request carries (its prompts' and samples', which so
    share one prefill), by --prefix-cache-isolation: `none`, the request's own `cache_salt`; `api-key`,
    a digest of the key the client presented (`presented_key`) with its `cache_salt`, so that
    clients with different keys share nothing; `salt`, its `cache_salt`, or without one a salt of
    its own that no other request has."""
    try:
        check_cache_salt(req.cache_salt)
    except RequestError as exc:
        raise bad_request(str(exc), param="cache_salt") from None
    if isolation == "api-key":  # JSON keeps the pair unambiguous whatever the two strings hold
        return hashlib.sha256(msgspec.json.encode([presented_key, req.cache_salt])).hexdigest()
    if isolation == "salt" and req.cache_salt is None:
        return secrets.token_hex(16)
    return req.cache_salt


def check_ready(engine: AsyncEngine) -> None:
    """Nothing when the model is ready to serve; else the 503 that says why not."""
    if engine.state is not EngineState.READY or not engine.loaded:
        raise _not_ready(NotReady(engine.state, engine.error))


def check_serves(engine: AsyncEngine, task: str) -> None:
    """`check_ready`, then a 400 when the model is not served for `task` (engine/pooling.py:
    "generate" for chat and completions, "embed" for embeddings, "classify" for /classify),
    saying how to serve it so."""
    check_ready(engine)
    if task in engine.tasks:
        return
    code = {GENERATE: "model_not_generative", EMBED: "model_not_embedding"}.get(task, "model_not_classifier")
    if CLASSIFY in engine.tasks:
        raise bad_request(f"model `{engine.model_name}` is a classification model: it serves /classify, and /score "
                          f"and /rerank as a cross-encoder, not {_ROUTES[task]}", param="model", code=code)
    if task == CLASSIFY:
        raise bad_request(f"model `{engine.model_name}` is not a classification model: /classify needs a "
                          "*ForSequenceClassification checkpoint, or --task classify with classifier_from_token in "
                          "--hf-overrides", param="model", code=code)
    if task == GENERATE:
        both = "an encoder, it generates nothing" if engine.encoder else \
            "serve it with --task generate,embed to allow both"
        raise bad_request(f"model `{engine.model_name}` is an embedding model: it serves /v1/embeddings only, not "
                          f"chat or completions ({both})", param="model", code=code)
    raise bad_request(f"model `{engine.model_name}` is a generation model: it does not serve /v1/embeddings (serve "
                      "an embedding model, or this one with --task embed or --task generate,embed)",
                      param="model", code=code)


_ROUTES = {GENERATE: "chat or completions", EMBED: "/v1/embeddings"}


def _not_ready(exc: NotReady) -> APIError:
    if exc.state is EngineState.SHUTTING_DOWN:  # the server, not the model: another replica can answer
        return unavailable(str(exc), code="shutting_down")
    retry = _RETRY_AFTER_S if exc.state in (EngineState.LOADING, EngineState.RECOVERING) else None
    return unavailable(str(exc), code=f"model_{exc.state.value}", retry_after_s=retry)


def stream_error(stream: RequestStream, error: str | None) -> APIError:
    """Why a request ended early: cut short by a failing rank (the server recovers by itself, so a
    retry helps), cancelled by the server shutting down, or a bug (see the server log)."""
    if stream.failure_kind == "shutting_down":
        return unavailable(error or "the server is shutting down", code="shutting_down")
    if stream.failure_kind == "unloaded":  # its model was unloaded while it ran (the admin API)
        return unavailable(error or "the model was unloaded", code="model_unloaded")
    if stream.failure_kind == "internal_error":
        return internal(f"generation failed: {error}; see the server log")
    if stream.failure_kind == "invalid_request":  # the request's own limits left nothing to sample
        return bad_request(error or "the request cannot be completed", code="invalid_request")
    return generation_failed(error)


def sampling_params(req: SamplingRequest, defaults: dict, *, max_tokens: int | None, logprobs: int | None,
                    renames: dict[str, str]) -> SamplingParams:
    """Request values, else generation_config's, else OpenAI's; bad values become a 400 naming the
    field. `max_tokens` None (the request is silent) takes generation_config's max_new_tokens."""

    def pick(name):
        value = getattr(req, name)
        return value if value is not None else defaults.get(name, _OPENAI_DEFAULTS[name])

    lo, hi = REPETITION_PENALTY_RANGE
    if req.repetition_penalty is not None and not lo <= req.repetition_penalty <= hi:
        raise bad_request(f"repetition_penalty must be in [{lo}, {hi}], got {req.repetition_penalty!r}",
                          param="repetition_penalty")
    try:
        return SamplingParams(
            **{name: pick(name) for name in _OPENAI_DEFAULTS},
            n=1 if req.n is None else req.n, best_of=req.best_of,
            seed=req.seed, max_tokens=defaults.get("max_tokens") if max_tokens is None else max_tokens,
            repetition_window=req.repetition_window,
            min_tokens=req.min_tokens, stop=req.stop,
            stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos, logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens, include_stop_str_in_output=req.include_stop_str_in_output,
            spaces_between_special_tokens=req.spaces_between_special_tokens,
            logit_bias=_logit_bias(req.logit_bias), allowed_token_ids=req.allowed_token_ids, bad_words=req.bad_words,
            truncate_prompt_tokens=req.truncate_prompt_tokens,
        )
    except InvalidParams as exc:
        param = renames.get(exc.param, exc.param)
        raise bad_request(str(exc).replace(exc.param, param, 1), param=param) from None


def truncated(engine: AsyncEngine, prompt_ids: list[int], keep: int | None,
              images: list[ImageInput] | None = None) -> list[int]:
    """The prompt's last `keep` tokens (truncate_prompt_tokens), or a 400 naming the field."""
    if keep is None:
        return prompt_ids
    try:
        return engine.truncated(prompt_ids, keep, images)
    except RequestError as exc:
        raise bad_request(str(exc), param=exc.param) from None


def open_stream(engine: AsyncEngine, request_id: str, prompt_ids: list[int], params: SamplingParams,
                prompt_param: str, images: list[ImageInput] | None = None, count_prompt: bool = True,
                grammar: CompiledGrammar | None = None, cache_salt: str | None = None) -> RequestStream:
    return admitted(lambda: engine.open(request_id, prompt_ids, params, images, count_prompt, grammar, cache_salt),
                    prompt_param)


def admitted(open_request: Callable[[], RequestStream], prompt_param: str) -> RequestStream:
    """The stream `open_request()` opens; the engine's refusals as the API's errors (503 not ready
    or full, 400 for a request it cannot run, naming `prompt_param` for the prompt)."""
    try:
        return open_request()
    except NotReady as exc:
        raise _not_ready(exc) from None
    except Overloaded as exc:
        raise unavailable(f"the server is overloaded ({exc}); retry shortly", code="overloaded",
                          retry_after_s=_RETRY_AFTER_S) from None
    except RequestError as exc:
        raise _refused(exc, prompt_param) from None


def _refused(exc: RequestError, prompt_param: str) -> APIError:
    param = prompt_param if exc.param in ("prompt", "messages") else exc.param
    return bad_request(str(exc), param=param, code=exc.code)


class Samples:
    """The engine requests behind one API request: the samples of each prompt, prompt by prompt
    (stream p * per_prompt + i is sample i of prompt p)."""

    def __init__(self, streams: list[RequestStream], prompt_lens: list[int], n: int):
        self.streams = streams
        self.prompt_lens = prompt_lens
        self.n = n
        self.per_prompt = len(streams) // len(prompt_lens)

    def close(self) -> None:
        for stream in self.streams:
            stream.close()

    def chosen(self, cumulative: list[float]) -> list[int]:
        """The streams to return, in choice order (choice p * n + i is prompt p's i-th): n per prompt,
        the best by cumulative logprob where more were sampled."""
        out = []
        for base in range(0, len(self.streams), self.per_prompt):
            out += [base + k for k in ranked(cumulative[base : base + self.per_prompt], self.n)]
        return out

    def running_usage(self, options) -> Callable[[int, Update | None], UsageInfo] | None:
        """vLLM's continuous_usage_stats (`options`, the request's stream_options): the usage of
        stream k with an update of it counted (None: before any), its prompt's tokens and the tokens
        streamed for it so far; None where the request did not ask for it."""
        if not (options and options.include_usage and options.continuous_usage_stats):
            return None
        counts = [0] * len(self.streams)

        def usage(k: int, update: Update | None) -> UsageInfo:
            counts[k] += len(update.token_ids) if update is not None else 0
            prompt = self.prompt_lens[k // self.per_prompt]
            return UsageInfo(prompt, counts[k], prompt + counts[k])

        return usage

    def usage(self, returned: list[int] | range) -> UsageInfo:
        """Each prompt's tokens once and the tokens of the choices returned, as vLLM counts them
        (OpenAI bills the best_of samples it drops as well)."""
        prompt = sum(self.prompt_lens)
        completion = sum(self.streams[k].num_output_tokens for k in returned)
        return UsageInfo(prompt, completion, prompt + completion)


class StreamedIds:
    """vLLM's return_token_ids on a stream: each chunk's token ids, those of updates that made no
    chunk (text held back) carried to the next one; and whether a choice's first chunk is still to go."""

    def __init__(self, count: int):
        self._held: list[list[int]] = [[] for _ in range(count)]
        self._started: set[int] = set()

    def hold(self, k: int, update: Update) -> None:
        self._held[k] += update.token_ids

    def take(self, k: int) -> tuple[list[int], bool]:
        """Choice k's ids since its last chunk, and whether this is its first chunk."""
        ids, self._held[k] = self._held[k], []
        first = k not in self._started
        self._started.add(k)
        return ids, first


def check_sequences(engine: AsyncEngine, num_prompts: int, params: SamplingParams) -> None:
    """Refuse, before any prompt is tokenized, a request for more sequences than one request may
    hold: `n` (or `best_of`) up to the running slots, and all its prompts' samples together up to
    `max_per_request`, so other clients always find a place."""
    per_prompt = num_samples(params)
    param = "best_of" if params.best_of else "n"
    if per_prompt > engine.max_running:
        raise bad_request(f"{param} is {per_prompt}; this server runs at most {engine.max_running} sequences at "
                          "once (--max-num-seqs)", param=param)
    total = num_prompts * per_prompt
    if total > engine.max_per_request:
        raise bad_request(f"the request asks for {total} sequences ({num_prompts} prompt(s) x {per_prompt} "
                          f"sample(s)); one request may hold at most {engine.max_per_request} of this server's "
                          f"{engine.capacity} places", param="prompt" if per_prompt == 1 else param)


def check_prompt_logprobs(prompts: list[list[int]], params: SamplingParams) -> None:
    """Refuse a request whose prompt log-probabilities would exceed `max_prompt_logprobs` entries
    (prompts x samples x tokens x (top-k + 1)), before any of them is computed."""
    if params.prompt_logprobs is None:
        return
    budget = settings().max_prompt_logprobs
    entries = sum(map(len, prompts)) * num_samples(params) * (params.prompt_logprobs + 1)
    if entries > budget:
        raise bad_request(f"the request asks for {entries} prompt log-probabilities (prompt tokens x samples x "
                          f"(top-k + 1)); at most {budget} are returned per request (NEURON_MAX_PROMPT_LOGPROBS): "
                          "ask for fewer samples, a smaller top-k or a shorter prompt", param="prompt_logprobs")


def _openai_error_event(error: APIError) -> bytes:
    return sse(error.body())


async def stream_events(samples: Samples, keepalive_s: float,
                        chunks: Callable[[int, Update], Awaitable[list[bytes]]],
                        usage: Callable[[UsageInfo], bytes] | None, opening: Sequence[bytes] = (), *,
                        keepalive: bytes = KEEPALIVE, error_event: Callable[[APIError], bytes] = _openai_error_event,
                        done: bytes = DONE) -> AsyncIterator[bytes]:
    """The SSE body of every generating endpoint: `opening`, then for each batch of updates the
    chunks they make (`chunks(choice, update)`, one write per batch), `keepalive` whenever
    `keepalive_s` passes with nothing, an error event (and the end) when a sample fails, the usage
    chunk when the request asked for it, and `done`. OpenAI's comment, error chunk and `[DONE]`
    unless the API says otherwise. The samples are closed however it ends."""
    try:
        for chunk in opening:
            yield chunk
        async for batch in merged_updates(samples.streams, keepalive_s):
            if batch is None:
                yield keepalive
                continue
            out: list[bytes] = []
            for k, update in batch:
                if update.finish_reason == "error":
                    if samples.streams[k].failure_kind == "unloaded":  # cut by an unload: its choice aborts
                        out += await chunks(k, dataclasses.replace(update, finish_reason="abort", error=None))
                    yield b"".join(out) + error_event(stream_error(samples.streams[k], update.error))
                    return
                out += await chunks(k, update)
            if out:
                yield b"".join(out)  # one write for what the batch brought
        if usage is not None:
            yield usage(samples.usage(range(len(samples.streams))))
        if done:
            yield done
    finally:
        samples.close()


def open_samples(engine: AsyncEngine, request_id: str, prompts: list[list[int]], params: SamplingParams,
                 prompt_param: str, images: list[ImageInput] | None = None,
                 grammar: CompiledGrammar | None = None, cache_salt: str | None = None) -> Samples:
    """Queue the samples of every prompt, all with the request's `cache_salt`, or none of them:
    every prompt is validated before any is queued, and samples already opened when one is refused
    (the server full) are aborted."""
    check_sequences(engine, len(prompts), params)
    check_prompt_logprobs(prompts, params)
    total = len(prompts) * num_samples(params)
    children = sample_params(params)
    if total > 1:
        for ids in prompts:
            try:
                engine.validate(ids, children[0], images)
            except RequestError as exc:
                raise _refused(exc, prompt_param) from None
    streams: list[RequestStream] = []
    try:
        for ids in prompts:
            for i, child in enumerate(children):
                rid = sample_id(request_id, len(streams), total)
                streams.append(open_stream(engine, rid, ids, child, prompt_param, images, i == 0, grammar,
                                           cache_salt))
    except BaseException:
        for stream in streams:
            stream.close()
        raise
    return Samples(streams, [len(ids) for ids in prompts], params.n)
