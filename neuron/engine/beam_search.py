"""Beam search, as vLLM runs it: on top of the engine, a step of one token per beam.

Each step asks the engine for one token of every live beam with its top 2 x beam_width
log-probabilities (the prefix cache keeps each beam's prompt from being computed again), extends
each beam by each of those tokens, and keeps the beam_width best extensions by cumulative
log-probability. An extension that ends in an EOS token is complete and leaves the search. At the
end the complete beams and the live ones are ranked by their cumulative log-probability divided by
their generated length to the power `length_penalty` (transformers' normalisation), and the
beam_width best are returned.

`BeamSearch` is the search's state, driven by a caller that runs the steps: the offline API
(`LLM.beam_search`) and the server (`use_beam_search`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from neuron.engine.sampling_params import MAX_LOGPROBS, InvalidParams, SamplingParams

MAX_BEAM_WIDTH = MAX_LOGPROBS // 2  # each step reads 2 x beam_width log-probabilities per beam


@dataclass(frozen=True, slots=True)
class BeamSearchParams:
    """vLLM's BeamSearchParams: `beam_width` beams, each up to `max_tokens` tokens."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0  # the step's draw; its top log-probabilities are what the beams extend by
    length_penalty: float = 1.0  # the ranking divides by the generated length to this power
    include_stop_str_in_output: bool = False  # the EOS token that ends a beam stays in its text

    def __post_init__(self) -> None:
        _require(isinstance(self.beam_width, int) and not isinstance(self.beam_width, bool)
                 and 1 <= self.beam_width <= MAX_BEAM_WIDTH, "beam_width",
                 f"an integer in [1, {MAX_BEAM_WIDTH}]", self.beam_width)
        _require(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", "an integer >= 1",
                 self.max_tokens)
        _require(_number(self.temperature) and self.temperature >= 0, "temperature", ">= 0", self.temperature)
        _require(_number(self.length_penalty) and math.isfinite(self.length_penalty), "length_penalty",
                 "a finite number", self.length_penalty)

    def step_params(self) -> SamplingParams:
        """What one step asks of each beam: a token and the top 2 x beam_width log-probabilities."""
        return SamplingParams(temperature=self.temperature, max_tokens=1, logprobs=2 * self.beam_width,
                              ignore_eos=True, skip_special_tokens=False)


@dataclass(slots=True)
class BeamSearchSequence:
    """One beam: `tokens` its prompt's and its own, `logprobs` per generated token the step's top
    log-probabilities, `cum_logprob` the sum of its tokens'."""

    tokens: list[int]
    logprobs: list[dict[int, float]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (an EOS token) or "length"
    stop_reason: int | None = None  # the EOS token that ended it


@dataclass(slots=True)
class BeamSearchOutput:
    """vLLM's: the best beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


class BeamSearch:
    """The search of one prompt."""

    def __init__(self, prompt_ids: list[int], params: BeamSearchParams, eos_token_ids, max_model_len: int):
        self.params, self.prompt_len = params, len(prompt_ids)
        self.eos = frozenset(() if params.ignore_eos else eos_token_ids)
        # the last step leaves room for the beam's last token within the context
        self.steps_left = min(params.max_tokens, max_model_len - len(prompt_ids))
        self.beams = [BeamSearchSequence(list(prompt_ids))]
        self.completed: list[BeamSearchSequence] = []

    @property
    def done(self) -> bool:
        return self.steps_left <= 0 or not self.beams

    def advance(self, top: list[dict[int, float]]) -> None:
        """One step: `top[i]` the top log-probabilities after beam i's tokens."""
        candidates = []
        for beam, logprobs in zip(self.beams, top, strict=True):
            for token, logprob in logprobs.items():
                grown = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [logprobs],
                                           beam.cum_logprob + logprob)
                if token in self.eos:
                    grown.finish_reason, grown.stop_reason = "stop", token
                    self.completed.append(grown)
                else:
                    candidates.append(grown)
        candidates.sort(key=lambda b: b.cum_logprob, reverse=True)
        self.beams = candidates[: self.params.beam_width]
        self.steps_left -= 1

    def best(self) -> list[BeamSearchSequence]:
        """The beam_width best beams, complete and live together, best first."""
        for beam in self.beams:
            beam.finish_reason = "length"
        ranked = sorted(self.completed + self.beams, key=self.rank, reverse=True)
        return ranked[: self.params.beam_width]

    def rank(self, beam: BeamSearchSequence) -> float:
        """What orders the beams as their score, cum_logprob / generated ** length_penalty, orders
        them (higher is better), taken in logarithms: a score is never positive, and the power
        overflows a float where the logarithm does not."""
        if beam.cum_logprob >= 0:
            return math.inf
        generated = max(len(beam.tokens) - self.prompt_len, 1)
        return self.params.length_penalty * math.log(generated) - math.log(-beam.cum_logprob)

    def output_ids(self, beam: BeamSearchSequence) -> list[int]:
        """The beam's generated tokens, without the EOS that ended it unless asked for."""
        ids = beam.tokens[self.prompt_len:]
        return ids if beam.stop_reason is None or self.params.include_stop_str_in_output else ids[:-1]


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _require(ok: bool, param: str, allowed: str, value) -> None:
    if not ok:
        raise InvalidParams(param, f"{param} must be {allowed}, got {value!r}")
