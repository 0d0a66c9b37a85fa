"""Paged attention: step metadata, KV writes, the PyTorch reference against plain SDPA, and the
Triton kernel against the reference. Without a GPU the kernel runs in Triton's interpreter on CPU
tensors; with one it compiles and runs on CUDA."""

import functools
import json
import textwrap

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from triton_interpret import DEVICE, compile_in_a_fresh_process, require_triton  # before anything loads Triton

from neuron.layers import cpu_attention
from neuron.layers.kernels import Kernels
from neuron.layers.paged_attention import (
    attend,
    build_metadata,
    last_queries,
    paged_attention_reference,
    paged_attention_split,
    paged_attention_triton,
    write_kv,
)

TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 2e-2}

# Decode-only: five sequences whose new token lands at the start, middle and end of a block; the
# last two share their first two blocks (a cached prefix).
DECODE = dict(offsets=[0, 15, 16, 40, 69], query_lens=[1, 1, 1, 1, 1], shared=(3, 4, 2))
# Mixed: a 37-token prefill chunk at offset 0; a 9-token chunk at offset 32 over a cached prefix
# (the first sequence's first two blocks); three decodes.
MIXED = dict(offsets=[0, 32, 5, 16, 47], query_lens=[37, 9, 1, 1, 1], shared=(0, 1, 2))


@pytest.fixture(scope="module")
def kernel():
    require_triton()
    return paged_attention_triton


@pytest.fixture(scope="module")
def cpu_kernel():
    """The C++ kernel with the Triton kernel's signature, built into the user's cache as in use."""
    if cpu_attention.library() is None:
        pytest.skip("the CPU attention kernel cannot be built here (no C++ compiler; see the warning)")

    def run(q, k_pool, v_pool, meta, scale):
        return cpu_attention.paged_attention_cpu(q, k_pool, v_pool, meta.query_start, meta.kv_lens,
                                                 meta.block_tables, meta.block_size, scale)
    return run


def make_step(offsets, query_lens, shared=None, *, heads=8, kv_heads=2, head_dim=64, block_size=16,
              dtype=torch.float32, device=DEVICE, seed=0):
    """Random pools, shuffled block tables (sequence b reuses a's first n blocks for shared=(a, b, n)),
    and the step's queries, with the new tokens' keys and values written through `write_kv`."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-(o + n) // block_size) for o, n in zip(offsets, query_lens)]
    free = torch.randperm(sum(need) + 4, generator=gen).tolist()
    tables = [[free.pop() for _ in range(n)] for n in need]
    if shared:
        a, b, n = shared
        tables[b][:n] = tables[a][:n]
    num_blocks = sum(need) + 4
    k_pool = torch.randn(kv_heads, num_blocks * block_size, head_dim, generator=gen)
    v_pool = torch.randn(kv_heads, num_blocks * block_size, head_dim, generator=gen)
    tokens = sum(query_lens)
    q = torch.randn(tokens, heads, head_dim, generator=gen)
    k, v = torch.randn(2, tokens, kv_heads, head_dim, generator=gen)
    meta = build_metadata(tables, offsets, query_lens, block_size, device)
    k_pool, v_pool, q, k, v = (t.to(device, dtype) for t in (k_pool, v_pool, q, k, v))
    write_kv(k_pool, v_pool, k, v, meta.slot_mapping)
    return q, k_pool, v_pool, meta


def assert_kernel_matches(kernel, q, k_pool, v_pool, meta, tolerance=None):
    scale = q.shape[-1] ** -0.5
    out = kernel(q, k_pool, v_pool, meta, scale)
    expected = paged_attention_reference(q.float(), k_pool.float(), v_pool.float(), meta, scale)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert (out.float() - expected).abs().max().item() <= (tolerance or TOLERANCE[q.dtype])


# ---- metadata and writes ----


@pytest.mark.parametrize("as_array", [False, True])
def test_metadata_for_a_hand_computed_step(as_array):
    """Block size 4. A 5-token prefill in blocks [3, 1]; a 2-token chunk at offset 6 in [0, 2, 5]
    (its third block not yet reached, so no column for it); a decode at offset 2 in [4]."""
    tables = [[3, 1, 0], [0, 2, 5], [4, 0, 0]]
    meta = build_metadata(np.array(tables, dtype=np.int32) if as_array else [[3, 1], [0, 2, 5], [4]],
                          [0, 6, 2], [5, 2, 1], 4, "cpu")
    assert meta.query_start.dtype == meta.kv_lens.dtype == meta.block_tables.dtype == torch.int32
    assert meta.slot_mapping.dtype == torch.int64
    assert meta.query_start.tolist() == [0, 5, 7, 8]
    assert meta.kv_lens.tolist() == [5, 8, 3]
    assert meta.block_tables.tolist() == [[3, 1], [0, 2], [4, 0]]
    assert meta.slot_mapping.tolist() == [12, 13, 14, 15, 4, 10, 11, 18]
    assert (meta.block_size, meta.max_query_len, meta.max_kv_len, meta.num_seqs) == (4, 5, 8, 3)


def test_write_kv_puts_each_token_at_its_row():
    k_pool, v_pool = torch.zeros(2, 2, 12, 4)
    k = torch.arange(3 * 2 * 4, dtype=torch.float32).view(3, 2, 4)
    write_kv(k_pool, v_pool, k, -k, torch.tensor([5, 0, 9]))
    expected = torch.zeros(2, 12, 4)
    for token, row in enumerate([5, 0, 9]):
        expected[:, row] = k[token]
    assert torch.equal(k_pool, expected)
    assert torch.equal(v_pool, -expected)


# ---- the reference (the kernel's oracle) ----


def test_reference_equals_causal_sdpa_over_contiguous_kv():
    """A whole 40-token prompt, and its last 9 tokens as a chunk over the first 31, against SDPA
    on the same keys and values laid out contiguously."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(40, 12, 64, generator=gen).split([8, 2, 2], dim=1)
    k_pool, v_pool = torch.zeros(2, 2, 6 * 16, 64)
    table = [4, 0, 5]
    write_kv(k_pool, v_pool, k, v, build_metadata([table], [0], [40], 16, "cpu").slot_mapping)
    expected = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                              is_causal=True, enable_gqa=True).transpose(0, 1)
    whole = paged_attention_reference(q, k_pool, v_pool, build_metadata([table], [0], [40], 16, "cpu"), 0.125)
    chunk = paged_attention_reference(q[31:], k_pool, v_pool, build_metadata([table], [31], [9], 16, "cpu"), 0.125)
    torch.testing.assert_close(whole, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunk, expected[31:], atol=1e-5, rtol=1e-5)


def test_dispatch_uses_the_cpu_kernel_off_cuda(cpu_kernel):
    q, k_pool, v_pool, meta = make_step(**MIXED, device="cpu")
    assert torch.equal(attend(Kernels(), q, k_pool, v_pool, meta), cpu_kernel(q, k_pool, v_pool, meta, 0.125))


# ---- the kernel ----

# A group of 5 (Qwen3-14B's 40 over 8) pads to 8 rows per query inside the kernel.
LAYOUTS = {"gqa": dict(heads=8, kv_heads=2), "mha": dict(heads=4, kv_heads=4), "gqa5": dict(heads=10, kv_heads=2)}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_kernel_decode_batch(kernel, layout, head_dim):
    assert_kernel_matches(kernel, *make_step(**DECODE, **LAYOUTS[layout], head_dim=head_dim))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_kernel_mixed_batch(kernel, layout, head_dim):
    assert_kernel_matches(kernel, *make_step(**MIXED, **LAYOUTS[layout], head_dim=head_dim))


# bfloat16 only compiled: Triton's interpreter multiplies bfloat16 tiles as their raw uint16 bits in tl.dot.
@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)])
def test_kernel_half_precision(kernel, dtype):
    assert_kernel_matches(kernel, *make_step(**MIXED, dtype=dtype))


def test_kernel_odd_head_dim_and_block_size(kernel):
    """head_dim 80 (padded to 128 inside) and 8-position blocks (a key tile spans four)."""
    assert_kernel_matches(kernel, *make_step(**MIXED, head_dim=80, block_size=8))


def test_kernel_rejects_heads_that_do_not_split_over_kv_heads(kernel):
    q, k_pool, v_pool, meta = make_step(**DECODE)
    with pytest.raises(ValueError, match="do not split evenly"):
        kernel(q[:, :7], k_pool, v_pool, meta, 0.125)


def kept_step(counts, **step):
    """MIXED's step, and its metadata for each sequence's last `counts[b]` queries alone
    (`last_queries`, what a prompt step's last layer attends with), with those rows' places."""
    q, k_pool, v_pool, meta = make_step(**MIXED, **step)
    ends = meta.query_start.tolist()[1:]
    rows = torch.tensor([row for end, count in zip(ends, counts) for row in range(end - count, end)], device=q.device)
    return q, k_pool, v_pool, meta, last_queries(meta, counts, rows), rows


ONE_EACH, SOME, ALL = [1, 1, 1, 1, 1], [3, 2, 1, 1, 1], MIXED["query_lens"]


@pytest.mark.parametrize("path, counts", [("triton", ONE_EACH), ("triton", SOME), ("triton", ALL),
                                          ("split", ONE_EACH),  # the split decode takes one query a sequence
                                          ("cpu", ONE_EACH), ("cpu", SOME), ("cpu", ALL)])
def test_kept_rows_attend_as_in_the_whole_step(path, counts, request):
    """Each sequence's last queries alone over the step's keys (a prompt step's last layer, which
    runs the rows the head reads) equal those rows of the whole step's attention, through the Triton
    kernel, its split decode and the CPU kernel."""
    run = request.getfixturevalue("cpu_kernel" if path == "cpu" else "kernel")
    if path == "split":
        run = functools.partial(paged_attention_split, splits=4)
    device = "cpu" if path == "cpu" else DEVICE
    q, k_pool, v_pool, meta, kept, rows = kept_step(counts, heads=8, kv_heads=2, device=device)
    scale = q.shape[-1] ** -0.5
    expected = paged_attention_reference(q, k_pool, v_pool, meta, scale)[rows]
    out = run(q[rows].contiguous(), k_pool, v_pool, kept, scale)
    assert kept.max_query_len == max(counts) and out.shape == expected.shape
    assert (out - expected).abs().max().item() <= TOLERANCE[torch.float32]


COMPILE = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from neuron.layers.triton_attention import paged_attention_kernel as kernel

    def compile_for(dtype, capability, group_p, block_m, head_p, precision):
        pointers = dict(out_ptr=dtype, q_ptr=dtype, k_ptr=dtype, v_ptr=dtype, tables_ptr="i32",
                        query_start_ptr="i32", kv_lens_ptr="i32")
        constexprs = dict(BLOCK_SIZE=16, BLOCK_M=block_m, GROUP_P=group_p, HEAD_P=head_p, BLOCK_N=32,
                          PRECISION=precision)
        signature = {name: "constexpr" if name in constexprs else "*" + pointers[name] if name in pointers
                     else "fp32" if name == "scale" else "i32" for name in kernel.arg_names}
        source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
        assert triton.compile(source, target=GPUTarget("cuda", capability, 32)).asm["cubin"]

    compile_for("bf16", 90, 4, 64, 128, None)
    compile_for("fp32", 80, 1, 16, 64, "ieee")
""")


@pytest.mark.slow
def test_kernel_compiles_for_nvidia_gpus():
    """The interpreter runs Python, which accepts code the GPU compiler refuses: compile the kernel to
    cubin for sm_90 (bf16, GQA, prefill tile) and sm_80 (fp32, MHA, decode tile), no GPU needed. In a
    fresh process, as this one's Triton is in interpreter mode."""
    compile_in_a_fresh_process(COMPILE, timeout=240)


# Decodes over long and short contexts: with 4 or 8 splits of the longest, the short ones leave
# splits empty, and the split boundaries fall inside blocks.
LONG_DECODE = dict(offsets=[300, 3, 150, 517], query_lens=[1, 1, 1, 1], shared=(0, 2, 5))


@pytest.mark.parametrize("splits", [2, 4, 8])
@pytest.mark.parametrize("layout", ["group1", "group4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_split_decode_matches_the_reference(kernel, splits, layout, dtype):
    heads, kv_heads = {"group1": (4, 4), "group4": (8, 2)}[layout]
    q, k_pool, v_pool, meta = make_step(**LONG_DECODE, heads=heads, kv_heads=kv_heads, dtype=dtype)
    assert_kernel_matches(lambda *a: paged_attention_split(*a, splits), q, k_pool, v_pool, meta)


def test_split_decode_refuses_a_prefill_step(kernel):
    q, k_pool, v_pool, meta = make_step(**MIXED)
    with pytest.raises(ValueError, match="decode steps"):
        paged_attention_split(q, k_pool, v_pool, meta, 0.125, 2)


@pytest.mark.parametrize("programs, kv_len, expected", [
    (8, 4096, 16),   # batch-1 Qwen3-8B (8 KV heads) on 132 SMs: 2 x 132 / 8 = 33, capped at 32 -> 16 (a power of two)
    (8, 1000, 2),    # a short context: no split under 256 positions
    (8, 200, 1),
    (132, 4096, 1),  # the GPU is full already
    (64, 8192, 4),   # 264 / 64 -> 5 -> 4
])
def test_decode_splits(programs, kv_len, expected):
    from neuron.layers.paged_attention import decode_splits

    assert decode_splits(programs, kv_len, 132) == expected


MATRIX = textwrap.dedent("""
    import json, sys, torch, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from neuron.layers.paged_attention import tiles
    from neuron.layers.triton_attention import paged_attention_kernel as kernel
    from neuron.layers.triton_attention import paged_attention_split_kernel as split

    DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    out = []
    for capability in (80, 90, 100):
        for name, dtype in DTYPES.items():
            for head_dim in (64, 128, 256):
                max_rows, block_n = tiles(dtype, head_dim)  # the largest tile the runtime picks
                pointers = dict(out_ptr=name, q_ptr=name, k_ptr=name, v_ptr=name, tables_ptr="i32",
                                query_start_ptr="i32", kv_lens_ptr="i32")
                constexprs = dict(BLOCK_SIZE=16, BLOCK_M=max_rows, GROUP_P=4, HEAD_P=head_dim, BLOCK_N=block_n,
                                  PRECISION="ieee" if name == "fp32" else None)
                signature = {a: "constexpr" if a in constexprs else "*" + pointers[a] if a in pointers
                             else "fp32" if a == "scale" else "i32" for a in kernel.arg_names}
                compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                                          target=GPUTarget("cuda", capability, 32))
                out.append([capability, name, head_dim, compiled.metadata.shared])
                pointers = dict(part_acc_ptr="fp32", part_ml_ptr="fp32", q_ptr=name, k_ptr=name, v_ptr=name,
                                tables_ptr="i32", query_start_ptr="i32", kv_lens_ptr="i32")
                constexprs = dict(SPLITS=16, BLOCK_SIZE=16, BLOCK_M=16, HEAD_P=head_dim, BLOCK_N=block_n,
                                  PRECISION="ieee" if name == "fp32" else None)
                signature = {a: "constexpr" if a in constexprs else "*" + pointers[a] if a in pointers
                             else "fp32" if a == "scale" else "i32" for a in split.arg_names}
                compiled = triton.compile(ASTSource(fn=split, signature=signature, constexprs=constexprs),
                                          target=GPUTarget("cuda", capability, 32))
                out.append([capability, name + " split", head_dim, compiled.metadata.shared])
    print(json.dumps(out))
""")


@pytest.mark.slow
def test_every_tile_the_runtime_picks_fits_every_supported_gpu():
    """Compile the kernels (no GPU needed; the split decode one too) in every dtype at head_dim 64,
    128 and 256 with the largest tile the runtime would launch, for each code generation (Ampere and Ada share sm_80's, as does
    Blackwell's sm_120 the 99 KiB class), and compare its shared memory with each GPU's: a
    combination over a card's limit would fail there with OutOfResources."""
    from neuron.layers.paged_attention import SHARED_MEMORY

    run = compile_in_a_fresh_process(MATRIX, timeout=900)
    family = {80: (80, 86, 89, 120), 90: (90,), 100: (100,)}
    over = [(cc, name, head_dim, shared) for built, name, head_dim, shared in json.loads(run.stdout.splitlines()[-1])
            for cc in family[built] if shared > SHARED_MEMORY[cc]]
    assert over == []


# ---- the CPU kernel ----

CPU_EXACT = 1e-5  # fp32 in, fp32 softmax and accumulation: only the summation order differs
GROUPS = {"group1": dict(heads=4, kv_heads=4), "group2": dict(heads=8, kv_heads=4), "group4": dict(heads=8, kv_heads=2)}


@pytest.mark.parametrize("layout", GROUPS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("step", [DECODE, MIXED], ids=["decode", "mixed"])
def test_cpu_kernel_matches_the_reference(cpu_kernel, step, layout, head_dim):
    """Decodes (kv_len 1 among them) and a mixed step: a 37-token prefill spanning several query
    tiles, a chunk after a cached prefix, decodes; shuffled, shared, non-contiguous blocks."""
    step_tensors = make_step(**step, **GROUPS[layout], head_dim=head_dim, device="cpu")
    assert_kernel_matches(cpu_kernel, *step_tensors, tolerance=CPU_EXACT)


@pytest.mark.parametrize("block_size", [1, 5, 7, 32])
@pytest.mark.parametrize("head_dim", [8, 24, 80])
def test_cpu_kernel_block_sizes_that_do_not_divide_the_chunk(cpu_kernel, block_size, head_dim):
    """Blocks of 5 and 7 positions under chunks of 37 and 9 (a key tile of 32 spans several blocks
    and ends mid-block), blocks of 1 and 32, and head sizes without a constant-size loop."""
    step_tensors = make_step(**MIXED, head_dim=head_dim, block_size=block_size, device="cpu", seed=block_size)
    assert_kernel_matches(cpu_kernel, *step_tensors, tolerance=CPU_EXACT)


def test_cpu_kernel_long_mixed_step(cpu_kernel):
    """Twelve sequences of random lengths (a 150-token chunk after 90 cached positions, a 70-token
    prompt, decodes at up to 300 positions), Qwen3's 16 query over 8 KV heads of 128."""
    gen = torch.Generator().manual_seed(7)
    offsets = [90, 0] + torch.randint(0, 300, (10,), generator=gen).tolist()
    query_lens = [150, 70] + [1] * 10
    step_tensors = make_step(offsets, query_lens, heads=16, kv_heads=8, head_dim=128, device="cpu")
    assert_kernel_matches(cpu_kernel, *step_tensors, tolerance=CPU_EXACT)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_cpu_kernel_short_multi_token_steps(cpu_kernel, head_dim):
    """Steps of 2 to 4 tokens (speculative verification) on the per-row path: the first query at
    position 31 or 63 leaves the last key tile wholly after it, so that row's tile is all masked."""
    step_tensors = make_step([31, 63, 10, 95], [2, 3, 4, 1], heads=6, kv_heads=3, head_dim=head_dim, device="cpu")
    assert_kernel_matches(cpu_kernel, *step_tensors, tolerance=CPU_EXACT)


def test_cpu_kernel_strided_queries(cpu_kernel):
    """Queries that are a view of a fused projection (rows wider than heads x head_dim)."""
    q, k_pool, v_pool, meta = make_step(**MIXED, device="cpu")
    fused = torch.randn(q.shape[0], q.shape[1] * 2, q.shape[2])
    fused[:, : q.shape[1]] = q
    assert_kernel_matches(cpu_kernel, fused[:, : q.shape[1]], k_pool, v_pool, meta, tolerance=CPU_EXACT)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_kernel_half_precision(cpu_kernel, dtype):
    """16-bit pools and queries, widened to fp32 inside: off by the output's rounding only."""
    assert_kernel_matches(cpu_kernel, *make_step(**MIXED, dtype=dtype, device="cpu"), tolerance=1e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("step", [DECODE, MIXED], ids=["decode", "mixed"])
@pytest.mark.parametrize("head_dim", [64, 80, 36])
def test_cpu_kernel_fp32_queries_over_a_16_bit_pool(cpu_kernel, dtype, step, head_dim):
    """An fp32 model's 16-bit KV cache (kv_cache_dtype): fp32 queries and output over bf16 or fp16
    pools, the stored values widened exactly, so the same numbers, bit for bit, as over those
    values held in fp32 (the blocked prefill path and the per-row one, a constant-size head and
    not, and one whose rows end past the last whole vector); through `attend` too. 16-bit queries
    over another type's pool are not taken."""
    q, k_pool, v_pool, meta = make_step(**step, head_dim=head_dim, device="cpu")
    narrow_k, narrow_v = k_pool.to(dtype), v_pool.to(dtype)
    scale = head_dim ** -0.5
    out = cpu_kernel(q, narrow_k, narrow_v, meta, scale)
    assert out.dtype == torch.float32
    assert torch.equal(out, cpu_kernel(q, narrow_k.float(), narrow_v.float(), meta, scale))
    assert_kernel_matches(cpu_kernel, q, narrow_k, narrow_v, meta, tolerance=CPU_EXACT)
    assert torch.equal(attend(Kernels(), q, narrow_k, narrow_v, meta, scale), out)
    assert cpu_attention.supports(q, dtype) and not cpu_attention.supports(q.to(dtype), torch.float32)
    other = torch.float16 if dtype is torch.bfloat16 else torch.bfloat16
    assert not cpu_attention.supports(q.to(dtype), other)


def test_cpu_kernel_uses_the_threads_torch_has(cpu_kernel):
    """One thread and several give the same numbers: work items never share an output row."""
    step_tensors = make_step(**MIXED, heads=16, kv_heads=8, head_dim=128, device="cpu")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = cpu_kernel(*step_tensors, 0.1)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(cpu_kernel(*step_tensors, 0.1), alone)


@pytest.mark.parametrize("head_dim", [256, 96])
@pytest.mark.parametrize("step", ["decode", "mixed"])
def test_cpu_kernel_wide_and_unrolled_head_sizes(cpu_kernel, head_dim, step):
    """256 takes the kernel's register-blocked loops in chunks; 96 (not a size the kernel unrolls)
    its plain loops; both with keys past several tiles, whose rows the kernel prefetches."""
    assert_kernel_matches(cpu_kernel, *make_step(**(DECODE if step == "decode" else MIXED), heads=8, kv_heads=4,
                                                 head_dim=head_dim, device="cpu"))


# Long prefill chunks, which take the kernel's blocked path: a 300-token chunk after 703 cached
# positions (1,003 in all), a whole 211-token prompt and a decode beside them. Neither chunk is a
# whole number of query tiles, key tiles or blocks.
LONG_PREFILL = dict(offsets=[703, 0, 480], query_lens=[300, 211, 1])
LONG_GROUPS = {"group1": dict(heads=3, kv_heads=3), "group3": dict(heads=9, kv_heads=3),
               "group4": dict(heads=8, kv_heads=2)}


@pytest.mark.parametrize("layout", LONG_GROUPS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpu_kernel_long_prefill_chunks(cpu_kernel, layout, head_dim, dtype):
    step_tensors = make_step(**LONG_PREFILL, **LONG_GROUPS[layout], head_dim=head_dim, dtype=dtype,
                             device="cpu")
    assert_kernel_matches(cpu_kernel, *step_tensors, tolerance=CPU_EXACT if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("query_len", [2, 3, 4, 23])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [5, 16])
def test_cpu_kernel_short_chunks_near_the_blocked_path(cpu_kernel, query_len, head_dim, block_size):
    """Chunks of 2-4 queries with a group of 3 (6-12 rows): on both sides of the rows at which an
    item takes the blocked path (8 at head size 64, 12 at 128); and 23 queries, whose last tile
    is left with 2 queries."""
    step_tensors = make_step([90, 7], [query_len, 40], heads=9, kv_heads=3, head_dim=head_dim, block_size=block_size,
                             device="cpu")
    assert_kernel_matches(cpu_kernel, *step_tensors, tolerance=CPU_EXACT)
