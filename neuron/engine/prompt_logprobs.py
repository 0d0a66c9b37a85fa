"""Prompt log-probabilities on the leader: each prefill chunk's values from rank 0 are appended to
the sequence's lists, one entry per prompt token (the first None: nothing precedes it): its
logprobs in the shape the sampled tokens' take ({token id: logprob}, the prompt's own token first,
then the top-k), and the own token's rank in the whole vocabulary (vLLM's `Logprob.rank`)."""

from __future__ import annotations

import torch

from neuron.engine.scheduler import Scheduled
from neuron.engine.sequence import Sequence
from neuron.models.inputs import StepResult
from neuron.models.prompt_logprobs import rank_in_vocab


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
        seq = s.seq
        if seq.prompt_logprobs is None:
            seq.prompt_logprobs, seq.prompt_token_ranks = [None], [None]
        chunk = result.prompt.get(i)
        if chunk is not None:
            own, ranks = chunk.token_logprobs.tolist(), chunk.token_ranks.tolist()
            top_ids, top_lps = chunk.top_ids.tolist(), chunk.top_logprobs.tolist()
            for j in range(len(own)):
                _put(seq, s.offset + j + 1, own[j], ranks[j], top_ids[j], top_lps[j])
        end = s.offset + len(s.token_ids)
        if end < len(seq.prompt_token_ids):  # the chunk's last row predicts the next chunk's first token
            _from_logits(seq, end, result.logits[i], k)


def _from_logits(seq: Sequence, pos: int, row: torch.Tensor, k: int) -> None:
    lp = torch.log_softmax(row.float(), dim=-1)
    own = lp[seq.prompt_token_ids[pos]]
    values, ids = lp.topk(k) if k > 0 else (lp[:0], lp[:0].long())
    _put(seq, pos, own.item(), int(rank_in_vocab(lp, own)), ids.tolist(), values.tolist())


def _put(seq: Sequence, pos: int, own: float, rank: int, top_ids: list[int], top_lps: list[float]) -> None:
    """Entry `pos` (prompt token `pos`), only when it is the next one missing."""
    prompt = seq.prompt_token_ids
    if pos != len(seq.prompt_logprobs) or pos >= len(prompt):
        return
    entry = {prompt[pos]: own}
    for t, v in zip(top_ids, top_lps):
        entry.setdefault(t, v)
    seq.prompt_logprobs.append(entry)
    seq.prompt_token_ranks.append(rank)
