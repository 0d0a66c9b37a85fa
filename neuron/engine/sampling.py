"""Choosing the next token of every sequence in a batched step, from rank-0 logits.

Order of operations (vLLM / Hugging Face): min_tokens masks EOS and stop ids, then the
repetition, frequency and presence penalties, then the structured-output grammar's mask, then
greedy argmax or temperature, top_k, top_p, min_p and a draw: the unseeded rows of the batch
together from the global generator, a seeded row from its own. Logprobs are always those of the
raw logits.

Everything runs on the logits' device; what the host needs (the chosen ids and the logprobs asked
for) comes back in one transfer per step, so on CUDA the host waits once. Only a failed row costs
more: finding why it failed reads its logits again.

A row with no token left to pick (every logit -inf, or a NaN) never reaches argmax or the draw:
it is reported as failed, with the reason, and the other rows are sampled as if it were not there.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from neuron.utils.device import to_device

if TYPE_CHECKING:
    from neuron.engine.structured_output import CompiledGrammar, GuidedDecodingParams, TokenBitmask

MAX_LOGPROBS = 20
# Stop conditions a request may set. Each generated token is checked against all of them on the
# engine thread, which every other request waits for, so their number is bounded.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024  # per stop string
MAX_STOP_TOKEN_IDS = 4096

# Dividing by a temperature this small overflows float32; the result would be argmax anyway.
_GREEDY_BELOW = 1e-5

# torch.Generator.manual_seed accepts exactly this range.
_SEED_RANGE = (-(2**63), 2**64 - 1)


class InvalidParams(ValueError):
    """A sampling parameter is out of range; `param` names it for the HTTP 400 body."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _check(ok: bool, param: str, allowed: str, value: object) -> None:
    if not ok:
        raise InvalidParams(param, f"{param} must be {allowed}, got {value!r}")


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling settings, named and defaulted as in vLLM."""

    n: int = 1  # samples returned
    best_of: int | None = None  # samples generated, the n with the highest cumulative logprob returned; None: n
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # the prompt tokens' own logprobs and this many top-k at each
    skip_special_tokens: bool = True
    # Structured output: what the text must match. The server hands the engine the grammar it
    # already compiled (off the event loop); a GuidedDecodingParams is compiled when the request is added.
    guided_decoding: GuidedDecodingParams | CompiledGrammar | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self._check_stop_sizes()  # before anything walks the lists
        if self.stop_token_ids is not None:
            self.stop_token_ids = token_ids(self.stop_token_ids, "stop_token_ids")
        self._check_sampling()
        self._check_penalties()
        self._check_lengths()
        self._check_outputs()

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_BELOW or self.top_k == 1

    @property
    def penalised(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def _check_sampling(self) -> None:
        # Each check is a comparison NaN fails, so NaN is rejected too.
        _check(self.n >= 1, "n", ">= 1", self.n)
        if self.best_of is not None:
            _check(self.best_of >= self.n, "best_of", f">= n ({self.n}) or null", self.best_of)
        _check(self.temperature >= 0, "temperature", ">= 0", self.temperature)
        _check(0 < self.top_p <= 1, "top_p", "in (0, 1]", self.top_p)
        top_k_ok = self.top_k in (0, -1) or self.top_k >= 1
        _check(top_k_ok, "top_k", "0 or -1 (disabled) or >= 1", self.top_k)
        _check(0 <= self.min_p <= 1, "min_p", "in [0, 1]", self.min_p)
        if self.seed is not None:
            lo, hi = _SEED_RANGE
            _check(lo <= self.seed <= hi, "seed", f"in [{lo}, {hi}]", self.seed)

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2 <= value <= 2, name, "in [-2, 2]", value)
        _check(self.repetition_penalty > 0, "repetition_penalty", "> 0", self.repetition_penalty)

    def _check_lengths(self) -> None:
        _check(self.min_tokens >= 0, "min_tokens", ">= 0", self.min_tokens)
        if self.max_tokens is None:
            return
        # 0: score the prompt only (prompt_logprobs, echo) and end after its prefill
        _check(self.max_tokens >= 0, "max_tokens", ">= 0 or null", self.max_tokens)
        cap = f"<= max_tokens ({self.max_tokens})"
        _check(self.min_tokens <= self.max_tokens, "min_tokens", cap, self.min_tokens)

    def _check_stop_sizes(self) -> None:
        if self.stop is not None:
            _check(isinstance(self.stop, (list, tuple)), "stop", "a string or a list of strings", _shown(self.stop))
            if len(self.stop) > MAX_STOP_STRINGS:
                raise InvalidParams("stop", f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        if self.stop_token_ids is not None:
            count = len(self.stop_token_ids) if hasattr(self.stop_token_ids, "__len__") else None
            if count is None or count > MAX_STOP_TOKEN_IDS:
                got = f"{count} ids" if count is not None else _shown(self.stop_token_ids)
                raise InvalidParams("stop_token_ids", f"stop_token_ids must be a list of at most {MAX_STOP_TOKEN_IDS} "
                                                      f"token ids, got {got}")

    def _check_outputs(self) -> None:
        if self.stop is not None:
            stop_ok = all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in self.stop)
            _check(stop_ok, "stop", f"a list of non-empty strings of at most {MAX_STOP_CHARS} characters",
                   _shown(self.stop))
        if self.stop_token_ids is not None:
            ids_ok = all(t >= 0 for t in self.stop_token_ids)
            _check(ids_ok, "stop_token_ids", "a list of ids >= 0", _shown(self.stop_token_ids))
        if self.logprobs is not None:
            allowed = f"in [0, {MAX_LOGPROBS}] or null"
            _check(0 <= self.logprobs <= MAX_LOGPROBS, "logprobs", allowed, self.logprobs)
        if self.prompt_logprobs is not None:
            allowed = f"in [0, {MAX_LOGPROBS}] or null"
            _check(0 <= self.prompt_logprobs <= MAX_LOGPROBS, "prompt_logprobs", allowed, self.prompt_logprobs)


def token_ids(values, param: str) -> list[int]:
    """`values` as a list of ints, taking what Python counts as an integer (`operator.index`: ints,
    numpy integers) and nothing else: not floats, even whole ones, not bools, not strings."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise InvalidParams(param, f"{param} must be a list of token ids (integers), got {_shown(values)}")
    out = []
    for i, value in enumerate(values):
        if isinstance(value, bool):
            raise InvalidParams(param, f"{param}[{i}] must be a token id (an integer), got {value!r}")
        try:
            out.append(operator.index(value))
        except TypeError:
            raise InvalidParams(param, f"{param}[{i}] must be a token id (an integer), got {_shown(value)}") from None
    return out


def _shown(value, limit: int = 80) -> str:
    """repr of a client's value, cut short: an error message never echoes a megabyte."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


class SequenceSampler:
    """What one generated sequence needs at each step: its params, penalty counts, generator."""

    __slots__ = ("params", "vocab_size", "output_token_ids", "generator", "_prompt_mask", "_counts")

    def __init__(
        self,
        params: SamplingParams,
        prompt_token_ids: list[int],
        vocab_size: int,
        device: str | torch.device = "cpu",
    ):
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.params = params
        self.vocab_size = vocab_size
        self.output_token_ids: list[int] = []
        self.generator = self._seeded_generator(device)
        # Penalty state exists only for sequences that use it: the common case allocates nothing.
        self._prompt_mask: torch.Tensor | None = None
        self._counts: torch.Tensor | None = None
        if params.penalised:
            self._counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        if params.repetition_penalty != 1.0:
            self._prompt_mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            ids = [t for t in prompt_token_ids if 0 <= t < vocab_size]
            self._prompt_mask[to_device(ids, device, torch.long)] = True

    def _seeded_generator(self, device: str | torch.device) -> torch.Generator | None:
        # Unseeded sequences draw from the global RNG; a seeded one owns its stream, so its
        # tokens do not depend on what else shares the batch.
        if self.params.seed is None:
            return None
        return torch.Generator(device=device).manual_seed(self.params.seed)

    def append(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        if self._counts is not None and 0 <= token_id < self.vocab_size:
            self._counts[token_id] += 1

    @property
    def below_min_tokens(self) -> bool:
        return len(self.output_token_ids) < self.params.min_tokens

    @property
    def adjusts_logits(self) -> bool:
        return self.params.penalised or self.below_min_tokens

    @property
    def plain_greedy(self) -> bool:
        """Argmax of the raw logits is the whole answer for this row."""
        return self.params.greedy and self.params.logprobs is None and not self.adjusts_logits

    def adjust(self, row: torch.Tensor, eos_token_ids: Sequence[int]) -> None:
        """Apply min_tokens and the penalties to this sequence's row of logits, in place."""
        if self.below_min_tokens:
            self._block_stops(row, eos_token_ids)
        if self._prompt_mask is not None:
            seen = self._prompt_mask | (self._counts > 0)
            penalty = self.params.repetition_penalty
            row.copy_(torch.where(seen, torch.where(row > 0, row / penalty, row * penalty), row))
            # An extreme penalty overflows to +-inf; +inf would turn the softmax into NaN.
            torch.nan_to_num_(row, nan=float("-inf"), posinf=torch.finfo(row.dtype).max, neginf=float("-inf"))
        p = self.params
        if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
            row -= p.presence_penalty * (self._counts > 0) + p.frequency_penalty * self._counts

    def _block_stops(self, row: torch.Tensor, eos_token_ids: Sequence[int]) -> None:
        ids = [*eos_token_ids, *(self.params.stop_token_ids or ())]
        ids = [t for t in ids if 0 <= t < row.shape[-1]]
        if ids:
            row.index_fill_(0, to_device(ids, row.device, torch.long), float("-inf"))


@dataclass(slots=True, frozen=True)
class SampleFailure:
    """Why a row had no token to sample. `by_request`: the request's own constraints emptied a
    distribution the model gave; otherwise the model's logits were unusable (NaN, all -inf)."""

    message: str
    by_request: bool


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]  # -1 for a failed row
    # Per row: None unless its params ask for logprobs; else the sampled id first, then the top ids.
    logprobs: list[dict[int, float] | None]
    failed: dict[int, SampleFailure] = field(default_factory=dict)  # by row


def sample(
    logits: torch.Tensor, samplers: list[SequenceSampler], eos_token_ids: Sequence[int] = (),
    allowed: TokenBitmask | None = None,
) -> SampleResult:
    """Pick one token per row of `logits` ([B, V]); does not modify `logits`. `allowed`: the
    tokens the rows with a grammar may take (structured output)."""
    if logits.dim() != 2 or logits.shape[0] != len(samplers):
        raise ValueError(
            f"logits must be [{len(samplers)}, V] (one row per sampler), got {list(logits.shape)}"
        )
    if allowed is None and all(s.plain_greedy for s in samplers):
        (token_ids,) = _to_host(_greedy(logits))
        failed = _failures(logits, token_ids, samplers)
        return SampleResult(token_ids, [None] * len(samplers), failed)
    raw = logits.float()  # rank 0's logits are float32 already, and then this is `logits` itself
    chosen = _choose(_adjusted(raw, samplers, eos_token_ids, allowed), samplers)
    rows = [i for i, s in enumerate(samplers) if s.params.logprobs is not None]
    token_ids, *reported = _to_host(chosen, *_logprob_tensors(raw, chosen, rows, samplers))
    failed = _failures(raw, token_ids, samplers, allowed.rows if allowed is not None else ())
    return SampleResult(token_ids, _logprobs(rows, reported, token_ids, samplers, failed), failed)


def _to_host(*tensors: torch.Tensor) -> list[list]:
    """The step's one device-to-host transfer, of every tensor the host needs. On CUDA each is
    copied into pinned memory without blocking, then the host waits for the stream once."""
    if tensors[0].device.type != "cuda":
        return [t.tolist() for t in tensors]
    buffers = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    for buffer, t in zip(buffers, tensors):
        buffer.copy_(t, non_blocking=True)
    torch.cuda.current_stream(tensors[0].device).synchronize()
    return [b.tolist() for b in buffers]


def _greedy(x: torch.Tensor) -> torch.Tensor:
    """Argmax per row, -1 where no token has a logit above -inf. max() ranks NaN highest, so a
    row holding a NaN fails too instead of picking it."""
    best, ids = x.max(dim=-1)
    return torch.where(best > float("-inf"), ids, -1)


def _failures(
    raw: torch.Tensor, token_ids: list[int], samplers: list[SequenceSampler], constrained: Sequence[int] = ()
) -> dict[int, SampleFailure]:
    if -1 not in token_ids:  # the common case costs one scan of a short list
        return {}
    return {i: _why(raw[i].float(), samplers[i], i in constrained) for i, t in enumerate(token_ids) if t == -1}


def _why(raw_row: torch.Tensor, sampler: SequenceSampler, constrained: bool = False) -> SampleFailure:
    if bool(raw_row.isnan().any()):
        return SampleFailure("no token can be sampled: the model's logits contain NaN", False)
    if not bool((raw_row > float("-inf")).any()):
        return SampleFailure("no token can be sampled: the model gives every token a logit of -inf", False)
    if bool((raw_row == float("inf")).any()):
        return SampleFailure("no token can be sampled: the model's logits contain +inf", False)
    if constrained:
        return SampleFailure("no token can be sampled: the structured output's grammar allows no token that the "
                             "model and min_tokens (which blocks EOS and stop_token_ids) leave", True)
    if sampler.below_min_tokens:
        return SampleFailure(f"no token can be sampled: min_tokens ({sampler.params.min_tokens}) blocks EOS and "
                             "stop_token_ids, and the model allows no other token", True)
    return SampleFailure(
        "no token can be sampled: the penalties and temperature leave every token with probability zero", True)


def _adjusted(
    raw: torch.Tensor, samplers: list[SequenceSampler], eos_token_ids: Sequence[int],
    allowed: TokenBitmask | None = None,
) -> torch.Tensor:
    rows = [i for i, s in enumerate(samplers) if s.adjusts_logits]
    if not rows and allowed is None:
        return raw
    x = raw.clone()  # logprobs are reported from `raw`, so penalties and masks work on a copy
    for i in rows:
        samplers[i].adjust(x[i], eos_token_ids)
    if allowed is not None:
        allowed.apply(x)
    return x


def _choose(x: torch.Tensor, samplers: list[SequenceSampler]) -> torch.Tensor:
    drawn = [i for i, s in enumerate(samplers) if not s.params.greedy]
    if not drawn:
        return _greedy(x)
    if len(drawn) == len(samplers):
        return _draw(x, samplers)
    chosen = _greedy(x)
    idx = to_device(drawn, x.device, torch.long)
    chosen[idx] = _draw(x[idx], [samplers[i] for i in drawn])
    return chosen


def _draw(x: torch.Tensor, samplers: list[SequenceSampler]) -> torch.Tensor:
    """One draw per row; -1 for a row with nothing to draw from. The unseeded rows draw together
    from the global generator; a seeded row draws again alone, from its own generator."""
    probs, ids, ok = _filtered_probs(x, [s.params for s in samplers])
    picks = _race(probs, ids, torch.empty_like(probs).exponential_())
    for j, s in enumerate(samplers):
        if s.generator is not None:
            picks[j : j + 1] = _seeded_draw(x[j : j + 1], s)
    return torch.where(ok, picks, -1)


def _seeded_draw(row: torch.Tensor, sampler: SequenceSampler) -> torch.Tensor:
    # Over the whole vocabulary in order, the row takes as many numbers from its generator, and
    # the same ones, whatever else shares the batch, so a seed gives the same tokens in any batch:
    # those `torch.multinomial(probs, 1, generator=...)` draws, the same method with its checks.
    probs, ids, _ = _filtered_probs(row, [sampler.params])
    if ids is not None:
        probs = torch.zeros_like(row).scatter_(-1, ids, probs)
    return _race(probs, None, torch.empty_like(probs).exponential_(generator=sampler.generator))


def _race(probs: torch.Tensor, ids: torch.Tensor | None, noise: torch.Tensor) -> torch.Tensor:
    """The token of each row's argmax(probs / noise), noise ~ Exponential(1): column i wins with
    probability probs_i. It is `torch.multinomial`'s own method for one sample, without the
    checks that make it wait for the device. A zero probability scores 0 and never wins; the
    clamp keeps a noise of exactly 0 from making that 0 / 0, a NaN that argmax would rank first.
    Overwrites `noise`."""
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    won = torch.div(probs, noise, out=noise).argmax(dim=-1)
    return won if ids is None else ids.gather(-1, won[:, None]).squeeze(-1)


def _filtered_probs(
    x: torch.Tensor, params: list[SamplingParams]
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The distribution each row draws from: softmax(x / temperature), with the tokens that top_k,
    top_p and min_p drop set to zero. Returns it, the token of each column (None: the vocabulary
    in order) and the rows that have a distribution at all.

    With top_k or top_p the columns are the candidates ranked best first, only the best max(k)
    when every row has a top_k: the draw then spares the rest of the vocabulary. The filters only
    zero entries and never recompute the others, so a row's probabilities do not depend on the
    filters the other rows of the batch ask for."""
    temps = [p.temperature for p in params]
    if any(t != 1.0 for t in temps):  # dividing by 1 changes nothing and costs a pass over [B, V]
        x = x / to_device(temps, x.device, x.dtype)[:, None]
    # A finite maximum is exactly what makes the softmax a distribution (no NaN, not all zero), and
    # the filters always keep the most likely token. Checked on the device, without a transfer. A
    # failed row goes on as NaNs: nothing below checks its values, argmax still names a column,
    # and the caller discards that pick.
    ok = torch.isfinite(x.amax(dim=-1))
    probs = x.softmax(dim=-1)
    vocab = probs.shape[-1]
    ks = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]
    ids = None
    if max(ks) < vocab:  # topk is far cheaper than sorting the whole vocabulary
        probs, ids = probs.topk(max(ks), dim=-1)
    elif min(ks) < vocab or any(p.top_p < 1 for p in params):
        probs, ids = probs.sort(dim=-1, descending=True)
    if ids is not None:
        probs = _top_k_top_p(probs, ks, params)
    if any(p.min_p > 0 for p in params):
        probs = _min_p(probs, params)
    return probs, ids, ok


def _top_k_top_p(ranked: torch.Tensor, ks: list[int], params: list[SamplingParams]) -> torch.Tensor:
    width = ranked.shape[-1]
    if min(ks) < width:
        k = to_device(ks, ranked.device, torch.long)
        ranked = ranked.masked_fill(torch.arange(width, device=ranked.device) >= k[:, None], 0.0)
    if any(p.top_p < 1 for p in params):
        ranked = _top_p_ranked(ranked, params)
    return ranked


def _top_p_ranked(ranked: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Nucleus filter on probabilities sorted high to low, relative to the top_k survivors."""
    cumulative = ranked.cumsum(dim=-1)
    mass_before = cumulative - ranked
    top_ps = to_device([p.top_p for p in params], ranked.device, ranked.dtype)
    budget = top_ps[:, None] * cumulative[:, -1:]
    # A token stays while the mass strictly ahead of it is below the budget, so the first always
    # stays; rows with top_p == 1 are exempt so cumsum rounding cannot trim their tail.
    outside = (mass_before >= budget) & (top_ps < 1)[:, None]
    outside[:, 0] = False  # a top_p that rounds to 0 in float32 would otherwise keep nothing
    return ranked.masked_fill(outside, 0.0)


def _min_p(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    min_ps = to_device([p.min_p for p in params], probs.device, probs.dtype)
    floor = min_ps[:, None] * probs.max(dim=-1, keepdim=True).values
    return probs.masked_fill(probs < floor, 0.0)


def _logprob_tensors(
    raw: torch.Tensor, chosen: torch.Tensor, rows: list[int], samplers: list[SequenceSampler]
) -> tuple[torch.Tensor, ...]:
    """For `rows`, on the device: the chosen token's logprob, then the top k ids and logprobs
    (k the largest any row asks for). A failed row's (chosen -1) are computed and dropped later."""
    if not rows:
        return ()
    if len(rows) != len(samplers):
        idx = to_device(rows, raw.device, torch.long)
        raw, chosen = raw[idx], chosen[idx]
    lp = torch.log_softmax(raw, dim=-1)
    top_vals, top_ids = lp.topk(max(samplers[i].params.logprobs for i in rows), dim=-1)
    chosen_lp = lp.gather(-1, chosen.clamp(min=0)[:, None]).squeeze(-1)
    return chosen_lp, top_ids, top_vals


def _logprobs(
    rows: list[int], reported: list[list], token_ids: list[int], samplers: list[SequenceSampler],
    failed: dict[int, SampleFailure],
) -> list[dict[int, float] | None]:
    """The host's logprob entries, from what `_logprob_tensors` computed: the sampled id first."""
    out: list[dict[int, float] | None] = [None] * len(samplers)
    if not rows:
        return out
    chosen_lp, top_ids, top_vals = reported
    for j, i in enumerate(rows):
        if i in failed:
            continue
        n = samplers[i].params.logprobs
        entry = {token_ids[i]: chosen_lp[j]}
        entry.update(zip(top_ids[j][:n], top_vals[j][:n]))
        out[i] = entry
    return out
