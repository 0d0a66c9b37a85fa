"""`echo` and prompt log-probabilities on /v1/completions: the choice's text starts with the prompt,
its `logprobs` lists cover the prompt's tokens first (the first token's logprob null: nothing
precedes it), as OpenAI and vLLM write them; vLLM's `prompt_logprobs` field as well. Evaluation
harnesses (lm-eval's local-completions) score a prompt this way with max_tokens 0."""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import replace

from neuron.engine.sampling_params import InvalidParams, SamplingParams
from neuron.entrypoints.openai.api_errors import bad_request
from neuron.entrypoints.openai.api_types import CompletionLogprobs, CompletionRequest
from neuron.entrypoints.openai.logprobs import LogprobRenderer, clamp_logprob


def prompt_topk(req: CompletionRequest) -> int | None:
    """The top-k of prompt logprobs the engine computes: echo's `logprobs`, vLLM's
    `prompt_logprobs`, the larger when both; None when neither asks."""
    wanted = [k for k in (req.logprobs if req.echo else None, req.prompt_logprobs) if k is not None]
    return max(wanted) if wanted else None


def echo_logprobs(renderer: LogprobRenderer, prompt_ids: list[int],
                  prompt_logprobs: list[dict[int, float] | None]) -> CompletionLogprobs:
    """The prompt's tokens in the completions API's logprobs shape; the renderer's text offsets
    then run on into the completion."""
    out = CompletionLogprobs()
    first = renderer.completion(prompt_ids[:1], [{prompt_ids[0]: 0.0}])  # for its token and offset
    out.tokens += first.tokens
    out.token_logprobs.append(None)
    out.top_logprobs.append(None)
    out.text_offset += first.text_offset
    rest = renderer.completion(prompt_ids[1:], prompt_logprobs[1:])
    for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        getattr(out, name).extend(getattr(rest, name))
    return out


def vllm_prompt_logprobs(renderer: LogprobRenderer, prompt_ids: list[int],
                         prompt_logprobs: list[dict[int, float] | None],
                         prompt_token_ranks: list[int | None]) -> list[dict[str, dict] | None]:
    """vLLM's `prompt_logprobs`: per prompt token, None for the first, else {token id: {logprob,
    rank, decoded_token}}, rank the token's in the whole vocabulary (1: the most likely). The
    prompt's own token comes with its rank; a top-k token's is one more than the entry's logprobs
    greater than its own, since every token more likely than a top-k one is in the top-k too."""
    out: list[dict[str, dict] | None] = [None]
    for own, entry, own_rank in zip(prompt_ids[1:], prompt_logprobs[1:], prompt_token_ranks[1:]):
        ascending = sorted(entry.values())
        out.append({str(t): {"logprob": clamp_logprob(v),
                             "rank": own_rank if t == own else len(ascending) - bisect_right(ascending, v) + 1,
                             "decoded_token": renderer.token(t)}
                    for t, v in entry.items()})
    return out


def with_prompt_logprobs(params: SamplingParams, k: int | None) -> SamplingParams:
    """`params` computing the prompt's logprobs with top-`k`; a bad `k` is a 400 naming its field."""
    if k is None:
        return params
    try:
        return replace(params, prompt_logprobs=k)
    except InvalidParams as exc:
        raise bad_request(str(exc), param="prompt_logprobs") from None
