"""A step's input on one rank: each slot's block table and filled length, host-side, and the
step's sequences turned into the tensors the forward reads (a `StepBatch`: token ids, positions,
the pool rows each new token writes, and attention's metadata).

The leader's BlockManager decides which blocks a sequence owns; a rank only keeps each slot's
table, which a step extends by the block ids it carries (or restarts, on a sequence's first step).
Blocks holding a cached prompt prefix may sit in several tables at once; they are full and a step
never writes to them. Each rank tracks how many positions of every slot are filled, so a step
that would read positions nobody wrote, or write outside its blocks, is refused before any
collective runs: every rank sees the same request and refuses it the same way.

The model runner owns one `BlockTables` (model_runner.py); the pools themselves are the model's
KV cache (neuron/models/kv_cache.py), which keeps storage only. On the gather path (a reference for
tests) each slot keeps the pool row of every one of its positions (`slot_rows`), extended when
its table grows, so a step finds its rows by slicing.
"""

from __future__ import annotations

import numpy as np
import torch

from neuron.layers.paged_attention import PagedAttentionMetadata, build_step
from neuron.models.inputs import StepBatch, StepRejected
from neuron.step import SeqStep
from neuron.utils.device import Staging, to_device


class BlockTables:
    """Each slot's block table and filled length; checks a step against them and builds its batch."""

    def __init__(self, slots: int, num_blocks: int, block_size: int, max_len: int, device, paged: bool = True):
        self.num_blocks, self.block_size, self.max_len = num_blocks, block_size, max_len
        self.device = device
        self.tables: list[list[int]] = [[] for _ in range(slots)]
        self.filled = [0] * slots
        # the gather path's pool row of every position of every slot; the paged path reads the tables
        self.slot_rows = None if paged else torch.zeros((slots, blocks_for(max_len, block_size) * block_size),
                                                        dtype=torch.long, device=device)
        self._block_offsets = torch.arange(block_size, device=device)
        # `paged`: attention reads each sequence's blocks where they lie, from one flat description
        # of the step; the block tables are mirrored host-side for it
        self.paged = paged
        self.table_array = np.zeros((slots, blocks_for(max_len, block_size)), dtype=np.int32)
        self.staging = Staging(device)  # a paged step's host data crosses to the device in one copy

    @property
    def num_slots(self) -> int:
        return len(self.filled)

    # ---- validation (no state changes) ----

    def check(self, seqs: list[SeqStep], vocab_size: int) -> None:
        """Refuse a step that would corrupt or misread the cache; raises StepRejected."""
        seen: set[int] = set()
        written: set[int] = set()
        for s in seqs:
            slot = s.slot
            if not 0 <= slot < self.num_slots:
                raise StepRejected(f"slot {slot} out of range (0..{self.num_slots - 1})")
            if slot in seen:
                raise StepRejected(f"slot {slot} appears twice in one step")
            seen.add(slot)
            ids = s.token_ids
            if not ids:
                raise StepRejected(f"slot {slot}: a step needs at least one token")
            if not 1 <= s.logits <= len(ids):
                raise StepRejected(f"slot {slot}: logits for {s.logits} positions of a {len(ids)}-token step")
            if min(ids) < 0 or max(ids) >= vocab_size:
                raise StepRejected(f"slot {slot}: token id outside the vocabulary (0..{vocab_size - 1})")
            self._check_blocks(s)
            if len(seqs) > 1:
                for b in self._written_blocks(s):
                    if b in written:
                        raise StepRejected(f"slot {slot}: block {b} is written by two sequences in one step")
                    written.add(b)

    def _check_blocks(self, s: SeqStep) -> None:
        slot, offset, end, bs = s.slot, s.offset, s.offset + len(s.token_ids), self.block_size
        if s.new_blocks and (min(s.new_blocks) < 0 or max(s.new_blocks) >= self.num_blocks):
            raise StepRejected(f"slot {slot}: block id outside the pool (0..{self.num_blocks - 1})")
        if s.fresh:
            blocks, filled = len(s.new_blocks), offset
            if offset % bs:
                raise StepRejected(f"slot {slot}: a cached prefix must be whole blocks, got offset {offset}")
            if len(set(s.new_blocks)) != blocks:
                raise StepRejected(f"slot {slot}: a block appears twice in one block table")
        else:
            blocks, filled = len(self.tables[slot]) + len(s.new_blocks), self.filled[slot]
        if offset < 0 or offset > filled:
            raise StepRejected(f"slot {slot}: offset {offset} but only {filled} positions filled")
        if end > self.max_len:
            raise StepRejected(f"slot {slot}: {end} positions exceed max_model_len {self.max_len}")
        if end > blocks * bs:
            raise StepRejected(f"slot {slot}: {end} positions but only {blocks} blocks of {bs}")

    def _written_blocks(self, s: SeqStep) -> list[int]:
        first, last = s.offset // self.block_size, (s.offset + len(s.token_ids) - 1) // self.block_size
        old = [] if s.fresh else self.tables[s.slot]
        return [old[i] if i < len(old) else s.new_blocks[i - len(old)] for i in range(first, last + 1)]

    # ---- a step ----

    def prepare(self, seqs: list[SeqStep]) -> StepBatch:
        """Apply the step's block-table changes and describe the step for the forward."""
        for s in seqs:
            if s.new_blocks or s.fresh:
                self._extend_table(s)
        if self.paged:
            return self._paged_batch(seqs)
        if all(len(s.token_ids) == 1 for s in seqs):
            return self._decode_batch(seqs)
        return self._prefill_batch(seqs)

    def _extend_table(self, s: SeqStep) -> None:
        table = self.tables[s.slot]
        if s.fresh:
            table.clear()
        bs = self.block_size
        start, end = len(table) * bs, (len(table) + len(s.new_blocks)) * bs
        if self.slot_rows is not None:
            blocks = to_device(s.new_blocks, self.device, torch.long)
            self.slot_rows[s.slot, start:end] = (blocks[:, None] * bs + self._block_offsets).view(-1)
        self.table_array[s.slot, len(table) : len(table) + len(s.new_blocks)] = s.new_blocks
        table += s.new_blocks

    def _row(self, slot: int, position: int) -> int:
        return self.tables[slot][position // self.block_size] * self.block_size + position % self.block_size

    def _decode_batch(self, seqs: list[SeqStep]) -> StepBatch:
        slots = [s.slot for s in seqs]
        positions = [s.offset for s in seqs]
        kv_lens = [p + 1 for p in positions]
        rows = [self._row(slot, p) for slot, p in zip(slots, positions)]
        if len(seqs) == 1:
            per_token = to_device([[seqs[0].token_ids[0]], positions], self.device, torch.long)
            read_rows, mask, write_rows = self.slot_rows[slots[0], : kv_lens[0]], None, rows[0]
        else:
            per_token = to_device([[s.token_ids[0] for s in seqs], positions, rows, slots, kv_lens], self.device,
                                  torch.long)
            longest = max(kv_lens)
            read_rows = self.slot_rows[:, :longest].index_select(0, per_token[3])
            mask = (torch.arange(longest, device=self.device) < per_token[4][:, None])[:, None, None, :]
            write_rows = per_token[2]
        return StepBatch(per_token[0], per_token[1], write_rows, slots, [1] * len(seqs), kv_lens,
                         None, True, [read_rows], [mask])

    def _prefill_batch(self, seqs: list[SeqStep]) -> StepBatch:
        flat_ids, positions, ends = [], [], []
        write_rows, read_rows, masks, kv_lens = [], [], [], []
        for s in seqs:
            n, offset = len(s.token_ids), s.offset
            flat_ids += s.token_ids
            positions += range(offset, offset + n)
            ends += range(len(flat_ids) - min(s.logits, n), len(flat_ids))
            kv_lens.append(offset + n)
            write_rows.append(self.slot_rows[s.slot, offset : offset + n])
            read_rows.append(self.slot_rows[s.slot, : offset + n])
            masks.append(None if offset == 0 else _causal_mask(n, offset, self.device))
        per_token = to_device([flat_ids, positions], self.device, torch.long)
        last_index = to_device(ends, self.device, torch.long)
        rows = write_rows[0] if len(write_rows) == 1 else torch.cat(write_rows)
        return StepBatch(per_token[0], per_token[1], rows, [s.slot for s in seqs], [len(s.token_ids) for s in seqs],
                         kv_lens, last_index, False, read_rows, masks)

    def _paged_batch(self, seqs: list[SeqStep]) -> StepBatch:
        """The step as one flat batch and its attention metadata, built once for every layer."""
        slots, lengths, offsets = [s.slot for s in seqs], [len(s.token_ids) for s in seqs], [s.offset for s in seqs]
        ids = [t for s in seqs for t in s.token_ids]
        all_decode = all(n == 1 for n in lengths)
        if all_decode and self.device.type == "cpu":
            meta, token_ids, positions = self._cpu_decode_step(slots, offsets, ids)
        else:
            meta, token_ids, positions = build_step(self.table_array[slots], offsets, lengths, self.block_size,
                                                    self.staging, ids)
        last_index, counts = None, None
        if not all_decode:
            last_index = meta.query_start[1:].long() - 1
            if any(s.logits > 1 for s in seqs):  # a speculative step: the proposals' positions too
                counts = [s.logits for s in seqs]
                last_index = to_device(logit_rows(lengths, counts), self.device, torch.long)
        return StepBatch(token_ids, positions, meta.slot_mapping, slots, lengths,
                         [o + n for o, n in zip(offsets, lengths)], last_index, all_decode, [], [], meta,
                         logit_counts=counts)

    def _cpu_decode_step(self, slots: list[int], offsets: list[int], ids: list[int]
                         ) -> tuple[PagedAttentionMetadata, torch.Tensor, torch.Tensor]:
        """build_step's tensors for a CPU step of one new token per sequence, from the host tables'
        lists with a handful of calls: a decode step starts right after the last one streamed the
        weights through the caches, where each numpy or torch call of the general path costs
        several microseconds (about 150 us a step in all on the 191M model at batch 1)."""
        n, bs = len(slots), self.block_size
        kv_lens = [o + 1 for o in offsets]
        longest = max(kv_lens)
        width = -(-longest // bs)
        rows = [self.tables[slot][o // bs] * bs + o % bs for slot, o in zip(slots, offsets)]
        tables = self.table_array[slots[0] : slots[0] + 1, :width] if n == 1 else self.table_array[slots, :width]
        longs = torch.tensor([*ids, *offsets, *rows], dtype=torch.int64)
        ints = torch.tensor([*range(n + 1), *kv_lens], dtype=torch.int32)
        meta = PagedAttentionMetadata(ints[: n + 1], ints[n + 1 :], torch.from_numpy(tables), longs[2 * n :], bs, 1,
                                      longest)
        return meta, longs[:n], longs[n : 2 * n]

    def commit(self, batch: StepBatch) -> None:
        for slot, kv_len in zip(batch.slots, batch.kv_lens):
            self.filled[slot] = kv_len

    def clear(self, slots: list[int] | None) -> None:
        """Forget the slots' tables; the blocks' contents stay (the leader may still reuse them)."""
        targets = range(self.num_slots) if slots is None else slots
        for slot in targets:
            if not 0 <= slot < self.num_slots:
                raise StepRejected(f"slot {slot} out of range (0..{self.num_slots - 1})")
        for slot in targets:
            self.tables[slot].clear()
            self.filled[slot] = 0


def _causal_mask(n: int, offset: int, device) -> torch.Tensor:
    rows = torch.arange(n, device=device)[:, None] + offset
    cols = torch.arange(offset + n, device=device)[None, :]
    return cols <= rows


def logit_rows(lengths: list[int], wanted: list[int], stride: int | None = None) -> list[int]:
    """The flat batch's rows whose logits are returned: each sequence's last `wanted` tokens. With
    `stride`, sequence i's rows start at i * stride (a padded batch) instead of after the last's."""
    rows, start = [], 0
    for i, (n, k) in enumerate(zip(lengths, wanted)):
        if stride is not None:
            start = i * stride
        rows += range(start + n - min(k, n), start + n)
        start += n
    return rows


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)
