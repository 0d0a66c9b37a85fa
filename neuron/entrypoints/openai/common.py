"""What the chat and completions endpoints share: model check, sampling params, admission, usage."""

from __future__ import annotations

import time
import uuid

import msgspec

from neuron.engine.async_engine import AsyncEngine, EngineState, NotReady, Overloaded, RequestStream
from neuron.engine.llm_engine import RequestError
from neuron.engine.sampling import InvalidParams, SamplingParams
from neuron.entrypoints.openai.api_errors import (
    APIError,
    bad_request,
    generation_failed,
    internal,
    unavailable,
    unsupported,
)
from neuron.entrypoints.openai.api_types import SamplingRequest, UsageInfo
from neuron.multimodal.image import ImageInput

# OpenAI's defaults, used where neither the request nor generation_config.json says otherwise.
_OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "presence_penalty": 0.0,
                    "frequency_penalty": 0.0, "repetition_penalty": 1.0}
_RETRY_AFTER_S = 1


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def sse(obj) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


def check_model(req: SamplingRequest, served_name: str) -> None:
    if not req.model:
        raise bad_request("you must provide a model parameter", param="model")
    if req.model != served_name:
        raise APIError(404, f"the model `{req.model}` does not exist; this server serves `{served_name}`",
                       param="model", code="model_not_found")


def check_common(req: SamplingRequest) -> None:
    """Refuse what we would otherwise have to ignore."""
    if req.n is not None and req.n < 1:
        raise bad_request(f"n must be 1 (one completion per request), got {req.n}", param="n")
    if req.n not in (None, 1):
        raise unsupported("n", "n > 1 is not supported; send one request per completion")
    if req.logit_bias:
        raise unsupported("logit_bias", "logit_bias is not supported")


def ready_engine(engine: AsyncEngine):
    """The loaded engine, or the 503 that says why there is none."""
    if engine.state is not EngineState.READY or engine.engine is None:
        raise _not_ready(NotReady(engine.state, engine.error))
    return engine.engine


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
    if stream.failure_kind == "internal_error":
        return internal(f"generation failed: {error}; see the server log")
    if stream.failure_kind == "invalid_request":  # the request's own limits left nothing to sample
        return bad_request(error or "the request cannot be completed", code="invalid_request")
    return generation_failed(error)


# A penalty this far from 1 means nothing more than greedy does, while smaller ones overflow float32
# logits into NaN probabilities, which no request should be able to cause.
_REPETITION_PENALTY_RANGE = (0.01, 100.0)


def sampling_params(req: SamplingRequest, defaults: dict, *, max_tokens: int | None, logprobs: int | None,
                    renames: dict[str, str]) -> SamplingParams:
    """Request values, else generation_config's, else OpenAI's; bad values become a 400 naming the field."""

    def pick(name):
        value = getattr(req, name)
        return value if value is not None else defaults.get(name, _OPENAI_DEFAULTS[name])

    lo, hi = _REPETITION_PENALTY_RANGE
    if req.repetition_penalty is not None and not lo <= req.repetition_penalty <= hi:
        raise bad_request(f"repetition_penalty must be in [{lo}, {hi}], got {req.repetition_penalty!r}",
                          param="repetition_penalty")
    try:
        return SamplingParams(
            **{name: pick(name) for name in _OPENAI_DEFAULTS},
            seed=req.seed, max_tokens=max_tokens, min_tokens=req.min_tokens, stop=req.stop,
            stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos, logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens,
        )
    except InvalidParams as exc:
        param = renames.get(exc.param, exc.param)
        raise bad_request(str(exc).replace(exc.param, param, 1), param=param) from None


def open_stream(engine: AsyncEngine, request_id: str, prompt_ids: list[int], params: SamplingParams,
                prompt_param: str, images: list[ImageInput] | None = None) -> RequestStream:
    try:
        return engine.open(request_id, prompt_ids, params, images)
    except NotReady as exc:
        raise _not_ready(exc) from None
    except Overloaded as exc:
        raise unavailable(f"the server is overloaded ({exc}); retry shortly", code="overloaded",
                          retry_after_s=_RETRY_AFTER_S) from None
    except RequestError as exc:
        param = prompt_param if exc.param in ("prompt", "messages") else exc.param
        raise bad_request(str(exc), param=param, code=exc.code) from None


def usage(stream: RequestStream) -> UsageInfo:
    n_out = stream.num_output_tokens
    return UsageInfo(stream.num_prompt_tokens, n_out, stream.num_prompt_tokens + n_out)

