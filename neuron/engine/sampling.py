"""Choosing the next token of every sequence in a batched step, from rank-0 logits.

Order of operations (vLLM's): allowed_token_ids masks every other token, bad_words the last
token of each bad word the output has begun, min_tokens masks EOS and stop ids, logit_bias is
added, then the repetition (over the whole context, or the last `repetition_window` tokens),
frequency and presence penalties, then the
structured-output grammar's mask, then
greedy argmax or temperature, top_k, top_p, min_p and a draw (draw.py): the unseeded rows of the batch
together from the global generator, a seeded row from its own. Logprobs are always those of the
raw logits.

Everything runs on the logits' device; what the host needs (the chosen ids and the logprobs asked
for) comes back in one transfer per step, so on CUDA the host waits once. Only a failed row costs
more: finding why it failed reads its logits again.

A row with no token left to pick (every logit -inf, or a NaN) never reaches argmax or the draw:
it is reported as failed, with the reason, and the other rows are sampled as if it were not there.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from neuron.engine.draw import draw
from neuron.engine.sampling_params import SamplingParams
from neuron.layers import cpu_ops
from neuron.utils.device import to_device


class SequenceSampler:
    """What one generated sequence needs at each step: its params, penalty counts, generator."""

    __slots__ = ("params", "vocab_size", "output_token_ids", "generator", "_prompt_mask", "_counts", "_blocked",
                 "_bias_ids", "_bias", "_bad", "_recent", "_recent_counts")

    def __init__(
        self,
        params: SamplingParams,
        prompt_token_ids: list[int],
        vocab_size: int,
        device: str | torch.device = "cpu",
        bad_words: list[list[int]] | None = None,
    ):
        """`bad_words`: the token ids of each of params.bad_words' forms (`bad_words_token_ids`)."""
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
        # A windowed repetition penalty counts the tokens of its window instead (oldest first in _recent).
        self._recent: deque[int] | None = None
        self._recent_counts: torch.Tensor | None = None
        window = params.repetition_window
        if params.repetition_penalty != 1.0 and window is not None:
            self._recent = deque(t for t in prompt_token_ids[-window:] if 0 <= t < vocab_size)
            self._recent_counts = torch.zeros(vocab_size, dtype=torch.int32, device=device)
            ids = to_device(list(self._recent), device, torch.long)
            self._recent_counts.index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        elif params.repetition_penalty != 1.0:
            self._prompt_mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            ids = [t for t in prompt_token_ids if 0 <= t < vocab_size]
            self._prompt_mask[to_device(ids, device, torch.long)] = True
        self._blocked: torch.Tensor | None = None  # the tokens allowed_token_ids leaves out
        if params.allowed_token_ids is not None:
            self._blocked = torch.ones(vocab_size, dtype=torch.bool, device=device)
            self._blocked[to_device(params.allowed_token_ids, device, torch.long)] = False
        self._bad = [ids for ids in bad_words or () if ids and all(0 <= t < vocab_size for t in ids)] or None
        self._bias_ids = self._bias = None
        if params.logit_bias:
            self._bias_ids = to_device(list(params.logit_bias), device, torch.long)
            self._bias = to_device(list(params.logit_bias.values()), device, torch.float32)

    def _seeded_generator(self, device: str | torch.device) -> torch.Generator | None:
        # Unseeded sequences draw from the global RNG; a seeded one owns its stream, so its
        # tokens do not depend on what else shares the batch.
        if self.params.seed is None:
            return None
        return torch.Generator(device=device).manual_seed(self.params.seed)

    def append(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        if not 0 <= token_id < self.vocab_size:
            return
        if self._counts is not None:
            self._counts[token_id] += 1
        if self._recent is not None:
            self._recent.append(token_id)
            self._recent_counts[token_id] += 1
            if len(self._recent) > self.params.repetition_window:
                self._recent_counts[self._recent.popleft()] -= 1

    @property
    def below_min_tokens(self) -> bool:
        return len(self.output_token_ids) < self.params.min_tokens

    @property
    def adjusts_logits(self) -> bool:
        return self.params.penalised or self.params.biased or self.below_min_tokens

    @property
    def plain_greedy(self) -> bool:
        """Argmax of the raw logits is the whole answer for this row."""
        return self.params.greedy and self.params.logprobs is None and not self.adjusts_logits

    def adjust(self, row: torch.Tensor, eos_token_ids: Sequence[int]) -> None:
        """Apply allowed_token_ids, bad_words, min_tokens, logit_bias and the penalties to this
        sequence's row of logits, in place."""
        if self._blocked is not None:
            row.masked_fill_(self._blocked, float("-inf"))
        if self._bad is not None:
            out = self.output_token_ids
            banned = [ids[-1] for ids in self._bad if len(ids) == 1 or out[len(out) - len(ids) + 1:] == ids[:-1]]
            if banned:
                row.index_fill_(0, to_device(banned, row.device, torch.long), float("-inf"))
        if self.below_min_tokens:
            self._block_stops(row, eos_token_ids)
        if self._bias is not None:
            row.index_add_(0, self._bias_ids, self._bias.to(row.dtype))
        if self._prompt_mask is not None or self._recent is not None:
            seen = self._prompt_mask | (self._counts > 0) if self._recent is None else self._recent_counts > 0
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


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """Each bad word's token ids as the output would hold it: alone and after a space (vLLM bans
    both forms)."""
    out: list[list[int]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tokenizer.encode(text)
            if ids and ids not in out:
                out.append(ids)
    return out


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
    failed: dict[int, SampleFailure]  # by row
    # Per row: None unless its params ask for logprobs; else the sampled token's rank in the
    # vocabulary (1: the most likely)
    ranks: list[int | None]


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
        return SampleResult(token_ids, [None] * len(samplers), failed, [None] * len(samplers))
    raw = logits.float()  # rank 0's logits are float32 already, and then this is `logits` itself
    chosen = _choose(_adjusted(raw, samplers, eos_token_ids, allowed), samplers)
    rows = [i for i, s in enumerate(samplers) if s.params.logprobs is not None]
    token_ids, *reported = _to_host(chosen, *_logprob_tensors(raw, chosen, rows, samplers))
    failed = _failures(raw, token_ids, samplers, allowed.rows if allowed is not None else ())
    ranks: list[int | None] = [None] * len(samplers)
    for j, i in enumerate(rows):
        ranks[i] = reported[-1][j]
    return SampleResult(token_ids, _logprobs(rows, reported, token_ids, samplers, failed), failed, ranks)


def _to_host(*tensors: torch.Tensor) -> list[list]:
    """The step's one device-to-host transfer, of every tensor the host needs. On CUDA each is
    copied without blocking into pinned memory kept from step to step (pinning costs more than
    the copy), then the host waits for the stream once; the next step writes the buffers again
    only after this one has read them."""
    if tensors[0].device.type != "cuda":
        return [t.tolist() for t in tensors]
    buffers = [_pinned(t.dtype, i, t.numel()).view(t.shape) for i, t in enumerate(tensors)]
    for buffer, t in zip(buffers, tensors):
        buffer.copy_(t, non_blocking=True)
    torch.cuda.current_stream(tensors[0].device).synchronize()
    return [b.tolist() for b in buffers]


_PINNED: dict[tuple[torch.dtype, int], torch.Tensor] = {}


def _pinned(dtype: torch.dtype, index: int, n: int) -> torch.Tensor:
    """The first `n` elements of the `index`-th pinned buffer of `dtype`, grown (doubling) when short."""
    buffer = _PINNED.get((dtype, index))
    if buffer is None or buffer.numel() < n:
        buffer = torch.empty(max(n, 2 * (0 if buffer is None else buffer.numel()), 256), dtype=dtype,
                             pin_memory=True)
        _PINNED[(dtype, index)] = buffer
    return buffer[:n]


def _greedy(x: torch.Tensor) -> torch.Tensor:
    """Argmax per row, -1 where no token has a logit above -inf. max() ranks NaN highest, so a
    row holding a NaN fails too instead of picking it."""
    if x.dim() == 2 and cpu_ops.takes(x):
        return cpu_ops.greedy(x)
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
    if sampler.params.allowed_token_ids is not None:
        return SampleFailure("no token can be sampled: the model and min_tokens (which blocks EOS and "
                             "stop_token_ids) leave none of allowed_token_ids", True)
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
    return draw(x, [s.params for s in samplers], [s.generator for s in samplers])


def _logprob_tensors(
    raw: torch.Tensor, chosen: torch.Tensor, rows: list[int], samplers: list[SequenceSampler]
) -> tuple[torch.Tensor, ...]:
    """For `rows`, on the device: the chosen token's logprob, the top k ids and logprobs (k the
    largest any row asks for), and the chosen token's rank. A failed row's (chosen -1) are computed
    and dropped later."""
    if not rows:
        return ()
    if len(rows) != len(samplers):
        idx = to_device(rows, raw.device, torch.long)
        raw, chosen = raw[idx], chosen[idx]
    lp = torch.log_softmax(raw, dim=-1)
    top_vals, top_ids = lp.topk(max(samplers[i].params.logprobs for i in rows), dim=-1)
    chosen_lp = lp.gather(-1, chosen.clamp(min=0)[:, None]).squeeze(-1)
    rank = (lp > chosen_lp[:, None]).sum(dim=-1) + 1
    return chosen_lp, top_ids, top_vals, rank


def _logprobs(
    rows: list[int], reported: list[list], token_ids: list[int], samplers: list[SequenceSampler],
    failed: dict[int, SampleFailure],
) -> list[dict[int, float] | None]:
    """The host's logprob entries, from what `_logprob_tensors` computed: the sampled id first."""
    out: list[dict[int, float] | None] = [None] * len(samplers)
    if not rows:
        return out
    chosen_lp, top_ids, top_vals, _ = reported
    for j, i in enumerate(rows):
        if i in failed:
            continue
        n = samplers[i].params.logprobs
        entry = {token_ids[i]: chosen_lp[j]}
        entry.update(zip(top_ids[j][:n], top_vals[j][:n]))
        out[i] = entry
    return out


# ---- grammar masks ----


@dataclass(slots=True, frozen=True)
class TokenBitmask:
    """The tokens each listed row of a batch may sample: bit j of row r's word w allows token
    32 * w + j (llguidance's layout)."""

    rows: list[int]
    bits: np.ndarray  # int32 [len(rows), words]

    def apply(self, logits: torch.Tensor) -> None:
        """Add -inf to the logits of every token a row's mask forbids, in place, all rows at once."""
        bias = mask_bias(self.bits, logits.shape[-1], logits.device)
        if len(self.rows) == logits.shape[0]:
            logits += bias
            return
        logits[to_device(self.rows, logits.device, torch.long)] += bias


def mask_bias(bits: np.ndarray, vocab: int, device: torch.device) -> torch.Tensor:
    """Float [rows, vocab]: 0 for a token the mask allows, -inf for the others. Each byte of the mask
    selects its 8 entries from a 256-row table: one gather and one add, where a boolean mask costs
    tens of times more on a CPU. Ids past the mask's words are never allowed."""
    bias = _byte_table(device).index_select(0, _byte_index(bits, device)).view(len(bits), -1)
    if bias.shape[1] < vocab:
        bias = torch.nn.functional.pad(bias, (0, vocab - bias.shape[1]), value=float("-inf"))
    return bias[:, :vocab]


def _byte_index(bits: np.ndarray, device: torch.device) -> torch.Tensor:
    """The mask's bytes in order (little-endian words), as int32 indices on `device`."""
    data = bits.view(np.uint8).reshape(-1)
    if device.type == "cpu":  # numpy widens bytes faster than torch does on a CPU
        return torch.from_numpy(data.astype(np.int32))
    return to_device(data, device).int()  # bytes travel, 4 times fewer than the indices


@functools.cache
def _byte_table(device: torch.device) -> torch.Tensor:
    """Row b: 0 where bit k of b is set, else -inf (bit k is the byte's k-th token)."""
    bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
    return torch.zeros(256, 8).masked_fill_(bits == 0, float("-inf")).to(device)
