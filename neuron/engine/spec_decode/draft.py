"""Draft-model proposals: a smaller checkpoint with the target's vocabulary proposes its greedy
continuation, k tokens by k of its own steps, and the target scores them in one.

Where the draft runs: whole, on rank 0's device, beside rank 0 in the leader's process (an
executor of one rank, so no worker and no pipe). A draft is small, so a step of it is bound by
launches and latency, not by reading its weights: splitting it over the target's ranks would add
an all-reduce per layer and a round trip to every worker per drafted token, to save reading a few
hundred megabytes. The leader also holds the tokens the draft continues, so nothing else travels.
The cost is rank 0's memory: the draft's weights and its KV cache sit there alone.

Its KV cache mirrors the target's blocks: a pool of as many blocks, of the same size, written at
the same block ids. A sequence's positions live in the same blocks in both pools, so the draft
needs no block manager of its own: the scheduler reserves the blocks a proposal needs before
asking for it, and a block the target's prefix cache shares holds, in the draft's pool, what the
draft computes for the same tokens at the same positions. What a sequence's draft holds is
tracked per sequence: `computed`, the tokens whose keys and values it wrote and that are still
the sequence's; a proposal's own positions count once the target kept them. A sequence new to its
slot (admitted, or preempted and readmitted) starts over.

Blocks the target's prefix cache shares (the samples of one prompt, prompts with one system prompt)
sit in several sequences' tables, and a step may write a block for one sequence only. So the
proposer keeps, as the prefix cache does, which full blocks of its pool hold the draft's keys and
values of which tokens (`written`: block id to the block's hash chain, entered once a sequence's
draft holds the whole block, dropped when any step writes the block again). A sequence whose next
blocks are there starts its catch-up after them; one whose catch-up would write a block another
sequence writes in the same step waits a step, and then finds that block there.

Greedy proposals are a fixed guess given the tokens so far, so the target's position-by-position
sampling stays exact at any temperature (acceptance.py); a sampled draft with rejection
sampling would keep more tokens at high temperature, at the price of drawing from the draft.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING

import msgspec
import torch

from neuron.errors import ConfigError
from neuron.executor.executor import Executor
from neuron.models import supports_prefix_caching
from neuron.models.memory_plan import kv_bytes_per_token
from neuron.step import SeqStep
from neuron.worker.failure import resolve_dtype

if TYPE_CHECKING:
    from neuron.engine.model_config import ModelConfig

log = logging.getLogger("neuron.engine.spec_decode.draft")


class DraftState:
    """What the draft holds for one sequence in its slot (Sequence.draft_state)."""

    __slots__ = ("slot", "pool", "blocks_sent", "computed", "drafted", "registered")

    def __init__(self, slot: int, pool: int):
        self.slot = slot
        self.pool = pool  # which of the draft's pools (DraftProposer.pool) it was written to
        self.blocks_sent = 0  # leading blocks of the sequence's table the draft's slot has
        self.computed = 0  # leading tokens of the sequence whose keys and values the draft's pool holds
        self.drafted: list[int] = []  # the last proposal's tokens the draft wrote after those (all but its last)
        self.registered = 0  # leading blocks of the sequence's table entered in DraftProposer.written


class DraftProposer:
    def __init__(self, target: ModelConfig):
        """The draft `target`'s speculative config names, as the target's rank 0 runs it: its own
        configuration resolved from the target's (model_config.draft_spec), at the target's length
        (past the draft's own, its proposals get worse, never wrong: the target verifies them)."""
        from neuron.engine.model_config import resolve_model_config

        draft = resolve_model_config(target.draft_spec())
        self.model = replace(draft, max_model_len=target.max_model_len)
        theirs, ours = target.vocab_size, draft.vocab_size
        if theirs != ours:
            raise ConfigError(f"speculative_config: the draft {target.speculative.model} has vocab_size {ours}, the "
                              f"target {theirs}: a draft must share the target's tokenizer")
        if not supports_prefix_caching(draft.hf_config):
            raise ConfigError(f"speculative_config: the draft's model_type {draft.model_type!r} keeps "
                              "recurrent state, which cannot be rolled back past rejected tokens")
        self.chunk = target.spec.prefill_chunk_tokens
        self.step_tokens = self.model.shard_spec().max_num_batched_tokens
        self.block_size = target.spec.block_size
        self.executor: Executor | None = None
        self.pool = 0  # counts the pools started: a state of an earlier one holds nothing
        self.written: dict[int, bytes] = {}  # block id -> hash chain of the full block the pool holds there
        self.cost = 0.0  # target steps a draft step costs: weights read, the draft's over one target rank's

    def start(self, num_blocks: int, target_weight_bytes: int) -> None:
        """Load the draft with a pool of `num_blocks` blocks, as many as the target's (kept when the
        target's ranks come back with no more blocks than before). A step of either reads its
        weights once, so their sizes price a drafted token in target steps (`cost`)."""
        if self.executor is not None and self.executor.num_kv_blocks >= num_blocks:
            return
        self.close()
        cfg = self.model.executor_config(model_id="draft")
        cfg.shard = msgspec.structs.replace(cfg.shard, kv_cache_bytes=num_blocks * _block_bytes(
            self.model.hf_config, cfg.shard.dtype, cfg.device, cfg.shard.block_size))
        self.executor = Executor(cfg).start()
        self.pool += 1
        if self.executor.num_kv_blocks < num_blocks:
            have = self.executor.num_kv_blocks
            self.close()
            raise ConfigError(f"the draft's KV cache holds {have} blocks, fewer than the target's {num_blocks}")
        self.cost = self.executor.weight_bytes[0] / max(target_weight_bytes, 1)
        log.info("draft %s ready on %s (a drafted token costs %.2f target steps)", self.model.model_dir.name,
                 cfg.device, self.cost)

    def propose(self, seqs: list, ks: list[int]) -> list[list[int]]:
        """Each sequence's greedy continuation by the draft, k tokens (none for one whose catch-up
        on tokens it has not seen is longer than a prefill chunk, or would write a block another
        sequence writes in this step: it catches up this step or the next). Where a step fails,
        the sequences start over: it may have written part of what their states would count."""
        try:
            return self._propose(seqs, ks)
        except BaseException:
            for seq in seqs:
                seq.draft_state = None
            raise

    def _propose(self, seqs: list, ks: list[int]) -> list[list[int]]:
        states = [self._state(seq) for seq in seqs]
        proposals: list[list[int]] = [[] for _ in seqs]
        # the first step: each sequence's tokens the draft has not seen, its last one at least
        steps, owners, budget, claimed = [], [], self.step_tokens, set()
        for i, (seq, st) in enumerate(zip(seqs, states)):
            self._skip_written(seq, st)
            take = min(seq.num_tokens - st.computed, self.chunk, budget)
            if take <= 0:
                continue
            blocks = self._blocks(seq, st.computed, st.computed + take)
            if not claimed.isdisjoint(blocks):
                continue  # a shared block another sequence writes now: next step it is in `written`
            claimed.update(blocks)
            budget -= take
            steps.append(self._step(seq, st, seq.token_slice(st.computed, st.computed + take), st.computed))
            owners.append(i)
            st.computed += take
        if not steps:
            return proposals
        logits = self.executor.step(steps)
        for i in owners:
            self._register(seqs[i], states[i])
        ready = [j for j, i in enumerate(owners) if states[i].computed == seqs[i].num_tokens]
        for j, token in zip(ready, logits[ready].argmax(dim=-1).tolist() if ready else []):
            i = owners[j]
            proposals[i].append(token)
            states[i].drafted = []
        # then one token per step for each sequence still short of its k
        while active := [owners[j] for j in ready if len(proposals[owners[j]]) < ks[owners[j]]]:
            steps = []
            for i in active:
                st = states[i]
                token = proposals[i][-1]
                steps.append(self._step(seqs[i], st, [token], st.computed + len(st.drafted)))
                st.drafted.append(token)
            for i, token in zip(active, self.executor.step(steps).argmax(dim=-1).tolist()):
                proposals[i].append(token)
        return proposals

    def _state(self, seq) -> DraftState:
        """The sequence's draft state, the drafted tokens it kept since counted as computed, and
        its last token left to run again (its logits start the next proposal)."""
        st = seq.draft_state
        if st is None or st.slot != seq.slot or st.pool != self.pool:
            st = seq.draft_state = DraftState(seq.slot, self.pool)
        for token in st.drafted:
            pos = st.computed
            if pos >= seq.num_tokens or seq.token_slice(pos, pos + 1)[0] != token:
                break
            st.computed += 1
        st.drafted = []
        st.computed = min(st.computed, seq.num_tokens - 1)
        self._register(seq, st)
        return st

    def _register(self, seq, st: DraftState) -> None:
        """Enter in `written` the sequence's full blocks whose keys and values its draft holds,
        by the hash chain the prefix cache names them with (known once the target computed them)."""
        table, hashes = seq.block_table, seq.block_hashes
        full = min(st.computed // self.block_size, len(hashes), len(table))
        for b in range(st.registered, full):
            self.written[table[b]] = hashes[b]
        st.registered = max(st.registered, full)

    def _skip_written(self, seq, st: DraftState) -> None:
        """Move the sequence's catch-up past its next blocks that the pool holds for the same
        tokens (a prefix another sequence's draft wrote); its slot's table then starts over there,
        as a target's does after a cached prefix. The last token is always left to run."""
        table, hashes, bs = seq.block_table, seq.block_hashes, self.block_size
        b, end = st.computed // bs, min(len(hashes), len(table), (seq.num_tokens - 1) // bs)
        while b < end and self.written.get(table[b]) == hashes[b]:
            b += 1
        if b * bs > st.computed:
            st.computed, st.blocks_sent, st.registered = b * bs, 0, max(st.registered, b)

    def _blocks(self, seq, start: int, end: int) -> list[int]:
        """Ids of the sequence's blocks that positions [start, end) lie in."""
        return seq.block_table[start // self.block_size : (end - 1) // self.block_size + 1]

    def _step(self, seq, st: DraftState, tokens: list[int], offset: int) -> SeqStep:
        for b in self._blocks(seq, offset, offset + len(tokens)):
            self.written.pop(b, None)  # rewritten: entered again once a sequence's draft holds it whole
        fresh = st.blocks_sent == 0
        new_blocks = seq.block_table[st.blocks_sent:]
        st.blocks_sent = len(seq.block_table)
        return SeqStep(seq.slot, tokens, offset, new_blocks, fresh)

    def finished(self, seq) -> None:
        pass

    def between_steps(self) -> None:
        pass

    def close(self) -> None:
        self.written.clear()
        if self.executor is not None:
            self.executor.shutdown()
            self.executor = None


def _block_bytes(config: dict, dtype: str, device: str, block_size: int) -> int:
    """Bytes of one KV block of a full-attention model (every layer's K and V), as the target's
    rank 0 counts them when it leaves room for the draft (ModelConfig._draft_room)."""
    return kv_bytes_per_token(config, 1, torch.finfo(resolve_dtype(dtype, device)).bits // 8) * block_size
