"""Speculative decoding as the engine drives it: proposals after a step's sampling, verified by the
next step's sampling."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from neuron.engine.sequence import Status
from neuron.engine.spec_decode.acceptance import Acceptance, Counts
from neuron.engine.spec_decode.config import SpeculativeConfig
from neuron.engine.spec_decode.draft import DraftProposer
from neuron.engine.spec_decode.ngram import NgramProposer
from neuron.engine.spec_decode.proposer import Proposer
from neuron.engine.spec_decode.suffix import SuffixProposer

if TYPE_CHECKING:
    import torch

    from neuron.engine.model_config import ModelConfig
    from neuron.engine.output_processor import Update
    from neuron.engine.scheduler import Scheduled, Scheduler
    from neuron.engine.sequence import Sequence

log = logging.getLogger("neuron.engine.spec_decode")


class SpecDecoder:
    """Which sequences propose and how much, the proposing itself, the verifying, the counts."""

    def __init__(self, cfg: SpeculativeConfig, target: ModelConfig):
        self.cfg = cfg
        self.max_model_len = target.max_model_len
        self.proposer = make_proposer(cfg, target)
        self.counts = Counts()
        self.failures = 0  # proposals that failed since start (the first is logged with its traceback)

    def start(self, num_blocks: int, target_weight_bytes: int) -> None:
        """The target's ranks are up with a pool of `num_blocks` (at start, and after a rebuild)."""
        self.proposer.start(num_blocks, target_weight_bytes)

    def propose(self, scheduler: Scheduler) -> None:
        """After a step's sampling: the next step's draft tokens of each decoding sequence, as many
        as its acceptance earns and the step's budget and the free blocks hold (the scheduler
        reserves them). None in a step that will prefill, or of more than disable_by_batch_size
        decoding sequences: such a step is bound by compute already."""
        try:
            self.proposer.between_steps()
        except Exception as exc:  # noqa: BLE001 - what it learns from outputs is lost, not the step
            log.warning("the proposer's work between steps failed (%s: %s)", type(exc).__name__, exc, exc_info=exc)
        seqs = scheduler.decoding()
        for seq in seqs:
            seq.draft_token_ids = []
        if not seqs or len(seqs) > self.cfg.disable_by_batch_size or scheduler.prefills_next():
            return
        budget, ks = scheduler.budget - len(seqs), []
        for seq in seqs:
            k = max(min(self._length(seq), budget), 0)
            ks.append(k)
            budget -= k
        ks = scheduler.reserve_drafts(seqs, ks)
        wanted = [i for i, k in enumerate(ks) if k]
        if not wanted:
            return
        made = self._proposals([seqs[i] for i in wanted], [ks[i] for i in wanted])
        for i, proposal in zip(wanted, made):
            proposal = list(proposal[: ks[i]])
            if seqs[i].grammar is not None:  # what the grammar refuses would be refused by its mask
                proposal = proposal[: seqs[i].grammar.valid_prefix(proposal)]
            seqs[i].draft_token_ids = proposal

    def _proposals(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        """The proposer's proposals; where it fails for several sequences, each one's alone, so a
        failure costs only the speculation of the sequences it fails for, and one that fails alone
        rests (as after proposals nobody took) instead of failing every step."""
        try:
            return self.proposer.propose(seqs, ks)
        except Exception as exc:  # noqa: BLE001 - a failed proposal costs the speculation, not the step
            self._failed(exc, seqs)
        if len(seqs) > 1:
            return [self._proposals([seq], [k])[0] for seq, k in zip(seqs, ks)]
        seqs[0].acceptance.rest()
        return [[]]

    def _failed(self, exc: Exception, seqs: list[Sequence]) -> None:
        """Log a failed proposal: the first with its traceback, later ones in a line with their count."""
        self.failures += 1
        ids = ", ".join(repr(seq.request_id) for seq in seqs)
        if self.failures == 1:
            log.warning("speculative proposals failed for requests %s (%s: %s)", ids, type(exc).__name__, exc,
                        exc_info=exc)
        else:
            log.warning("speculative proposals failed for requests %s (%s: %s; %d failures since start)",
                        ids, type(exc).__name__, exc, self.failures)

    def _length(self, seq: Sequence) -> int:
        """How many tokens a decoding sequence may have proposed: as many as its acceptance earns,
        the room left under max_tokens and the model length allows."""
        if seq.images or seq.params.prompt_logprobs is not None:
            return 0
        if seq.acceptance is None:
            seq.acceptance = Acceptance()
        return min(seq.acceptance.length(self.cfg.num_speculative_tokens, self.proposer.cost),
                   seq.max_tokens - len(seq.output_token_ids) - 1, self.max_model_len - seq.num_tokens)

    def verify(self, ready: list[Scheduled], logits: torch.Tensor, scheduler: Scheduler,
               sample: Callable[[list[Scheduled], list[int]], list[Update]]) -> list[Update]:
        """Sample a verifying step (`_verify`); the accepted tokens' keys and values, which
        the step wrote, become their sequences'."""
        updates, accepted = _verify(ready, logits, sample, self.counts)
        for s, n in zip(ready, accepted):
            if s.proposal and s.seq.status is Status.RUNNING:
                scheduler.accept_proposed(s.seq, n)
        return updates

    def finished(self, seq: Sequence) -> None:
        """A sequence ended with its whole output (stop or length): the proposer may learn from it."""
        self.proposer.finished(seq)

    def close(self) -> None:
        self.proposer.close()


def make_proposer(cfg: SpeculativeConfig, target: ModelConfig) -> Proposer:
    """The proposer of `cfg.method`; a draft runs a checkpoint beside the `target`'s rank 0."""
    if cfg.method == "ngram":
        return NgramProposer(cfg)
    if cfg.method == "suffix":
        return SuffixProposer(cfg)
    return DraftProposer(target)


def _verify(ready: list[Scheduled], logits: torch.Tensor, sample: Callable[[list[Scheduled], list[int]], list[Update]],
           counts: Counts) -> tuple[list[Update], list[int]]:
    """Sample each sequence's positions in order while the token sampled equals the one proposed;
    the first that differs is kept, the rest of the proposal dropped. `logits`: each sequence's
    `logits` rows, in order; `sample(part, rows)` samples and advances those sequences from those
    rows. Returns the updates and, per sequence, how many proposed tokens were accepted."""
    starts = [0]
    for s in ready:
        starts.append(starts[-1] + s.logits)
    updates: list[Update] = []
    accepted = [0] * len(ready)
    active, position = list(range(len(ready))), 0
    while active:
        updates += sample([ready[i] for i in active], [starts[i] + position for i in active])
        still = []
        for i in active:
            s = ready[i]
            if s.seq.status is Status.RUNNING and position < len(s.proposal) \
                    and s.seq.output_token_ids[-1] == s.proposal[position]:
                accepted[i] += 1
                still.append(i)
        active, position = still, position + 1
    for s, n in zip(ready, accepted):
        if s.proposal:
            s.seq.acceptance.record(len(s.proposal), n)
            counts.proposed += len(s.proposal)
            counts.accepted += n
            counts.steps += 1
    return updates, accepted
