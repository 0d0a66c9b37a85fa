"""Suffix decoding: what followed the sequence's last tokens where they occurred before, in its
own prompt and output and in earlier requests' outputs.

The sequence's last tokens are matched as deep as they occur (up to `depth` - 1 tokens), and the
continuation that followed them most often is walked while it stays likely: each token's share
among what followed the tokens before it, multiplied along the walk, must stay above `min_prob`.
A longer match earns a longer proposal (`spec_factor` tokens per matched token). Of the request's
own tokens and the shared outputs, the source that expects more accepted tokens (the sum of those
running products) proposes.

The request's own tokens are searched where they lie (`propose_from_text`: a few vectorised
passes over them per proposal, nothing to build or keep). The outputs of finished requests (the
newest `max_texts`), since agents and code tools ask for much the same things again, are counted
in a trie of every span of up to `depth` tokens (`SuffixIndex`: `depth` node visits per token
added, a node a count and its children), so a proposal walks `depth` nodes whatever it holds.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np


class _Node:
    __slots__ = ("count", "children")

    def __init__(self):
        self.count = 0
        self.children: dict[int, _Node] = {}


class SuffixIndex:
    """The spans of up to `depth` tokens of the texts added, with how often each occurred."""

    __slots__ = ("depth", "root")

    def __init__(self, depth: int):
        self.depth = depth
        self.root = _Node()

    def add(self, tokens: list[int]) -> None:
        """Count a whole text (a finished request's output)."""
        self._walk(tokens, +1)

    def remove(self, tokens: list[int]) -> None:
        """Forget a text added before (its nodes' counts fall; those that reach 0 go)."""
        self._walk(tokens, -1)

    def _walk(self, tokens: list[int], sign: int) -> None:
        limit = self.depth - 1
        ends: list[_Node] = []  # the spans that end at the last token walked, shortest first
        for t in tokens:
            grown = []
            for parent in [self.root] + ends[:limit]:
                node = parent.children.get(t)
                if node is None:
                    node = parent.children[t] = _Node()
                node.count += sign
                if node.count <= 0:
                    del parent.children[t]
                grown.append(node)
            ends = grown

    def match(self, context: list[int], longest: int) -> tuple[_Node | None, int]:
        """The deepest node for a suffix of `context` of at most `longest` tokens that has a
        continuation, and the suffix's length; (None, 0) where none does."""
        for d in range(min(longest, len(context)), 0, -1):
            node = self.root
            for t in context[len(context) - d:]:
                node = node.children.get(t)
                if node is None:
                    break
            else:
                if node.children:
                    return node, d
        return None, 0

    def propose(self, context: list[int], k: int, min_prob: float, spec_factor: float) -> tuple[list[int], float]:
        """Up to k tokens likely to follow `context`, and how many of them are expected to be kept."""
        node, matched = self.match(context, self.depth - 1 - min(k, self.depth - 2))
        if node is None:
            return [], 0.0
        k = min(k, max(1, math.ceil(spec_factor * matched)))
        proposal, prob, expected = [], 1.0, 0.0
        while len(proposal) < k and node.children:
            total = sum(c.count for c in node.children.values())
            token, child = max(node.children.items(), key=lambda kv: (kv[1].count, -kv[0]))  # ties: smallest id
            prob *= child.count / total
            if prob < min_prob:
                break
            proposal.append(token)
            expected += float(prob)
            node = child
        return proposal, expected


class OutputCache:
    """The outputs of the newest `max_texts` finished requests, indexed together."""

    __slots__ = ("index", "texts", "max_texts")

    def __init__(self, depth: int, max_texts: int):
        self.index = SuffixIndex(depth)
        self.texts: deque[list[int]] = deque()
        self.max_texts = max_texts

    def add(self, tokens: list[int]) -> None:
        if self.max_texts < 1 or not tokens:
            return
        self.index.add(tokens)
        self.texts.append(tokens)
        while len(self.texts) > self.max_texts:
            self.index.remove(self.texts.popleft())


def propose_from_text(tokens: list[int], k: int, depth: int, min_prob: float,
                      spec_factor: float) -> tuple[list[int], float]:
    """`SuffixIndex.propose` over one text's own earlier occurrences of its last tokens, without
    an index: the same proposal an index of `tokens` would make."""
    n = len(tokens)
    if n < 2 or k < 1:
        return [], 0.0
    arr = np.asarray(tokens, dtype=np.int64)
    longest = min(depth - 1 - min(k, depth - 2), n - 1)
    # match[i]: how many tokens ending at i equal the text's last ones (i < n - 1: each has a continuation)
    ends = np.arange(n - 1)
    match = np.zeros(n - 1, dtype=np.int64)
    alive = np.ones(n - 1, dtype=bool)
    for d in range(longest):
        pos = ends - d
        ok = alive & (pos >= 0)
        ok[ok] = arr[pos[ok]] == arr[n - 1 - d]
        match += ok
        alive = ok
        if not alive.any():
            break
    matched = int(match.max())
    if matched == 0:
        return [], 0.0
    occ = ends[match == matched] + 1  # where each occurrence's continuation starts
    k = min(k, max(1, math.ceil(spec_factor * matched)))
    proposal, prob, expected = [], 1.0, 0.0
    while len(proposal) < k and occ.size:
        nxt = arr[occ]
        values, counts = np.unique(nxt, return_counts=True)
        best = int(counts.argmax())  # the most frequent; among equals the smallest id, as SuffixIndex
        prob *= counts[best] / occ.size
        if prob < min_prob:
            break
        token = int(values[best])
        proposal.append(token)
        expected += float(prob)
        occ = occ[nxt == token] + 1
        occ = occ[occ < n]
    return proposal, expected
