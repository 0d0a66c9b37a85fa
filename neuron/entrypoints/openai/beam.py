"""vLLM's `use_beam_search` on /v1/completions and /v1/chat/completions: the `n` best beams
(engine/beam_search.py), each step's beams run on the engine as requests of one token each.

Beam search takes the fields that shape it (`n` beams, `max_tokens`, `temperature`,
`length_penalty`, `ignore_eos`, `include_stop_str_in_output`) and those that shape the prompt; any
other sampling field set is refused by name rather than ignored, and so is `stream`.
"""

from __future__ import annotations

import msgspec

from neuron.engine.async_engine import AsyncEngine, RequestStream
from neuron.engine.beam_search import BeamSearch, BeamSearchParams, BeamSearchSequence
from neuron.engine.parallel_sampling import sample_id
from neuron.engine.sampling_params import InvalidParams, SamplingParams, check_truncation
from neuron.entrypoints.openai.api_errors import bad_request, internal
from neuron.entrypoints.openai.api_types import SamplingRequest, UsageInfo
from neuron.entrypoints.openai.common import check_sequences, open_stream, stream_error

# What a beam search request may set besides its prompt: the rest must keep their defaults.
_TAKEN = frozenset({
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "n", "temperature", "length_penalty",
    "ignore_eos", "include_stop_str_in_output", "use_beam_search", "cache_salt", "truncate_prompt_tokens",
    "skip_special_tokens", "spaces_between_special_tokens", "chat_template_kwargs", "add_generation_prompt",
    "continue_final_message", "echo", "stream_options", "return_tokens_as_token_ids", "parallel_tool_calls",
    "tool_choice", "add_special_tokens", "documents",
})


def beam_params(req: SamplingRequest, max_tokens: int) -> BeamSearchParams:
    """The request's beam search, or a 400 naming a field it cannot take. Its steps are greedy
    unless it sets a temperature (the beams extend by the top log-probabilities either way)."""
    for f in msgspec.structs.fields(type(req)):
        if f.name not in _TAKEN and getattr(req, f.name) != f.default:
            raise bad_request(f"use_beam_search does not take {f.name}; beam search takes n (the beams), max_tokens, "
                              "temperature, length_penalty, ignore_eos and include_stop_str_in_output", param=f.name)
    if getattr(req, "tool_choice", None) not in (None, "none", "auto"):
        raise bad_request("use_beam_search does not take tool_choice", param="tool_choice")
    try:
        check_truncation(req.truncate_prompt_tokens)
        return BeamSearchParams(beam_width=1 if req.n is None else req.n, max_tokens=max_tokens,
                                ignore_eos=req.ignore_eos, temperature=req.temperature or 0.0,
                                length_penalty=req.length_penalty,
                                include_stop_str_in_output=req.include_stop_str_in_output)
    except InvalidParams as exc:
        param = "n" if exc.param == "beam_width" else exc.param
        raise bad_request(str(exc).replace(exc.param, param, 1), param=param) from None


def check_beams(engine: AsyncEngine, num_prompts: int, params: BeamSearchParams) -> None:
    """Every prompt's beams run at once: as many places as `n` samples of each would take."""
    check_sequences(engine, num_prompts, SamplingParams(n=params.beam_width))


class BeamRun:
    """The engine requests of a beam search's current step, closed however the search ends."""

    def __init__(self):
        self.streams: list[RequestStream] = []

    def close(self) -> None:
        for stream in self.streams:
            stream.close()
        self.streams = []


async def run_beams(engine: AsyncEngine, request_id: str, prompts: list[list[int]], params: BeamSearchParams,
                    run: BeamRun, cache_salt: str | None, prompt_param: str) -> list[BeamSearch]:
    """Every prompt's search, run to its end: a step opens one request per live beam, all of them
    at once, and reads each one's token and top log-probabilities."""
    searches = [BeamSearch(ids, params, engine.eos_token_ids, engine.max_model_len) for ids in prompts]
    step_params = params.step_params()
    step = 0
    while live := [s for s in searches if not s.done]:
        beams = [(s, beam) for s in live for beam in s.beams]
        try:
            for k, (_, beam) in enumerate(beams):
                rid = sample_id(f"{request_id}-{step}", k, len(beams))
                run.streams.append(open_stream(engine, rid, beam.tokens, step_params, prompt_param,
                                               count_prompt=step == 0, cache_salt=cache_salt))
            tops = [await _top_logprobs(stream) for stream in run.streams]
        finally:
            run.close()
        for s in live:
            s.advance([top for (owner, _), top in zip(beams, tops) if owner is s])
        step += 1
    return searches


async def _top_logprobs(stream: RequestStream) -> dict[int, float]:
    last = None
    async for update in stream:
        last = update
    if last is None or last.finish_reason == "error":
        raise stream_error(stream, last.error if last is not None else None)
    if not last.logprobs:
        raise internal("a beam search step came back without its log-probabilities; see the server log")
    return last.logprobs[0]


def best_beams(engine: AsyncEngine, searches: list[BeamSearch],
               skip_special_tokens: bool) -> tuple[list[tuple[BeamSearchSequence, str]], UsageInfo]:
    """Each prompt's best beams, in choice order, with their text; and the usage (each prompt once,
    the returned beams' tokens)."""
    out, completion = [], 0
    tok = engine.tokenizer
    for s in searches:
        for beam in s.best():
            out.append((beam, tok.decode(s.output_ids(beam), skip_special_tokens) if tok is not None else ""))
            completion += len(beam.tokens) - s.prompt_len
    prompt = sum(s.prompt_len for s in searches)
    return out, UsageInfo(prompt, completion, prompt + completion)
