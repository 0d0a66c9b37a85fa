"""Speculative decoding: cheap proposals for a sequence's next tokens, scored by the target model in
one step and kept as far as the target agrees.

A decoding sequence brings its last token plus up to k proposed ones; the step returns logits for
all k + 1 positions. The engine then samples position by position exactly as a plain decode would
(penalties, grammar, seed and all, each position seeing the tokens kept before it) and keeps going
while the sampled token equals the proposal. The first token that differs is kept too (it is a
sample from the target's distribution at that position), and the proposals after it are dropped:
their keys and values sit past the sequence's computed length and are overwritten later. For a
proposal that is a fixed guess (n-gram) this is exactly rejection sampling: the proposal survives
with the target's probability of it, and a rejected position's token is drawn from the target's
distribution without the proposal. So output equals non-speculative decoding, greedy or sampled,
seeded requests included; only the number of target steps changes.

Proposers (the `method`): `ngram` (prompt lookup: the longest recent n-gram, prompt_lookup_max
down to prompt_lookup_min tokens, found earlier in prompt + output, proposes what followed it
there); `suffix` (suffix.py: the request's own tokens, and a count-keeping index of earlier
requests' outputs bounded in bytes, propose the continuation most often seen, as far as it stays
likely); `draft` (draft.py: a smaller checkpoint with the same vocabulary proposes its own greedy
continuation). Each is a fixed guess given the tokens so far, which is what keeps the
position-by-position sampling exact.

Adaptive: a sequence's k follows its acceptance (an exponential average). For lookups, which cost
nothing to propose: k_max while a fair share is taken, one token when few are, none while it is
poor, with a retry now and then. For a draft, whose every token costs a draft step (its weights
against the target's): the k that yields most tokens per unit of time, none where no k beats a
plain step. No sequence speculates in a step with more than `disable_by_batch_size` decoding
sequences, or in one that prefills, where the step is already bound by compute rather than by
reading the weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from neuron.config import parse_bytes
from neuron.engine.engine_config import json_object
from neuron.engine.suffix import OutputCache, propose_from_text
from neuron.errors import ConfigError

METHODS = ("ngram", "suffix", "draft")
_ALIASES = {"draft_model": "draft", "[ngram]": "ngram"}
# The keys every method reads, and each method's own (--speculative-config's help lists them all).
COMMON_KEYS = ("method", "num_speculative_tokens", "disable_by_batch_size")
METHOD_KEYS = {
    "ngram": ("prompt_lookup_min", "prompt_lookup_max"),
    "suffix": ("suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
               "suffix_decoding_max_cache_bytes", "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob"),
    "draft": ("model", "draft_tensor_parallel_size"),
}


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 3  # with the last token, 4 rows: the CPU's streaming kernel (cpu_ops)
    disable_by_batch_size: int = 8
    # ngram
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    # suffix (vLLM's names)
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # the shared index of outputs, in bytes (a number, or with a unit: "64MiB"): about 80 outputs of
    # 2,000 tokens that repeat nothing (0.75 MB each at depth 24), many more where they repeat each other
    suffix_decoding_max_cache_bytes: int = 64 * 2**20
    # draft
    model: str | None = None
    draft_tensor_parallel_size: int = 1

    @classmethod
    def parse(cls, value: dict | str | None) -> "SpeculativeConfig | None":
        """From `--speculative-config` (JSON text) or `LLM(speculative_config=...)` (a dict); None: off."""
        if value is None or value == "":
            return None
        value = json_object(value, "speculative_config")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"speculative_config: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        fields = dict(value)
        method = fields["method"] = _ALIASES.get(fields.get("method", "ngram"), fields.get("method", "ngram"))
        if method not in METHODS:
            raise ConfigError(f"speculative_config: method {method!r} is not available "
                              f"(available: {', '.join(METHODS)})")
        if "model" in fields and method != "draft":
            raise ConfigError(f"speculative_config: model names a draft checkpoint, for method draft, not {method!r}")
        try:
            cfg = cls(**{k: _typed(k, v) for k, v in fields.items()})
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"speculative_config: {exc}") from None
        cfg._check()
        return cfg

    def summary(self) -> dict:
        """The keys this method reads, with their values: what /health and the start-up log show."""
        return {key: getattr(self, key) for key in COMMON_KEYS + METHOD_KEYS[self.method]}

    def _check(self) -> None:
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ConfigError("speculative_config: num_speculative_tokens must be in 1..16")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError("speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.disable_by_batch_size < 1:
            raise ConfigError("speculative_config: disable_by_batch_size must be at least 1")
        if not 2 <= self.suffix_decoding_max_tree_depth <= 256:
            raise ConfigError("speculative_config: suffix_decoding_max_tree_depth must be in 2..256")
        if self.suffix_decoding_max_cached_requests < 0:
            raise ConfigError("speculative_config: suffix_decoding_max_cached_requests must be at least 0")
        if self.suffix_decoding_max_spec_factor <= 0:
            raise ConfigError("speculative_config: suffix_decoding_max_spec_factor must be positive")
        if not 0.0 <= self.suffix_decoding_min_token_prob <= 1.0:
            raise ConfigError("speculative_config: suffix_decoding_min_token_prob must be in [0, 1]")
        if self.suffix_decoding_max_cache_bytes < 1:
            raise ConfigError("speculative_config: suffix_decoding_max_cache_bytes must be at least 1 "
                              "(suffix_decoding_max_cached_requests 0 turns the shared index off)")
        if self.method == "draft" and not self.model:
            raise ConfigError("speculative_config: method draft needs model, the draft checkpoint "
                              "(a smaller model with the target's vocabulary)")
        if self.draft_tensor_parallel_size != 1:
            raise ConfigError("speculative_config: draft_tensor_parallel_size must be 1: the draft runs "
                              "whole on rank 0's device")


def _typed(key: str, value):
    if key in ("method", "model"):
        if not isinstance(value, str):
            raise ValueError(f"{key} must be a string, got {value!r:.80}")
        return value
    if key == "suffix_decoding_max_cache_bytes" and isinstance(value, str):
        try:
            return parse_bytes(value, key)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
    kind = float if key in ("suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob") else int
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
        raise ValueError(f"{key} must be {'a number' if kind is float else 'an integer'}, got {value!r:.80}")
    return kind(value)


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


class Acceptance:
    """A sequence's recent acceptance, and the proposal length it earns."""

    __slots__ = ("rate", "skipped")

    def __init__(self):
        self.rate = 1.0
        self.skipped = 0

    def length(self, k_max: int, cost: float = 0.0) -> int:
        """How many tokens to propose, for a proposer whose every proposed token costs `cost`
        target steps (a draft model's size against the target's; 0 for lookups)."""
        k = self._free_length(k_max) if cost <= 0 else self._paid_length(k_max, cost)
        if k:
            self.skipped = 0
            return k
        self.skipped += 1  # mostly refused: rest, and retry now and then
        if self.skipped < 8:
            return 0
        self.skipped = 0
        return 1

    def _free_length(self, k_max: int) -> int:
        # A decode step reads every weight once whether it scores 1 position or a few, so a proposal
        # costs little until the rows stop being few: the whole k while a fair share is taken.
        if self.rate >= 0.3:
            return k_max
        return 1 if self.rate >= 0.15 else 0

    def _paid_length(self, k_max: int, cost: float) -> int:
        # Each token kept with probability `rate` once the ones before it were: k proposed tokens
        # yield 1 + a + ... + a^k tokens for one target step and k draft steps. The k that yields
        # most per unit of time, or 0 where no k beats a plain step.
        a = min(max(self.rate, 0.0), 0.99)
        best, best_k, expected = 1.0, 0, 1.0
        for k in range(1, k_max + 1):
            expected += a**k
            value = expected / (1 + k * cost)
            if value > best * 1.02:  # a gain worth the step's other costs
                best, best_k = value, k
        return best_k

    def record(self, proposed: int, accepted: int) -> None:
        if proposed:
            self.rate = 0.7 * self.rate + 0.3 * accepted / proposed


class _Lookup:
    """A proposer that looks tokens up: nothing to load, and free to ask (Acceptance.length)."""

    cost = 0.0  # target steps a proposed token costs

    def start(self, num_blocks: int, target_weight_bytes: int) -> None:
        pass

    def release(self, seq, finished: bool) -> None:
        pass

    def close(self) -> None:
        pass


class NgramProposer(_Lookup):
    """Prompt lookup over the sequence's own tokens."""

    def __init__(self, cfg: SpeculativeConfig):
        self.n_min, self.n_max = cfg.prompt_lookup_min, cfg.prompt_lookup_max

    def propose(self, seqs: list, ks: list[int]) -> list[list[int]]:
        return [ngram_proposal(seq.prompt_token_ids + seq.output_token_ids, k, self.n_min, self.n_max)
                for seq, k in zip(seqs, ks)]


class SuffixProposer(_Lookup):
    """Suffix decoding (suffix.py): each sequence's own tokens, and an index of earlier outputs."""

    def __init__(self, cfg: SpeculativeConfig):
        self.depth = cfg.suffix_decoding_max_tree_depth
        self.min_prob = cfg.suffix_decoding_min_token_prob
        self.spec_factor = cfg.suffix_decoding_max_spec_factor
        self.outputs = OutputCache(self.depth, cfg.suffix_decoding_max_cached_requests,
                                   cfg.suffix_decoding_max_cache_bytes)

    def propose(self, seqs: list, ks: list[int]) -> list[list[int]]:
        return [self._propose(seq, k) for seq, k in zip(seqs, ks)]

    def _propose(self, seq, k: int) -> list[int]:
        tokens = seq.prompt_token_ids + seq.output_token_ids
        own, own_expected = propose_from_text(tokens, k, self.depth, self.min_prob, self.spec_factor)
        if not self.outputs.texts:
            return own
        context = tokens[-self.depth:]
        shared, shared_expected = self.outputs.index.propose(context, k, self.min_prob, self.spec_factor)
        return shared if shared_expected > own_expected else own

    def release(self, seq, finished: bool) -> None:
        """A finished request's output joins the shared index."""
        if finished and seq.finish_reason in ("stop", "length"):
            self.outputs.add(list(seq.output_token_ids))


def make_proposer(cfg: SpeculativeConfig, **draft_kwargs):
    """The proposer for `cfg.method`; a draft's needs its runner's settings (draft.DraftProposer).
    Each has `propose(seqs, ks)` (up to ks[i] tokens for seqs[i]), `start(num_blocks,
    target_weight_bytes)` (the target's pool is new), `release(seq, finished)` (the sequence left
    its slot), `close()`, and `cost`: target steps one proposed token costs."""
    if cfg.method == "ngram":
        return NgramProposer(cfg)
    if cfg.method == "suffix":
        return SuffixProposer(cfg)
    from neuron.engine.draft import DraftProposer

    return DraftProposer(cfg.model, **draft_kwargs)
