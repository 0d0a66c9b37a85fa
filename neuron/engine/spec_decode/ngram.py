"""Prompt lookup: the sequence's last n tokens, found earlier in its prompt and output, propose what
followed them there."""

from __future__ import annotations

import numpy as np

from neuron.engine.spec_decode.config import SpeculativeConfig
from neuron.engine.spec_decode.proposer import Lookup


def ngram_proposal(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """k tokens that followed the latest earlier occurrence of the sequence's last n tokens (n from
    n_max down to n_min); [] where none occurs. Where that occurrence is so recent that what
    followed it runs into the sequence's end, the text is periodic there and the proposal continues
    the period (a run of one token proposes more of it)."""
    length = len(tokens)
    if length < n_min + 1 or k < 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        pattern = arr[-n:]
        windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)  # windows that end before the last token
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            period = length - start
            return [tokens[start + i % period] for i in range(k)]
    return []


class NgramProposer(Lookup):
    """Prompt lookup over the sequence's own tokens."""

    def __init__(self, cfg: SpeculativeConfig):
        self.n_min, self.n_max = cfg.prompt_lookup_min, cfg.prompt_lookup_max

    def propose(self, seqs: list, ks: list[int]) -> list[list[int]]:
        return [ngram_proposal(seq.prompt_token_ids + seq.output_token_ids, k, self.n_min, self.n_max)
                for seq, k in zip(seqs, ks)]
