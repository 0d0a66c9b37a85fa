"""Suffix decoding: what followed the sequence's last tokens where they occurred before, in its
own prompt and output and in earlier requests' outputs.

The sequence's last tokens are matched as deep as they occur (up to `depth` - 1 tokens), and the
continuation that followed them most often is walked while it stays likely: each token's share
among what followed the tokens before it, multiplied along the walk, must stay above `min_prob`.
A longer match earns a longer proposal (`spec_factor` tokens per matched token). Of the request's
own tokens and the shared outputs, the source that expects more accepted tokens (the sum of those
running products) proposes.

The request's own tokens are searched where they lie (`propose_from_text`: a few vectorised
passes over them per proposal, nothing to build or keep). The outputs of finished requests, since
agents and code tools ask for much the same things again, are counted in a trie of every span of
up to `depth` tokens (`SuffixIndex`: `depth` node visits per token added), so a proposal walks
`depth` nodes whatever it holds. A text adds up to `depth` nodes per token, so the nodes are four
int32s in flat arrays rather than objects, and the cache of outputs (`OutputCache`) is bounded in
bytes as well as in texts, forgetting the oldest first.
"""

from __future__ import annotations

import math
import sys
from array import array
from bisect import bisect_left
from collections import deque

import numpy as np

from neuron.engine.spec_decode.config import SpeculativeConfig
from neuron.engine.spec_decode.proposer import Lookup

ROOT = 0
NODE_BYTES = 16  # a node's token, count, first child and next sibling, int32 each
_WIDE_AT = 8  # children a list scan passes before the node keeps them sorted instead
CATCH_UP_VISITS = 4096  # node visits of indexing between two steps (170 tokens at depth 24)


def _zeros(n: int) -> array:
    return array("i", bytes(4 * n))


class SuffixIndex:
    """The spans of up to `depth` tokens of the texts added, with how often each occurred.

    Node n is `token[n]` (the token that leads to it), `count[n]` (the span's occurrences),
    `child[n]` and `sibling[n]`. Most nodes have one child or a few, kept as a list threaded
    through `sibling` (-1 ends it; `child` -1: none). A node with more (the root, the first tokens
    of common phrases) keeps them as two arrays sorted by token, searched by bisection:
    `child[n]` is then -2 - w, w its slot in `wide_tokens`/`wide_nodes`. Freed nodes are threaded
    through `sibling` from `free`; the arrays grow only by `reserve` and never shrink, so `nbytes`
    (every array and list it holds, as allocated) is what it costs.
    """

    __slots__ = ("depth", "token", "count", "child", "sibling", "used", "free", "nfree",
                 "wide_tokens", "wide_nodes", "wide_owner")

    def __init__(self, depth: int, capacity: int = 1024):
        self.depth = depth
        self.token, self.count, self.child, self.sibling = (_zeros(capacity) for _ in range(4))
        self.child[ROOT] = -1
        self.used, self.free, self.nfree = 1, -1, 0  # slots below `used` were handed out once
        self.wide_tokens: list[array] = []
        self.wide_nodes: list[array] = []
        self.wide_owner = array("i")

    @property
    def nbytes(self) -> int:
        arrays = (self.token, self.count, self.child, self.sibling, self.wide_owner, *self.wide_tokens,
                  *self.wide_nodes)
        return sum(map(sys.getsizeof, arrays)) + sys.getsizeof(self.wide_tokens) + sys.getsizeof(self.wide_nodes)

    @property
    def num_nodes(self) -> int:
        return self.used - self.nfree

    def reserve(self, n: int, max_node_bytes: int | None = None) -> bool:
        """Room for `n` more nodes, the node arrays growing up to `max_node_bytes`; False where
        they would pass it."""
        capacity = len(self.count)
        short = n - (self.nfree + capacity - self.used)
        if short <= 0:
            return True
        grow = max(short, capacity // 2)  # geometric, so a text's reservation rarely copies the arrays
        if max_node_bytes is not None:
            grow = min(grow, (max_node_bytes - 4 * sys.getsizeof(self.count)) // NODE_BYTES)
            if grow < short:
                return False
        # concatenation allocates exactly the new size, which `nbytes` then reports
        self.token, self.count, self.child, self.sibling = (
            a + _zeros(grow) for a in (self.token, self.count, self.child, self.sibling))
        return True

    def add(self, tokens) -> None:
        """Count a whole text (a finished request's output)."""
        self.reserve(len(tokens) * self.depth)  # at most `depth` new spans end at each token
        self.add_part(tokens, 0, len(tokens), [])

    def add_part(self, tokens, start: int, stop: int, ends: list[int]) -> list[int]:
        """Count the spans that end at tokens[start:stop] of a text whose earlier tokens were counted
        already, `ends` being what the call for them returned ([] at the start), with room reserved
        for the whole text; returns the spans that end at its last token, shortest first."""
        limit, count = self.depth - 1, self.count
        for t in tokens[start:stop]:
            grown = []
            for parent in [ROOT, *ends[:limit]]:
                node = self.find(parent, t)
                if node < 0:
                    node = self._insert(parent, t)
                count[node] += 1
                grown.append(node)
            ends = grown
        return ends

    def remove_part(self, tokens, start: int, stop: int, ends: list[int]) -> list[int]:
        """Forget tokens[start:stop] of a text added before, as `add_part` adds them: their spans'
        counts fall, and the nodes that reach 0 are freed (the children of such a node reach 0 at the
        next token, so none is left behind). Until the rest is removed nothing may be added: a node
        freed here keeps its children for the next token's walk."""
        limit, count = self.depth - 1, self.count
        for t in tokens[start:stop]:
            grown = []
            for parent in [ROOT, *ends[:limit]]:
                node = self.find(parent, t)
                count[node] -= 1
                if count[node] == 0:
                    self._unlink(parent, node)
                grown.append(node)
            ends = grown
        return ends

    def find(self, parent: int, t: int) -> int:
        """`parent`'s child by token `t`; -1 where it has none."""
        node = self.child[parent]
        if node <= -2:
            tokens = self.wide_tokens[-2 - node]
            i = bisect_left(tokens, t)
            return self.wide_nodes[-2 - node][i] if i < len(tokens) and tokens[i] == t else -1
        token, sibling = self.token, self.sibling
        while node >= 0 and token[node] != t:
            node = sibling[node]
        return node

    def children(self, parent: int):
        """`parent`'s children's node ids."""
        node = self.child[parent]
        if node <= -2:
            return self.wide_nodes[-2 - node]
        out = []
        while node >= 0:
            out.append(node)
            node = self.sibling[node]
        return out

    def _insert(self, parent: int, t: int) -> int:
        if self.free >= 0:
            node, self.free = self.free, self.sibling[self.free]
            self.nfree -= 1
        else:
            node, self.used = self.used, self.used + 1  # `reserve` made room
        self.token[node], self.count[node], self.child[node] = t, 0, -1
        head = self.child[parent]
        if head >= 0 and len(self.children(parent)) >= _WIDE_AT:
            self._widen(parent)
            head = self.child[parent]
        if head <= -2:
            tokens, nodes = self.wide_tokens[-2 - head], self.wide_nodes[-2 - head]
            i = bisect_left(tokens, t)
            tokens.insert(i, t)
            nodes.insert(i, node)
        else:
            self.sibling[node], self.child[parent] = head, node
        return node

    def _widen(self, parent: int) -> None:
        kids = sorted(self.children(parent), key=self.token.__getitem__)
        self.child[parent] = -2 - len(self.wide_nodes)
        self.wide_tokens.append(array("i", [self.token[n] for n in kids]))
        self.wide_nodes.append(array("i", kids))
        self.wide_owner.append(parent)

    def _unlink(self, parent: int, node: int) -> None:
        head = self.child[parent]
        if head <= -2:
            self._unlink_wide(-2 - head, node)
        elif head == node:
            self.child[parent] = self.sibling[node]
        else:
            while self.sibling[head] != node:
                head = self.sibling[head]
            self.sibling[head] = self.sibling[node]
        self.sibling[node], self.free = self.free, node
        self.nfree += 1

    def _unlink_wide(self, w: int, node: int) -> None:
        tokens, nodes = self.wide_tokens[w], self.wide_nodes[w]
        i = bisect_left(tokens, self.token[node])
        del tokens[i], nodes[i]
        if tokens:
            return
        # the last child left: the last slot moves into this one, so the lists stay dense
        self.child[self.wide_owner[w]] = -1
        last = len(self.wide_nodes) - 1
        if w != last:
            self.wide_tokens[w], self.wide_nodes[w] = self.wide_tokens[last], self.wide_nodes[last]
            self.wide_owner[w] = self.wide_owner[last]
            self.child[self.wide_owner[w]] = -2 - w
        del self.wide_tokens[last], self.wide_nodes[last], self.wide_owner[last]

    def match(self, context: list[int], longest: int) -> tuple[int, int]:
        """The deepest node for a suffix of `context` of at most `longest` tokens that has a
        continuation, and the suffix's length; (-1, 0) where none does."""
        for d in range(min(longest, len(context)), 0, -1):
            node = ROOT
            for t in context[len(context) - d:]:
                node = self.find(node, t)
                if node < 0:
                    break
            else:
                if self.child[node] != -1:
                    return node, d
        return -1, 0

    def propose(self, context: list[int], k: int, min_prob: float, spec_factor: float) -> tuple[list[int], float]:
        """Up to k tokens likely to follow `context`, and how many of them are expected to be kept."""
        node, matched = self.match(context, self.depth - 1 - min(k, self.depth - 2))
        if node < 0:
            return [], 0.0
        k = min(k, max(1, math.ceil(spec_factor * matched)))
        count, token = self.count, self.token
        proposal, prob, expected = [], 1.0, 0.0
        while len(proposal) < k and self.child[node] != -1:
            kids = self.children(node)
            total = sum(count[c] for c in kids)
            child = max(kids, key=lambda c: (count[c], -token[c]))  # ties: smallest id
            prob *= count[child] / total
            if prob < min_prob:
                break
            proposal.append(token[child])
            expected += float(prob)
            node = child
        return proposal, expected


class OutputCache:
    """The outputs of the newest finished requests, indexed together: at most `max_texts` of them
    and `max_bytes` in all (the index, and the texts it forgets them by), the oldest forgotten
    first. A text that alone would not fit is not kept.

    Indexing costs `depth` node visits a token (17 microseconds a token at depth 24 on a 2-core
    VM: 135 ms for an 8,000-token output), so the engine queues a finished output (`add_later`)
    and indexes the queue a part at a time between steps (`catch_up`), rather than stalling every
    stream at once; forgetting a text costs as much and is spread the same way. At most `max_texts`
    texts, and an eighth of `max_bytes`, wait; past that the oldest waiting is dropped (it would be
    the first forgotten)."""

    __slots__ = ("index", "texts", "max_texts", "max_bytes", "text_bytes", "waiting", "waiting_bytes", "adding",
                 "forgetting")

    def __init__(self, depth: int, max_texts: int, max_bytes: int | None = None):
        self.index = SuffixIndex(depth)
        self.texts: deque[array] = deque()
        self.max_texts = max_texts
        self.max_bytes = max_bytes
        self.text_bytes = 0
        self.waiting: deque[array] = deque()  # queued by add_later, not indexed yet
        self.waiting_bytes = 0
        # the text half indexed, and the one half forgotten: where each stands, and its spans' ends there
        self.adding: tuple[array, int, list[int]] | None = None
        self.forgetting: tuple[array, int, list[int]] | None = None

    @property
    def nbytes(self) -> int:
        """The index and the texts it holds (the texts that wait are bounded apart: `waiting_bytes`)."""
        return self.index.nbytes + self.text_bytes + sys.getsizeof(self.texts) + sys.getsizeof(self.waiting)

    def add(self, tokens: list[int]) -> None:
        """Index a text now, after any that wait."""
        self.add_later(tokens)
        self.catch_up(None)

    def add_later(self, tokens: list[int]) -> None:
        """Queue a text for `catch_up`."""
        if self.max_texts < 1 or not tokens:
            return
        text = array("i", tokens)  # 4 bytes a token, where a list of ints holds about 36
        self.waiting.append(text)
        self.waiting_bytes += sys.getsizeof(text)
        limit = None if self.max_bytes is None else self.max_bytes // 8
        while len(self.waiting) > self.max_texts or (limit is not None and self.waiting_bytes > limit):
            self._pop_waiting()

    def catch_up(self, visits: int | None) -> None:
        """Index the texts that wait, oldest first, forgetting the oldest indexed ones for room, for
        about `visits` node visits (`depth` a token added or forgotten, at least one token; None:
        all of it). A text may be left half indexed, or half forgotten, for the next call."""
        tokens = None if visits is None else max(1, visits // self.index.depth)  # to walk in this call
        while tokens != 0:
            if self.forgetting is not None:
                self.forgetting, walked = _walk(self.forgetting, self.index.remove_part, tokens)
            elif self.texts and (len(self.texts) > self.max_texts
                                 or (self.max_bytes is not None and self.nbytes > self.max_bytes)):
                self._forget_oldest()  # (a text half indexed is one of the texts once whole)
                continue
            elif self.adding is not None:
                text = self.adding[0]
                self.adding, walked = _walk(self.adding, self.index.add_part, tokens)
                if self.adding is None:
                    self.texts.append(text)
                    self.text_bytes += sys.getsizeof(text)
            elif self.waiting:
                need = len(self.waiting[0]) * self.index.depth  # the most nodes it can add
                if self.index.reserve(need, self.node_budget):
                    self.adding = (self._pop_waiting(), 0, [])
                elif self.texts:
                    self._forget_oldest()  # for room
                else:  # it would not fit alone
                    self._pop_waiting()
                continue
            else:
                return
            if tokens is not None:
                tokens -= walked

    @property
    def node_budget(self) -> int | None:
        """The node arrays' share of max_bytes. They never shrink, so they get a fixed share: were
        they to fill the bound, the rest (sorted children, texts) could grow only by forgetting texts
        whose nodes free no bytes."""
        return None if self.max_bytes is None else self.max_bytes * 7 // 8

    def _pop_waiting(self) -> array:
        text = self.waiting.popleft()
        self.waiting_bytes -= sys.getsizeof(text)
        return text

    def _forget_oldest(self) -> None:
        """Start forgetting the oldest indexed text (catch_up removes its spans)."""
        text = self.texts.popleft()
        self.text_bytes -= sys.getsizeof(text)
        self.forgetting = (text, 0, [])


def _walk(part: tuple[array, int, list[int]], walk, tokens: int | None) -> tuple[tuple | None, int]:
    """A text half indexed or half forgotten, (text, where it stands, its spans' ends there), walked on
    by `walk` (`SuffixIndex.add_part` or `remove_part`) for `tokens` tokens (None: to its end): what
    is left of it (None once whole), and the tokens walked."""
    text, start, ends = part
    stop = len(text) if tokens is None else min(len(text), start + tokens)
    ends = walk(text, start, stop, ends)
    return ((text, stop, ends) if stop < len(text) else None), stop - start


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


class SuffixProposer(Lookup):
    """Suffix decoding: each sequence's own tokens, and an index of earlier outputs."""

    def __init__(self, cfg: SpeculativeConfig):
        self.depth = cfg.suffix_decoding_max_tree_depth
        self.min_prob = cfg.suffix_decoding_min_token_prob
        self.spec_factor = cfg.suffix_decoding_max_spec_factor
        self.outputs = OutputCache(self.depth, cfg.suffix_decoding_max_cached_requests,
                                   cfg.suffix_decoding_max_cache_bytes)

    def propose(self, seqs: list, ks: list[int]) -> list[list[int]]:
        return [self._propose(seq, k) for seq, k in zip(seqs, ks)]

    def between_steps(self) -> None:
        """Index a part of the finished outputs that wait: about 3 ms a step on a 2-core VM."""
        self.outputs.catch_up(CATCH_UP_VISITS)

    def _propose(self, seq, k: int) -> list[int]:
        tokens = seq.prompt_token_ids + seq.output_token_ids
        own, own_expected = propose_from_text(tokens, k, self.depth, self.min_prob, self.spec_factor)
        if not self.outputs.texts:
            return own
        context = tokens[-self.depth:]
        shared, shared_expected = self.outputs.index.propose(context, k, self.min_prob, self.spec_factor)
        return shared if shared_expected > own_expected else own

    def finished(self, seq) -> None:
        """A finished request's output joins the shared index, a part a step (`between_steps`)."""
        self.outputs.add_later(list(seq.output_token_ids))
