"""Attention over the paged KV cache, reading each sequence's blocks where they lie in the pool.

A step is one flat batch of `T` query tokens (prefill chunks and decodes mixed) over `B`
sequences. `PagedAttentionMetadata` describes it once per step: where each sequence's queries
start in the flat batch, how many positions each sequence holds after the step, its block table,
and the pool row of every new token. The pools are a layer's `[kv_heads, num_blocks * block_size,
head_dim]` K and V tensors (block b is rows b*block_size onwards in every head).

Three implementations share that interface: a pure PyTorch reference (gather each context, then
SDPA), the oracle the kernels are tested against and the fallback; a Triton kernel for CUDA (in
`triton_attention`, imported on first launch); and a C++/OpenMP kernel for CPU (`cpu_attention`,
built once per machine). Neither kernel copies a context out of the pool. `attend` picks.

Triton kernel design: one program per (sequence, tile of the sequence's queries, KV head). The program's
rows are the tile's queries times the query heads that share the KV head (GQA), so every KV tile
is loaded once for the whole group and the score product is a matrix product with at least 16 rows
(a tensor-core shape) even for a lone decode token; one program per (token, head) would load each
KV tile once per head and per query, with vector arithmetic only. The program walks the sequence's positions in
tiles of `BLOCK_N`, finds each position's pool row through the block table (so tiles need not
align with KV blocks, and any block size works), and keeps a flash-style online softmax in fp32.
Programs whose query tile lies past their sequence's queries return at once: the grid is
(B, tiles of the longest query, kv_heads), which costs a few idle programs in mixed steps but
needs no per-step tile table and keeps a decode step's grid fixed for a batch size. A decode step
with few sequences and long contexts runs only B x kv_heads programs; splitting the keys over more
programs (flash-decoding) is the next step there.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from neuron.layers import cpu_attention
from neuron.layers.kernels import Kernels
from neuron.utils.device import Staging

# Looked up, not imported: see `_kernel`. CPU installs need not have Triton; the reference serves them.
HAS_TRITON = importlib.util.find_spec("triton") is not None

# Rows of a program (queries x heads of a group): at least a tensor-core tile, at most what keeps
# a prefill chunk spread over many programs.
_MIN_ROWS, _MAX_ROWS = 16, 64
_BLOCK_N = 32  # key positions per inner-loop tile
_LOG2E = 1.4426950408889634


@dataclass(slots=True)
class PagedAttentionMetadata:
    """What attention needs to split a step's flat batch into sequences and find their KV rows."""

    query_start: torch.Tensor  # int32 [B+1]: where each sequence's queries start in the flat batch
    kv_lens: torch.Tensor  # int32 [B]: positions filled after this step, the new tokens included
    block_tables: torch.Tensor  # int32 [B, max_blocks]: each sequence's blocks, padded with 0; as many
    # columns as the longest context fills
    slot_mapping: torch.Tensor  # int64 [T]: the pool row each new token's key and value go to
    block_size: int
    max_query_len: int
    max_kv_len: int

    @property
    def num_seqs(self) -> int:
        return self.kv_lens.shape[0]


def build_metadata(block_tables: list[list[int]] | np.ndarray, offsets: list[int], query_lens: list[int],
                   block_size: int, device) -> PagedAttentionMetadata:
    """The step's metadata from per-sequence host data: each sequence's block table (lists, or the
    rows of a table the caller keeps as an int32 array), the position its new tokens start at, and
    how many it brings (see `build_step`)."""
    return build_step(block_tables, offsets, query_lens, block_size, Staging(device))[0]


def build_step(block_tables: list[list[int]] | np.ndarray, offsets: list[int], query_lens: list[int],
               block_size: int, staging: Staging, token_ids: list[int] | None = None,
               ) -> tuple[PagedAttentionMetadata, torch.Tensor | None, torch.Tensor]:
    """The step's metadata, its token ids (when given) and every token's position, all computed on
    the host with numpy (no Python loop over tokens; torch's CPU repeat_interleave costs
    milliseconds here) and crossing to the device in one copy (`staging`). The caller has checked
    that every table covers its sequence's positions (the KV cache refuses steps that do not)."""
    lens = np.asarray(query_lens, dtype=np.int64)
    query_start = np.zeros(len(lens) + 1, dtype=np.int32)
    np.cumsum(lens, out=query_start[1:])
    kv_lens = (np.asarray(offsets, dtype=np.int64) + lens).astype(np.int32)
    tables = _padded_tables(block_tables, -(-int(kv_lens.max()) // block_size))
    seq = np.repeat(np.arange(len(lens)), lens)
    positions = np.arange(seq.shape[0]) + np.repeat(kv_lens - lens - query_start[:-1], lens)
    slot_mapping = tables[seq, positions // block_size].astype(np.int64) * block_size + positions % block_size
    ids = np.asarray(token_ids if token_ids is not None else [], dtype=np.int64)
    starts, filled, flat_tables, rows, where, tokens = staging.send(
        [query_start, kv_lens, tables, slot_mapping, positions, ids])
    meta = PagedAttentionMetadata(starts, filled, flat_tables.view(tables.shape), rows.long(), block_size,
                                  int(lens.max()), int(kv_lens.max()))
    return meta, (tokens.long() if token_ids is not None else None), where.long()


def last_queries(meta: PagedAttentionMetadata, counts: list[int], rows: torch.Tensor) -> PagedAttentionMetadata:
    """The step's metadata with each sequence's last `counts[i]` queries alone (`rows`: their places
    in the flat batch, in order). Its keys are the step's: those queries keep their positions, the
    last ones of each sequence."""
    starts = np.zeros(len(counts) + 1, dtype=np.int32)
    np.cumsum(counts, out=starts[1:])
    return PagedAttentionMetadata(torch.from_numpy(starts).to(meta.query_start.device), meta.kv_lens,
                                  meta.block_tables, meta.slot_mapping[rows], meta.block_size, max(counts),
                                  meta.max_kv_len)


def _padded_tables(block_tables: list[list[int]] | np.ndarray, width: int) -> np.ndarray:
    """[B, width] int32, width the blocks the longest sequence uses: columns past it are never read,
    so they need not cross to the device."""
    if isinstance(block_tables, np.ndarray):
        return np.ascontiguousarray(block_tables[:, :width], dtype=np.int32)
    tables = np.zeros((len(block_tables), width), dtype=np.int32)
    for row, table in zip(tables, block_tables):
        row[: min(len(table), width)] = table[:width]
    return tables


def write_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store the step's keys and values ([T, kv_heads, head_dim]) at their pool rows. Every new
    token has a row of its own, so the scattered writes never collide."""
    k_pool.index_copy_(1, slot_mapping, k.transpose(0, 1))
    v_pool.index_copy_(1, slot_mapping, v.transpose(0, 1))


# ---- the reference ----


def paged_attention_reference(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                              meta: PagedAttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention of the step's queries ([T, heads, head_dim]) by gathering each sequence's
    context and running SDPA; a sequence's queries sit at its last `query_len` positions."""
    out = torch.empty_like(q)
    starts, kv_lens = meta.query_start.tolist(), meta.kv_lens.tolist()
    for i, kv_len in enumerate(kv_lens):
        begin, end = starts[i], starts[i + 1]
        rows = _context_rows(meta.block_tables[i], kv_len, meta.block_size)
        k = k_pool.index_select(1, rows).unsqueeze(0).to(q.dtype)  # a 16-bit cache widened
        v = v_pool.index_select(1, rows).unsqueeze(0).to(q.dtype)
        qi = q[begin:end].transpose(0, 1).unsqueeze(0)
        mask = _causal_mask(end - begin, kv_len, q.device)
        o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[begin:end] = o[0].transpose(0, 1)
    return out


def _context_rows(table: torch.Tensor, kv_len: int, block_size: int) -> torch.Tensor:
    positions = torch.arange(kv_len, device=table.device)
    return table.long()[positions // block_size] * block_size + positions % block_size


def _causal_mask(query_len: int, kv_len: int, device) -> torch.Tensor:
    """[query_len, kv_len]: query i (at position kv_len - query_len + i) sees positions up to its own."""
    rows = torch.arange(query_len, device=device)[:, None] + (kv_len - query_len)
    return torch.arange(kv_len, device=device)[None, :] <= rows


# ---- the kernel ----


def _kernel():
    """The jitted kernel, imported on first launch (see triton_attention's docstring)."""
    from neuron.layers.triton_attention import paged_attention_kernel

    return paged_attention_kernel


def paged_attention_triton(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                           meta: PagedAttentionMetadata, scale: float) -> torch.Tensor:
    """The Triton kernel's causal attention of the step's queries ([T, heads, head_dim]); a decode
    step with too few (sequence, KV head) programs to fill the GPU splits its keys over more."""
    if meta.max_query_len == 1 and q.is_cuda:
        splits = decode_splits(meta.num_seqs * k_pool.shape[0], meta.max_kv_len, _multiprocessors(q.device))
        if splits > 1:
            return paged_attention_split(q, k_pool, v_pool, meta, scale, splits)
    tokens, heads, head_dim = q.shape
    kv_heads = k_pool.shape[0]
    _check_shapes(q, k_pool, v_pool)
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty((tokens, heads, head_dim), dtype=q.dtype, device=q.device)
    group = heads // kv_heads
    group_p, head_p = _next_power_of_2(group), _next_power_of_2(head_dim)
    max_rows, block_n = tiles(q.dtype, head_p)
    block_q = _queries_per_program(meta.max_query_len, group_p, max_rows)
    grid = (meta.num_seqs, -(-meta.max_query_len // block_q), kv_heads)
    precision = "ieee" if q.dtype == torch.float32 else None  # fp32 stays fp32, not TF32
    _kernel()[grid](
        out, q, k_pool, v_pool, meta.block_tables, meta.query_start, meta.kv_lens,
        scale * _LOG2E, group, head_dim, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_pool.stride(0), k_pool.stride(1), meta.block_tables.stride(0),
        BLOCK_SIZE=meta.block_size, BLOCK_M=block_q * group_p, GROUP_P=group_p,
        HEAD_P=head_p, BLOCK_N=block_n, PRECISION=precision)
    return out


_SPLIT_MIN_KEYS = 256  # positions a split gets at least: shorter ones cost more in the merge than they save
_MAX_SPLITS = 32


def decode_splits(programs: int, max_kv_len: int, multiprocessors: int) -> int:
    """How many splits of the keys a decode step's programs (sequence x KV head) take: enough for
    about two programs per multiprocessor, no split shorter than _SPLIT_MIN_KEYS positions; a
    power of two (the merge reads the splits as one tile); 1 when the GPU is full already."""
    if programs >= multiprocessors:
        return 1
    wanted = min(-(-2 * multiprocessors // programs), max_kv_len // _SPLIT_MIN_KEYS, _MAX_SPLITS)
    return 1 << max(wanted, 1).bit_length() - 1


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def paged_attention_split(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                          meta: PagedAttentionMetadata, scale: float, splits: int) -> torch.Tensor:
    """A decode step's attention (one query per sequence) with each sequence's keys in `splits`
    parts on programs of their own, merged after (flash-decoding)."""
    from neuron.layers.triton_attention import paged_attention_split_kernel, split_combine_kernel

    tokens, heads, head_dim = q.shape
    kv_heads = k_pool.shape[0]
    _check_shapes(q, k_pool, v_pool)
    if meta.max_query_len != 1:
        raise ValueError(f"split attention serves decode steps (one query per sequence), got {meta.max_query_len}")
    q = q if q.stride(-1) == 1 else q.contiguous()
    head_p = _next_power_of_2(head_dim)
    _, block_n = tiles(q.dtype, head_p)
    split_len = -(-(-(-meta.max_kv_len // splits)) // block_n) * block_n  # a whole number of key tiles
    part_acc = torch.empty((meta.num_seqs, heads, splits, head_p), dtype=torch.float32, device=q.device)
    part_ml = torch.empty((meta.num_seqs, heads, splits, 2), dtype=torch.float32, device=q.device)
    out = torch.empty((tokens, heads, head_dim), dtype=q.dtype, device=q.device)
    group = heads // kv_heads
    precision = "ieee" if q.dtype == torch.float32 else None
    paged_attention_split_kernel[(meta.num_seqs, kv_heads, splits)](
        part_acc, part_ml, q, k_pool, v_pool, meta.block_tables, meta.query_start, meta.kv_lens,
        scale * _LOG2E, group, heads, head_dim, split_len, q.stride(0), q.stride(1), k_pool.stride(0),
        k_pool.stride(1), meta.block_tables.stride(0), SPLITS=splits, BLOCK_SIZE=meta.block_size,
        BLOCK_M=max(_MIN_ROWS, _next_power_of_2(group)), HEAD_P=head_p, BLOCK_N=block_n, PRECISION=precision)
    split_combine_kernel[(meta.num_seqs, heads)](
        out, part_acc, part_ml, meta.query_start, heads, head_dim, out.stride(0), out.stride(1),
        SPLITS=splits, HEAD_P=head_p)
    return out


# Shared memory per block on the GPUs neuron supports (the opt-in maximum), by compute capability.
SHARED_MEMORY = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024, 100: 227 * 1024, 120: 99 * 1024}


def tiles(dtype: torch.dtype, head_p: int) -> tuple[int, int]:
    """(rows of a program at most, key positions per inner tile) for this dtype and padded head
    width. fp32 tiles of 256-wide heads take 137 KiB of shared memory at 64 x 32, more than the
    99 KiB of sm_86/89/120; at 32 x 16 they take 66 KiB. Every other combination fits at 64 x 32
    (tests/test_paged_attention.py compiles them all and checks against SHARED_MEMORY)."""
    if dtype == torch.float32 and head_p >= 256:
        return 32, 16
    return _MAX_ROWS, _BLOCK_N


def _queries_per_program(max_query_len: int, group_p: int, max_rows: int = _MAX_ROWS) -> int:
    """Queries per program, a power of two: as many as the longest query needs, within the row bounds."""
    wanted = _next_power_of_2(max_query_len)
    return max(1, min(wanted, max_rows // group_p), _MIN_ROWS // group_p)


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _check_shapes(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> None:
    """The kernel indexes the pools with K's strides and steps through head_dim one element at a time."""
    if k_pool.shape != v_pool.shape or k_pool.stride() != v_pool.stride():
        raise ValueError(f"K and V pools differ: {tuple(k_pool.shape)} {k_pool.stride()} vs "
                         f"{tuple(v_pool.shape)} {v_pool.stride()}")
    if k_pool.stride(-1) != 1 or k_pool.shape[-1] != q.shape[-1]:
        raise ValueError(f"pools need a contiguous head_dim of {q.shape[-1]}, got shape {tuple(k_pool.shape)} "
                         f"and strides {k_pool.stride()}")
    if q.shape[1] % k_pool.shape[0]:
        raise ValueError(f"{q.shape[1]} query heads do not split evenly over {k_pool.shape[0]} KV heads")


# ---- dispatch ----


def attend(kernels: Kernels, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
           meta: PagedAttentionMetadata, scale: float | None = None) -> torch.Tensor:
    """Causal attention of a step's queries over the paged cache: the Triton kernel for CUDA tensors
    when Triton is installed and `kernels` trusts it, the C++ kernel for CPU tensors once it is
    built here, the PyTorch reference otherwise. `scale` defaults to 1/sqrt(head_dim)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if q.is_cuda and HAS_TRITON and kernels.triton("paged_attention"):
        return paged_attention_triton(q, k_pool, v_pool, meta, scale)
    if k_pool.dtype == v_pool.dtype and cpu_attention.supports(q, k_pool.dtype):
        _check_shapes(q, k_pool, v_pool)
        return cpu_attention.paged_attention_cpu(q, k_pool, v_pool, meta.query_start, meta.kv_lens,
                                                 meta.block_tables, meta.block_size, scale)
    return paged_attention_reference(q, k_pool, v_pool, meta, scale)
