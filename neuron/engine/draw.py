"""The draw: one token per row from the distribution its sampling parameters leave.

softmax(logits / temperature), then min_p, top_k and top_p zero the tokens they drop (top_p's
nucleus is of what the other two leave, as in vLLM), then one draw per row. On CPU the unseeded
rows draw by inverse transform (one uniform number per row); on CUDA, and for a row with its own
seeded generator everywhere, by `torch.multinomial`'s race of probabilities against exponential
noise, so a seed gives the same tokens in any batch.
"""

from __future__ import annotations

import torch

from neuron.engine.sampling_params import SamplingParams
from neuron.utils.device import to_device


def draw(x: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> torch.Tensor:
    """One draw per row of `x` (adjusted logits, [B, V]); -1 for a row with nothing to draw from.
    The unseeded rows draw together from the global generator; a row with its own generator draws
    again alone, from it."""
    probs, ids, ok = filtered_probs(x, params)
    if probs.is_cuda:
        picks = race(probs, ids, torch.empty_like(probs).exponential_())
    else:
        picks = inverse_cdf(probs, ids)
    for j, generator in enumerate(generators):
        if generator is not None:
            picks[j : j + 1] = _seeded_draw(x[j : j + 1], params[j], generator)
    return torch.where(ok, picks, -1)


def _seeded_draw(row: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    # Over the whole vocabulary in order, the row takes as many numbers from its generator, and
    # the same ones, whatever else shares the batch, so a seed gives the same tokens in any batch:
    # those `torch.multinomial(probs, 1, generator=...)` draws, the same method with its checks.
    probs, ids, _ = filtered_probs(row, [params])
    if ids is not None:
        probs = torch.zeros_like(row).scatter_(-1, ids, probs)
    return race(probs, None, torch.empty_like(probs).exponential_(generator=generator))


def inverse_cdf(probs: torch.Tensor, ids: torch.Tensor | None) -> torch.Tensor:
    """Each row's token by inverse transform: the first column whose cumulative probability
    exceeds u * total, u ~ Uniform[0, 1), one number per row. On CPU this is the draw for the
    unseeded rows: `race` needs an exponential number per vocabulary entry, and torch
    makes those one at a time (20 ms for 32 rows of a 32,000-token vocabulary, against 0.6 ms
    here). The sums are in float64, so even a token of probability 1e-12 keeps its share; a zero
    probability adds nothing to the sum and is never the first column to exceed it, and the target
    stays strictly below the row's total, so some column always exceeds it."""
    cdf = probs.double().cumsum_(dim=-1)
    total = cdf[:, -1:]
    target = torch.minimum(torch.rand_like(total) * total, total.nextafter(torch.zeros_like(total)))
    # a failed row (NaN, discarded by the caller) may name the column past the end: keep it in range
    won = torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_max_(cdf.shape[-1] - 1)
    return won if ids is None else ids.gather(-1, won[:, None]).squeeze(-1)


def race(probs: torch.Tensor, ids: torch.Tensor | None, noise: torch.Tensor) -> torch.Tensor:
    """The token of each row's argmax(probs / noise), noise ~ Exponential(1): column i wins with
    probability probs_i. It is `torch.multinomial`'s own method for one sample, without the
    checks that make it wait for the device. A zero probability scores 0 and never wins; the
    clamp keeps a noise of exactly 0 from making that 0 / 0, a NaN that argmax would rank first.
    Overwrites `noise`."""
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    won = torch.div(probs, noise, out=noise).argmax(dim=-1)
    return won if ids is None else ids.gather(-1, won[:, None]).squeeze(-1)


def filtered_probs(
    x: torch.Tensor, params: list[SamplingParams]
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The distribution each row draws from: softmax(x / temperature), with the tokens that min_p,
    top_k and top_p drop set to zero (top_p's nucleus is of the min_p and top_k survivors).
    Returns it, the token of each column (None: the vocabulary in order) and the rows that have a
    distribution at all.

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
    if any(p.min_p > 0 for p in params):  # the best token is among the columns, so its floor is the same
        probs = _min_p(probs, params)
    if ids is not None:
        probs = _top_k_top_p(probs, ks, params)
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
    """Nucleus filter on probabilities sorted high to low, relative to the min_p and top_k survivors."""
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
