"""Log-probabilities of a prompt's own tokens, for sequences that ask for them (evaluation
harnesses score a prompt this way). Computed in sub-chunks of rows so a long prefill chunk never
holds a [tokens, vocab] tensor at once; every rank runs the same sub-chunks because the LM head
gathers the vocabulary across ranks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Rows through the LM head at a time: bounds the [rows, vocab] float32 tensors (logits, log-softmax)
# to about 40 MB each at a 150k vocabulary, inside the slack the models' activation_bytes keeps free
# of KV blocks, so asking for prompt logprobs cannot run a sized GPU out of memory.
ROWS_PER_PASS = 64


@dataclass(slots=True)
class PromptChunkLogprobs:
    """For each token but the first of a sequence's chunk: its logprob given what precedes it, its
    rank in the vocabulary there (1: the most likely), and the `k` most likely tokens at that
    position with their logprobs (rank 0 only, on the CPU)."""

    token_logprobs: torch.Tensor  # [n - 1]
    token_ranks: torch.Tensor  # [n - 1]
    top_ids: torch.Tensor  # [n - 1, k]
    top_logprobs: torch.Tensor  # [n - 1, k]


def compute(model, x: torch.Tensor, batch) -> dict[int, PromptChunkLogprobs]:
    """Rank 0: the chunk logprobs of every sequence `i` of the batch with `batch.prompt_topk[i]`
    set, keyed by `i`; other ranks take part in the gathers and get an empty dict."""
    out: dict[int, PromptChunkLogprobs] = {}
    start = 0
    for i, (n, k) in enumerate(zip(batch.lengths, batch.prompt_topk)):
        if k is not None and n > 1:
            chunk = _sequence(model, x[start : start + n], batch.token_ids[start + 1 : start + n], k)
            if chunk is not None:
                out[i] = chunk
        start += n
    return out


def _sequence(model, rows: torch.Tensor, targets: torch.Tensor, k: int) -> PromptChunkLogprobs | None:
    """Row j predicts token j + 1; the chunk's last row is the step's last-token logits, left to the engine."""
    token_lp, token_rank, top_ids, top_lp = [], [], [], []
    for a in range(0, len(targets), ROWS_PER_PASS):
        b = min(a + ROWS_PER_PASS, len(targets))
        logits = model.lm_head(model.norm(rows[a:b]))
        if logits is None:
            continue
        lp = torch.log_softmax(logits.float(), dim=-1)
        own = lp.gather(1, targets[a:b, None])
        token_lp.append(own.squeeze(1))
        token_rank.append(rank_in_vocab(lp, own))
        values, ids = lp.topk(k, dim=-1) if k > 0 else (lp[:, :0], lp[:, :0].long())
        top_ids.append(ids)
        top_lp.append(values)
    if not token_lp:
        return None
    # to the host once per tensor for the whole chunk, not once per pass
    return PromptChunkLogprobs(*(torch.cat(parts).cpu() for parts in (token_lp, token_rank, top_ids, top_lp)))


def rank_in_vocab(lp: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """Each row's rank of the logprob `own` ([rows, 1]) among the row's whole vocabulary `lp`: how
    many are greater, plus one (vLLM's `Logprob.rank`, ties sharing the better rank). Rank 0's rows
    hold every rank's share of the vocabulary, the LM head having gathered them."""
    return (lp > own).sum(dim=-1) + 1
