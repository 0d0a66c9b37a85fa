"""Paged KV cache: one pool of fixed-size blocks per layer and a block table per slot.

The leader's BlockManager decides which blocks a sequence owns; a rank only keeps each slot's
table, which a step extends by the block ids it carries (or restarts, on a sequence's first step).
Blocks holding a cached prompt prefix may sit in several tables at once; they are full and a step
never writes to them. Each rank tracks how many positions of every slot are filled, so a step
that would read positions nobody wrote, or write outside its blocks, is refused before any
collective runs: every rank sees the same request and refuses it the same way.

Pool layout `[kv_heads, num_blocks * block_size, head_dim]`: block b is rows b*block_size onwards
in every head. Gathering a sequence's rows along dim 1 yields `[kv_heads, tokens, head_dim]`, the
layout attention takes, in a single `index_select` with no transpose or second copy after it (the
per-token decode overhead stays that of a contiguous cache). On that gather path each slot keeps
the pool row of every one of its positions (`slot_rows`), extended when its table grows, so a step
finds its rows by slicing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from neuron.errors import ConfigError, NeuronError
from neuron.layers.paged_attention import PagedAttentionMetadata, attend, build_step
from neuron.step import SeqStep
from neuron.utils.device import Staging, to_device

_MIB = 2**20


class StepRejected(NeuronError):
    """A step that does not fit the KV cache (bad slot or block, gap in positions, past the model length)."""


@dataclass(slots=True)
class StepBatch:
    """The tokens of all sequences of a step, flattened, with what attention needs to split them."""

    token_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    write_rows: torch.Tensor | int  # [T] pool row of each new token (an int for a lone decode token)
    slots: list[int]
    lengths: list[int]  # new tokens per sequence
    kv_lens: list[int]  # filled positions of each sequence after this step
    last_index: torch.Tensor | None  # [B] each sequence's last token in the flat batch (prefill steps)
    all_decode: bool  # every sequence brings exactly one token
    read_rows: list[torch.Tensor]  # pool rows to attend over: decode, one [B, L] (padded; [L] for a lone
    # sequence); prefill, [kv_len] per sequence
    masks: list[torch.Tensor | None]  # decode: one padding mask or None; prefill: a causal mask per sequence
    paged: PagedAttentionMetadata | None = None  # the flat step for attention that reads blocks in place
    prompt_topk: list[int | None] | None = None  # per sequence: top-k of its chunk's prompt logprobs, if asked
    prompt_out: dict | None = None  # rank 0: PromptChunkLogprobs by sequence index, filled by the forward


class PagedKVCache:
    """K and V block pools per layer plus each slot's block table and filled length."""

    def __init__(self, layers: int, num_blocks: int, block_size: int, slots: int, max_len: int,
                 kv_heads: int, head_dim: int, dtype, device, paged: bool = True):
        # `paged` adds one block past those the leader hands out: padding rows of a captured decode
        # step (neuron/models/cuda_graphs.py) write and read there, never in a sequence's blocks.
        shape = (kv_heads, (num_blocks + paged) * block_size, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.num_blocks, self.block_size, self.max_len = num_blocks, block_size, max_len
        self.device = device
        self.tables: list[list[int]] = [[] for _ in range(slots)]
        self.filled = [0] * slots
        # the gather path's pool row of every position of every slot; the paged path reads the tables
        self.slot_rows = None if paged else torch.zeros((slots, blocks_for(max_len, block_size) * block_size),
                                                        dtype=torch.long, device=device)
        self._block_offsets = torch.arange(block_size, device=device)
        # `paged`: attention reads each sequence's blocks where they lie (the Triton kernel on CUDA,
        # the C++ kernel on CPU), from one flat description of the step; the block tables are
        # mirrored host-side for it. Otherwise the gather path, kept as a reference for tests.
        self.paged = paged
        self.table_array = np.zeros((slots, blocks_for(max_len, block_size)), dtype=np.int32)
        self.staging = Staging(device)  # a paged step's host data crosses to the device in one copy
        self.scratch_block = num_blocks

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
            ends.append(len(flat_ids) - 1)
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
        meta, token_ids, positions = build_step(self.table_array[slots], offsets, lengths, self.block_size,
                                                self.staging, ids)
        all_decode = all(n == 1 for n in lengths)
        last_index = None if all_decode else meta.query_start[1:].long() - 1
        return StepBatch(token_ids, positions, meta.slot_mapping, slots, lengths,
                         [o + n for o, n in zip(offsets, lengths)], last_index, all_decode, [], [], meta)

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

    # ---- the forward's part ----

    def write(self, layer: int, batch: StepBatch, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store this step's keys and values ([T, kv_heads, head_dim]) in their blocks."""
        if isinstance(batch.write_rows, int):
            self.k[layer][:, batch.write_rows] = k[0]
            self.v[layer][:, batch.write_rows] = v[0]
            return
        self.k[layer].index_copy_(1, batch.write_rows, k.transpose(0, 1))
        self.v[layer].index_copy_(1, batch.write_rows, v.transpose(0, 1))

    def attend(self, layer: int, batch: StepBatch, q: torch.Tensor) -> torch.Tensor:
        """Causal attention of this step's queries ([T, heads, head_dim]) over each sequence's blocks."""
        k_pool, v_pool = self.k[layer], self.v[layer]
        if batch.paged is not None:
            return attend(q, k_pool, v_pool, batch.paged)
        if batch.all_decode:
            rows = batch.read_rows[0]
            k, v = _gather(k_pool, rows), _gather(v_pool, rows)
            return F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=batch.masks[0],
                                                  enable_gqa=True)[:, :, 0]
        out = []
        start = 0
        for rows, mask, n in zip(batch.read_rows, batch.masks, batch.lengths):
            qi = q[start : start + n].transpose(0, 1).unsqueeze(0)
            k, v = _gather(k_pool, rows), _gather(v_pool, rows)
            o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, is_causal=mask is None and n > 1,
                                               enable_gqa=True)
            out.append(o[0].transpose(0, 1))
            start += n
        return out[0] if len(out) == 1 else torch.cat(out)


def _gather(pool: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The pool rows of each sequence ([B, L], or [L] for one) as [B, kv_heads, L, head_dim]."""
    if rows.dim() == 1:
        return pool.index_select(1, rows).unsqueeze(0)
    b, length = rows.shape
    return pool.index_select(1, rows.view(-1)).view(pool.shape[0], b, length, pool.shape[2]).transpose(0, 1)


def _causal_mask(n: int, offset: int, device) -> torch.Tensor:
    rows = torch.arange(n, device=device)[:, None] + offset
    cols = torch.arange(offset + n, device=device)[None, :]
    return cols <= rows


# ---- sizing ----


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def plan_num_blocks(block_bytes: int, block_size: int, *, max_slots: int, max_model_len: int, kv_cache_bytes: int,
                    gpu_memory_utilization: float, activation_reserve: int, device: torch.device) -> int:
    """How many KV blocks this rank allocates: an explicit byte budget if given; on CUDA what its
    share of the device leaves after what this process has allocated (the weights) and the
    activation reserve, never more than is free now (counting what its allocator caches); on CPU
    room for `max_slots` full-length sequences, as a preallocated cache would hold."""
    if kv_cache_bytes > 0:
        return kv_cache_bytes // block_bytes
    if device.type != "cuda":
        return max_slots * blocks_for(max_model_len, block_size)
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    free, total = torch.cuda.mem_get_info(device)
    allocated = torch.cuda.memory_allocated(device)
    # The caching allocator keeps a freed model's blocks reserved; it hands them out again, and
    # frees them back to the driver when a request fits none of them, so they count as available.
    cached = max(torch.cuda.memory_reserved(device) - allocated, 0)
    budget = min(total * gpu_memory_utilization - allocated, free + cached) - activation_reserve
    num_blocks = int(budget // block_bytes)
    if num_blocks <= 0:
        raise ConfigError(
            f"no GPU memory left for the KV cache on {device}: {free / _MIB:.0f} MiB free of {total / _MIB:.0f} MiB, "
            f"this rank has {allocated / _MIB:.0f} MiB allocated and {cached / _MIB:.0f} MiB cached for reuse, "
            f"and reserves {activation_reserve / _MIB:.0f} MiB for activations; "
            "raise --gpu-memory-utilization, use more ranks, or lower --max-num-batched-tokens")
    return num_blocks
