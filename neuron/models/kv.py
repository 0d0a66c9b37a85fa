"""Per-slot KV cache and the flattened description of one batched step.

A slot belongs to exactly one sequence (the scheduler assigns slots). Each rank tracks how many
positions of every slot are filled, so a step that would read positions nobody wrote is refused
before any collective runs: every rank sees the same request and refuses it the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from neuron.errors import NeuronError


class StepRejected(NeuronError):
    """A step that does not fit the KV cache (bad slot, gap in positions, past the model length)."""


@dataclass(slots=True)
class StepBatch:
    """The tokens of all sequences of a step, flattened, with what attention needs to split them."""

    token_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_of_token: torch.Tensor  # [T]
    slots: list[int]
    offsets: list[int]
    lengths: list[int]  # new tokens per sequence
    last_index: torch.Tensor  # [B] index of each sequence's last token in the flat batch
    all_decode: bool  # every sequence brings exactly one token
    slots_t: torch.Tensor  # [B]
    kv_len: torch.Tensor  # [B] filled positions after this step

    @classmethod
    def build(cls, seqs: list[tuple[int, list[int], int]], device: torch.device) -> "StepBatch":
        slots = [s for s, _, _ in seqs]
        offsets = [o for _, _, o in seqs]
        lengths = [len(ids) for _, ids, _ in seqs]
        flat_ids = [t for _, ids, _ in seqs for t in ids]
        if len(lengths) == len(flat_ids):  # decode: one token per sequence
            positions, slot_of_token = offsets, slots
        else:
            positions = [o + i for o, n in zip(offsets, lengths) for i in range(n)]
            slot_of_token = [s for s, n in zip(slots, lengths) for _ in range(n)]
        ends, total = [], 0
        for n in lengths:
            total += n
            ends.append(total - 1)
        per_token = torch.tensor([flat_ids, positions, slot_of_token], dtype=torch.long, device=device)
        kv_len = [o + n for o, n in zip(offsets, lengths)]
        per_seq = torch.tensor([ends, slots, kv_len], dtype=torch.long, device=device)
        return cls(
            token_ids=per_token[0],
            positions=per_token[1],
            slot_of_token=per_token[2],
            slots=slots,
            offsets=offsets,
            lengths=lengths,
            last_index=per_seq[0],
            all_decode=len(lengths) == len(flat_ids),
            slots_t=per_seq[1],
            kv_len=per_seq[2],
        )


class KVCache:
    """Preallocated K and V per layer: [slots, kv_heads, max_len, head_dim]."""

    def __init__(self, layers: int, slots: int, max_len: int, kv_heads: int, head_dim: int, dtype, device):
        shape = (slots, kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.max_len = max_len
        self.filled = [0] * slots

    @property
    def num_slots(self) -> int:
        return len(self.filled)

    def check(self, seqs: list[tuple[int, list[int], int]], vocab_size: int) -> None:
        """Refuse a step that would corrupt or misread the cache; raises StepRejected."""
        seen = set()
        for slot, ids, offset in seqs:
            if not 0 <= slot < self.num_slots:
                raise StepRejected(f"slot {slot} out of range (0..{self.num_slots - 1})")
            if slot in seen:
                raise StepRejected(f"slot {slot} appears twice in one step")
            seen.add(slot)
            if not ids:
                raise StepRejected(f"slot {slot}: a step needs at least one token")
            if offset < 0 or offset > self.filled[slot]:
                raise StepRejected(f"slot {slot}: offset {offset} but only {self.filled[slot]} positions filled")
            if offset + len(ids) > self.max_len:
                raise StepRejected(f"slot {slot}: {offset + len(ids)} positions exceed max_model_len {self.max_len}")
            if min(ids) < 0 or max(ids) >= vocab_size:
                raise StepRejected(f"slot {slot}: token id outside the vocabulary (0..{vocab_size - 1})")

    def commit(self, batch: StepBatch) -> None:
        for slot, offset, n in zip(batch.slots, batch.offsets, batch.lengths):
            self.filled[slot] = offset + n

    def clear(self, slots: list[int] | None) -> None:
        for slot in range(self.num_slots) if slots is None else slots:
            if not 0 <= slot < self.num_slots:
                raise StepRejected(f"slot {slot} out of range (0..{self.num_slots - 1})")
            self.filled[slot] = 0

    def write(self, layer: int, batch: StepBatch, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store this step's keys and values ([T, kv_heads, head_dim]) at their slots and positions."""
        if batch.all_decode and len(batch.slots) == 1:
            slot, pos = batch.slots[0], batch.offsets[0]
            self.k[layer][slot, :, pos] = k[0]
            self.v[layer][slot, :, pos] = v[0]
            return
        self.k[layer][batch.slot_of_token, :, batch.positions] = k
        self.v[layer][batch.slot_of_token, :, batch.positions] = v

    def attend(self, layer: int, batch: StepBatch, q: torch.Tensor) -> torch.Tensor:
        """Causal attention of this step's queries ([T, heads, head_dim]) over each slot's cache."""
        if batch.all_decode:
            return self._attend_decode(layer, batch, q)
        out = []
        start = 0
        for slot, offset, n in zip(batch.slots, batch.offsets, batch.lengths):
            qi = q[start : start + n].transpose(0, 1).unsqueeze(0)
            k = self.k[layer][slot : slot + 1, :, : offset + n]
            v = self.v[layer][slot : slot + 1, :, : offset + n]
            if offset == 0:
                o = F.scaled_dot_product_attention(qi, k, v, is_causal=n > 1, enable_gqa=True)
            else:
                mask = _causal_mask(n, offset, q.device)
                o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, enable_gqa=True)
            out.append(o[0].transpose(0, 1))
            start += n
        return out[0] if len(out) == 1 else torch.cat(out)

    def _attend_decode(self, layer: int, batch: StepBatch, q: torch.Tensor) -> torch.Tensor:
        qb = q.unsqueeze(2)  # [B, heads, 1, d]
        if len(batch.slots) == 1:
            slot, end = batch.slots[0], batch.offsets[0] + 1
            k = self.k[layer][slot : slot + 1, :, :end]
            v = self.v[layer][slot : slot + 1, :, :end]
            return F.scaled_dot_product_attention(qb, k, v, enable_gqa=True)[:, :, 0]
        end = max(batch.offsets) + 1
        k = self.k[layer][batch.slots_t, :, :end]
        v = self.v[layer][batch.slots_t, :, :end]
        mask = (torch.arange(end, device=q.device) < batch.kv_len[:, None])[:, None, None, :]
        return F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, enable_gqa=True)[:, :, 0]


def _causal_mask(n: int, offset: int, device) -> torch.Tensor:
    rows = torch.arange(n, device=device)[:, None] + offset
    cols = torch.arange(offset + n, device=device)[None, :]
    return cols <= rows
