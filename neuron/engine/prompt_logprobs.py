"""Prompt log-probabilities on the leader: each prefill chunk's values from rank 0 are appended to
the sequence's list, one entry per prompt token (the first None: nothing precedes it), in the
shape the sampled tokens' logprobs take ({token id: logprob}, the prompt's own token first, then
the top-k)."""

from __future__ import annotations

import torch

from neuron.engine.scheduler import Scheduled
from neuron.models.inputs import StepResult


def wanted(s: Scheduled) -> int | None:
    """The top-k to ask the ranks for in this chunk; None when the chunk holds no prompt token
    still lacking its logprob (a recomputed prefill after preemption has them already)."""
    k = s.seq.params.prompt_logprobs
    if k is None or s.seq.prompt_logprobs is not None and len(s.seq.prompt_logprobs) >= len(s.seq.prompt_token_ids):
        return None
    return k if s.offset < len(s.seq.prompt_token_ids) else None


def accumulate(part: list[Scheduled], result: StepResult) -> None:
    """Append this step's prompt logprobs to each sequence of `part` that asked for them."""
    for i, s in enumerate(part):
        k = wanted(s)
        if k is None:
            continue
        seq, prompt = s.seq, s.seq.prompt_token_ids
        if seq.prompt_logprobs is None:
            seq.prompt_logprobs = [None]
        chunk = result.prompt.get(i)
        if chunk is not None:
            own, top_ids, top_lps = chunk.token_logprobs.tolist(), chunk.top_ids.tolist(), chunk.top_logprobs.tolist()
            for j in range(len(own)):
                _put(seq.prompt_logprobs, s.offset + j + 1, prompt, own[j], top_ids[j], top_lps[j])
        end = s.offset + len(s.token_ids)
        if end < len(prompt):  # the chunk's last row predicts the next chunk's first token
            _from_logits(seq.prompt_logprobs, end, prompt, result.logits[i], k)


def _from_logits(entries: list, pos: int, prompt: list[int], row: torch.Tensor, k: int) -> None:
    lp = torch.log_softmax(row.float(), dim=-1)
    values, ids = lp.topk(k) if k > 0 else (lp[:0], lp[:0].long())
    _put(entries, pos, prompt, lp[prompt[pos]].item(), ids.tolist(), values.tolist())


def _put(entries: list, pos: int, prompt: list[int], own: float, top_ids: list[int], top_lps: list[float]) -> None:
    """Entry `pos` (prompt token `pos`), only when it is the next one missing."""
    if pos != len(entries) or pos >= len(prompt):
        return
    entry = {prompt[pos]: own}
    for t, v in zip(top_ids, top_lps):
        entry.setdefault(t, v)
    entries.append(entry)
