"""How much is accepted: each sequence's recent rate and the proposal length it earns
(`Acceptance`), and the counts since start (`Counts`). What is kept of a proposal is decided by
`SpecDecoder.verify` (decoder.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Counts:
    """Cumulative, since start: tokens proposed, of those accepted, and sequence-steps that
    speculated (Prometheus' counters mirror them)."""

    proposed: int = 0
    accepted: int = 0
    steps: int = 0


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

    def rest(self) -> None:
        """Its proposals failed: none for a while, then one now and then, as after none were taken."""
        self.rate = 0.0
