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

Proposers: `ngram` (prompt lookup: the longest recent n-gram, prompt_lookup_max down to
prompt_lookup_min tokens, found earlier in prompt + output, proposes what followed it there).

Adaptive: a sequence's k follows its acceptance (an exponential average: k_max while a fair share
is taken, one token when few are, none while it is poor, with a retry now and then), and no sequence speculates
in a step with more than `disable_by_batch_size` decoding sequences, where the step is already
bound by compute rather than by reading the weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from neuron.errors import ConfigError

METHODS = ("ngram",)


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 3  # with the last token, 4 rows: the CPU's streaming kernel (cpu_ops)
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    disable_by_batch_size: int = 8

    @classmethod
    def parse(cls, value: dict | str | None) -> "SpeculativeConfig | None":
        """From `--speculative-config` (JSON text) or `LLM(speculative_config=...)` (a dict); None: off."""
        if value is None or value == "":
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"speculative_config must be a JSON object; {exc}") from None
        if not isinstance(value, dict):
            raise ConfigError(f"speculative_config must be a JSON object, got {value!r:.80}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"speculative_config: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        method = value.get("method", "ngram")
        if method not in METHODS:
            raise ConfigError(f"speculative_config: method {method!r} is not available (available: {', '.join(METHODS)})")
        try:
            cfg = cls(**{k: (v if k == "method" else int(v)) for k, v in value.items()})
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"speculative_config: {exc}") from None
        if not 1 <= cfg.num_speculative_tokens <= 16:
            raise ConfigError("speculative_config: num_speculative_tokens must be in 1..16")
        if not 1 <= cfg.prompt_lookup_min <= cfg.prompt_lookup_max:
            raise ConfigError("speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if cfg.disable_by_batch_size < 1:
            raise ConfigError("speculative_config: disable_by_batch_size must be at least 1")
        return cfg


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

    def length(self, k_max: int) -> int:
        # A decode step reads every weight once whether it scores 1 position or a few, so a proposal
        # costs little until the rows stop being few: the whole k while a fair share is taken.
        if self.rate >= 0.3:
            return k_max
        if self.rate >= 0.15:
            return 1
        self.skipped += 1  # mostly refused: rest, and retry now and then
        if self.skipped < 8:
            return 0
        self.skipped = 0
        return 1

    def record(self, proposed: int, accepted: int) -> None:
        if proposed:
            self.rate = 0.7 * self.rate + 0.3 * accepted / proposed
