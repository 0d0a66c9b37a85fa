"""Paged KV cache storage: one pool of fixed-size blocks per layer, and the forward's two uses of
it, writing a step's keys and values and attending over each sequence's blocks.

Pool layout `[kv_heads, num_blocks * block_size, head_dim]`: block b is rows b*block_size onwards
in every head. Which blocks belong to which sequence, and the step's rows and metadata, are the
model runner's (neuron/worker/step_input.py), as is how many blocks a rank allocates
(neuron/worker/kv_pool.py); the pools only store. Gathering a sequence's rows along
dim 1 (the reference path) yields `[kv_heads, tokens, head_dim]`, the layout attention takes, in a
single `index_select` with no transpose or second copy after it.
"""

from __future__ import annotations

import math
import mmap

import torch
import torch.nn.functional as F

from neuron.layers.kernels import Kernels
from neuron.layers.paged_attention import attend
from neuron.models.inputs import KeptRows, StepBatch


def zeroed_pool(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """A pool of zeros. On CPU it is an anonymous mapping, whose pages the operating system hands
    out zero-filled when first written, so a rank neither writes nor holds the cache it sizes for
    max_num_seqs full-length sequences before requests fill it: torch.zeros wrote all of it at
    start, 18 GB for SmolLM2 at 6,200 positions x 64 sequences, in 27 s. The mapping is not advised
    for huge pages (numpy's zeros is, and its first touches ran 11 % slower over an offline run)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # private: a shared anonymous mapping (mmap's default) is backed by shmem, whose first touches cost more
    try:
        pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as exc:  # the errno stays, so a shortage is still told apart from other failures
        raise OSError(exc.errno, f"cannot map {nbytes} bytes for a KV cache pool of shape {tuple(shape)}: "
                                 f"{exc.strerror}") from exc
    return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(shape)


class PagedKVCache:
    """K and V block pools per layer."""

    def __init__(self, layers: int, num_blocks: int, block_size: int, max_len: int, kv_heads: int, head_dim: int,
                 dtype, device, kernels: Kernels):
        # The paged path adds one block past those the leader hands out: padding rows of a captured
        # decode step (neuron/worker/cuda_graphs.py) write and read there, never in a sequence's blocks.
        paged = kernels.paged
        shape = (kv_heads, (num_blocks + paged) * block_size, head_dim)
        self.k = [zeroed_pool(shape, dtype, device) for _ in range(layers)]
        self.v = [zeroed_pool(shape, dtype, device) for _ in range(layers)]
        self.num_blocks, self.block_size, self.max_len = num_blocks, block_size, max_len
        self.device = device
        self.paged = paged  # attention reads blocks in place (the kernels); else the gather reference
        self.kernels = kernels
        self.scratch_block = num_blocks

    # ---- what a model adds to the step's checks and bookkeeping (a hybrid model's recurrent state) ----

    def check(self, seqs: list, vocab_size: int) -> None:
        """Refuse what the block tables cannot see; nothing for KV blocks alone."""

    def begin(self, seqs: list) -> None:
        """A step starts."""

    def commit(self, batch: StepBatch) -> None:
        """The step's forward completed."""

    def clear(self, slots: list[int] | None) -> None:
        """The slots' sequences are gone; the blocks' contents stay (the leader may still reuse them)."""

    # ---- the forward's part ----

    def write(self, layer: int, batch: StepBatch, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store this step's keys and values ([T, kv_heads, head_dim]) in their blocks."""
        if isinstance(batch.write_rows, int):
            self.k[layer][:, batch.write_rows] = k[0]
            self.v[layer][:, batch.write_rows] = v[0]
            return
        dtype = self.k[layer].dtype  # a cache narrower than the model rounds them here
        self.k[layer].index_copy_(1, batch.write_rows, k.transpose(0, 1).to(dtype))
        self.v[layer].index_copy_(1, batch.write_rows, v.transpose(0, 1).to(dtype))

    def attend(self, layer: int, batch: StepBatch, q: torch.Tensor, kept: KeptRows | None = None) -> torch.Tensor:
        """Causal attention of this step's queries ([T, heads, head_dim]) over each sequence's blocks;
        with `kept`, of those rows' queries alone ([len(kept.index), heads, head_dim])."""
        k_pool, v_pool = self.k[layer], self.v[layer]
        paged = batch.paged if kept is None else kept.paged
        if paged is not None:
            return attend(self.kernels, q, k_pool, v_pool, paged)
        if batch.all_decode:
            rows = batch.read_rows[0]
            k, v = _gather(k_pool, rows).to(q.dtype), _gather(v_pool, rows).to(q.dtype)
            return F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=batch.masks[0],
                                                  enable_gqa=True)[:, :, 0]
        out = []
        start = 0
        for rows, mask, n in zip(batch.read_rows, batch.masks, batch.lengths):
            qi = q[start : start + n].transpose(0, 1).unsqueeze(0)
            k, v = _gather(k_pool, rows).to(q.dtype), _gather(v_pool, rows).to(q.dtype)
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
