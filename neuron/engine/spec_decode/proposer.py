"""What every proposer is (`Proposer`), and the no-op lifecycle of those that only look tokens up."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from neuron.engine.sequence import Sequence


class Proposer(Protocol):
    """`propose(seqs, ks)`: up to ks[i] tokens for seqs[i]; `start(num_blocks, target_weight_bytes)`:
    the target's pool is new; `finished(seq)`: a sequence ended with its output whole;
    `between_steps()`: once after each step's sampling, for work spread over steps; `close()`;
    `cost`: target steps one proposed token costs."""

    cost: float

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]: ...

    def start(self, num_blocks: int, target_weight_bytes: int) -> None: ...

    def finished(self, seq: Sequence) -> None: ...

    def between_steps(self) -> None: ...

    def close(self) -> None: ...


class Lookup:
    """A proposer that looks tokens up: nothing to load, and free to ask (Acceptance.length)."""

    cost = 0.0  # target steps a proposed token costs

    def start(self, num_blocks: int, target_weight_bytes: int) -> None:
        pass

    def finished(self, seq) -> None:
        pass

    def between_steps(self) -> None:
        pass

    def close(self) -> None:
        pass
