"""Several samples of one prompt (`n`, `best_of`): one engine sequence per sample.

The engine runs sequences, each with one output, so a prompt asked for `best_of` samples (by
default `n`) becomes that many requests with the same prompt, each with its own sampler. Sample i
of a seeded request draws from `seed + i`, as in vLLM, so sample 0 is the request sent alone with
n=1 and sample i the one sent with seed + i.

The prompt is prefilled once: the scheduler holds back a sequence whose next prompt block another
running sequence is computing until that block is in the prefix cache (`BlockManager.
computing_elsewhere`), so the other samples take the prompt's full blocks from the cache and compute
only its last, partial block. Without prefix caching (a model with recurrent layers, or
NEURON_NO_PREFIX_CACHING) each sample prefills the whole prompt.

With best_of > n, the n samples with the highest cumulative logprob are returned, best first
(vLLM's rule; OpenAI's documentation ranks by logprob per token). Ranking needs each sampled
token's logprob, so those samples ask the sampler for logprobs even when the request did not.
"""

from __future__ import annotations

import dataclasses

from neuron.engine.sampling_params import SEED_RANGE, SamplingParams


def num_samples(params: SamplingParams) -> int:
    return params.best_of or params.n


def sample_params(params: SamplingParams) -> list[SamplingParams]:
    """The params of each sample to generate: one output each, sample i seeded with seed + i."""
    count = num_samples(params)
    logprobs = params.logprobs
    if count > params.n and logprobs is None:
        logprobs = 0  # the sampled token's own logprob, to rank the samples by
    return [dataclasses.replace(params, n=1, best_of=None, logprobs=logprobs, seed=_derived_seed(params.seed, i))
            for i in range(count)]


def _derived_seed(seed: int | None, i: int) -> int | None:
    """seed + i, wrapped around into the range torch.Generator.manual_seed accepts."""
    if seed is None:
        return None
    lo, hi = SEED_RANGE
    return (seed + i - lo) % (hi - lo + 1) + lo


def sample_id(request_id: str, i: int, count: int) -> str:
    """The engine request id of sample i; a request with one sample keeps its own id."""
    return request_id if count == 1 else f"{request_id}-{i}"


def cumulative_logprob(token_ids: list[int], logprobs: list[dict[int, float]]) -> float:
    return sum(entry[t] for t, entry in zip(token_ids, logprobs))


def ranked(cumulative: list[float], n: int) -> list[int]:
    """Positions of the n samples to return: all of them in order when there are n, else the n with
    the highest cumulative logprob, best first (ties: the earlier sample first)."""
    if len(cumulative) == n:
        return list(range(n))
    return sorted(range(len(cumulative)), key=lambda i: -cumulative[i])[:n]


__all__ = ["cumulative_logprob", "num_samples", "ranked", "sample_id", "sample_params"]
