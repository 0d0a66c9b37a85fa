"""The Triton kernel behind `neuron.layers.paged_attention` (its docstring explains the design).

Kept apart so that only launching a kernel imports Triton: Triton decides when it is first
imported, for the whole process, whether kernels compile for the GPU or run in its interpreter
(TRITON_INTERPRET), and importing the model code must not make that choice early.
"""

import triton
import triton.language as tl


@triton.jit
def _attend_tile(q, m, l, acc, k_ptr, v_ptr, table_ptr, kv_base, stride_kr, pos, pos_ok, visible, dims, head_dim,
                 scale, BLOCK_SIZE: tl.constexpr, PRECISION: tl.constexpr):
    """One tile of key positions `pos` (those in the sequence: `pos_ok`) folded into the rows' online
    softmax (running max `m` and sum `l` in log2 units, unnormalised output `acc`); `visible` masks
    the scores a row may not see. Each position's pool row is found through the sequence's block
    table (`table_ptr`), so tiles need not align with KV blocks."""
    block = tl.load(table_ptr + pos // BLOCK_SIZE, mask=pos_ok, other=0)
    kv_rows = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
    kv_off = kv_base + kv_rows[:, None] * stride_kr + dims[None, :]
    kv_mask = pos_ok[:, None] & (dims < head_dim)[None, :]
    k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # log2 units: scale holds log2(e)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)
    v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l, acc


@triton.jit
def paged_attention_kernel(
    out_ptr, q_ptr, k_ptr, v_ptr, tables_ptr, query_start_ptr, kv_lens_ptr,
    scale, group, head_dim, stride_qt, stride_qh, stride_ot, stride_oh, stride_kh, stride_kr, stride_table,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, GROUP_P: tl.constexpr, HEAD_P: tl.constexpr,
    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    """One program: a tile of one sequence's queries times the query heads of one KV head."""
    seq, tile, kv_head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_begin = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_begin
    if tile * (BLOCK_M // GROUP_P) >= q_len:
        return
    kv_len = tl.load(kv_lens_ptr + seq)
    rows = tl.arange(0, BLOCK_M)
    q_idx = tile * (BLOCK_M // GROUP_P) + rows // GROUP_P  # row -> (query, head of the group)
    head = kv_head * group + rows % GROUP_P
    dims = tl.arange(0, HEAD_P)
    row_ok = (q_idx < q_len) & (rows % GROUP_P < group)
    q_mask = row_ok[:, None] & (dims < head_dim)[None, :]
    token = (q_begin + q_idx).to(tl.int64)
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :], mask=q_mask, other=0.0)
    q_pos = kv_len - q_len + q_idx  # each query's position in its sequence
    # -1e30, not -inf: a row with no visible key yet must not compute inf - inf
    m = tl.full([BLOCK_M], -1e30, tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_P], tl.float32)
    kv_end = tl.minimum(kv_len, tl.max(tl.where(row_ok, q_pos, 0)) + 1)  # causal: no row sees further
    kv_base = kv_head.to(tl.int64) * stride_kh
    for start in range(0, kv_end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        m, l, acc = _attend_tile(q, m, l, acc, k_ptr, v_ptr, tables_ptr + seq * stride_table, kv_base, stride_kr,
                                 pos, pos < kv_end, pos[None, :] <= q_pos[:, None], dims, head_dim, scale,
                                 BLOCK_SIZE, PRECISION)
    out = acc / tl.where(l > 0, l, 1.0)[:, None]  # padding rows have l == 0 and are not stored
    out_off = token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
    tl.store(out_ptr + out_off, out.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def paged_attention_split_kernel(
    part_acc_ptr, part_ml_ptr, q_ptr, k_ptr, v_ptr, tables_ptr, query_start_ptr, kv_lens_ptr,
    scale, group, num_heads, head_dim, split_len, stride_qt, stride_qh, stride_kh, stride_kr, stride_table,
    SPLITS: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_P: tl.constexpr,
    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    """Decode, split over the keys (flash-decoding): one program per (sequence, KV head, split of
    its positions) attends the sequence's one query, all heads of the group together, over
    `split_len` positions, and stores its partial softmax state: running max and sum (log2 units)
    and the unnormalised output. `split_combine_kernel` merges the splits."""
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    token = tl.load(query_start_ptr + seq).to(tl.int64)  # a decode step: one query per sequence
    kv_len = tl.load(kv_lens_ptr + seq)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < group
    head = kv_head * group + rows
    dims = tl.arange(0, HEAD_P)
    q_mask = row_ok[:, None] & (dims < head_dim)[None, :]
    q = tl.load(q_ptr + token * stride_qt + head[:, None] * stride_qh + dims[None, :], mask=q_mask, other=0.0)
    m = tl.full([BLOCK_M], -1e30, tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_P], tl.float32)
    start = split * split_len
    end = tl.minimum(start + split_len, kv_len)
    kv_base = kv_head.to(tl.int64) * stride_kh
    for tile in range(start, end, BLOCK_N):
        pos = tile + tl.arange(0, BLOCK_N)
        pos_ok = pos < end
        m, l, acc = _attend_tile(q, m, l, acc, k_ptr, v_ptr, tables_ptr + seq * stride_table, kv_base, stride_kr,
                                 pos, pos_ok, pos_ok[None, :], dims, head_dim, scale, BLOCK_SIZE, PRECISION)
    part = (seq * num_heads + head).to(tl.int64) * SPLITS + split  # [BLOCK_M]
    tl.store(part_ml_ptr + part * 2, m, mask=row_ok)
    tl.store(part_ml_ptr + part * 2 + 1, l, mask=row_ok)
    tl.store(part_acc_ptr + part[:, None] * HEAD_P + dims[None, :], acc, mask=row_ok[:, None])


@triton.jit
def split_combine_kernel(
    out_ptr, part_acc_ptr, part_ml_ptr, query_start_ptr, num_heads, head_dim, stride_ot, stride_oh,
    SPLITS: tl.constexpr, HEAD_P: tl.constexpr,
):
    """One program per (sequence, head): the splits' partial states merged into the output, each
    weighted by 2^(its max - the overall max). A split past the sequence's end has sum 0 and adds nothing."""
    seq, head = tl.program_id(0), tl.program_id(1)
    token = tl.load(query_start_ptr + seq).to(tl.int64)
    part = (seq * num_heads + head).to(tl.int64) * SPLITS + tl.arange(0, SPLITS)
    m = tl.load(part_ml_ptr + part * 2)
    l = tl.load(part_ml_ptr + part * 2 + 1)
    weight = tl.exp2(m - tl.max(m, 0))
    dims = tl.arange(0, HEAD_P)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_P + dims[None, :])
    out = tl.sum(acc * weight[:, None], 0) / tl.sum(l * weight, 0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < head_dim)
