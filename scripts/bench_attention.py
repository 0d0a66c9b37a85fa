"""The CPU paged-attention kernel alone on one prefill chunk: a chunk of queries at the end of a
prompt of each length, SmolLM2-135M's heads (9 query over 3 KV heads of 64) by default.

    python scripts/bench_attention.py                          # a 512-query chunk, 2,000-6,000 positions
    python scripts/bench_attention.py --chunk 3 8 --kv 2000    # short chunks: where the blocked path starts

Whichever tree is on PYTHONPATH supplies the kernel, so running the script once with each tree,
in turns, compares two kernels under the same load. The pools are random, in shuffled blocks of
16 positions; the figure is the best of --rounds calls, in milliseconds and GFLOP/s (the
multiply-adds of Q K^T and P V over the visible keys only).
"""

from __future__ import annotations

import argparse
import time

import torch

from neuron.layers import cpu_attention
from neuron.layers.paged_attention import build_metadata

BLOCK_SIZE = 16


def step(chunk: int, kv_len: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
    """Queries of the last `chunk` positions of a `kv_len`-position prompt, and its pools."""
    gen = torch.Generator().manual_seed(0)
    blocks = -(-kv_len // BLOCK_SIZE)
    table = torch.randperm(blocks, generator=gen).tolist()
    k_pool, v_pool = torch.randn(2, kv_heads, blocks * BLOCK_SIZE, head_dim, generator=gen).to(dtype)
    q = torch.randn(chunk, heads, head_dim, generator=gen).to(dtype)
    meta = build_metadata([table], [kv_len - chunk], [chunk], BLOCK_SIZE, "cpu")
    return q, k_pool, v_pool, meta


def flops(chunk: int, kv_len: int, heads: int, head_dim: int) -> int:
    visible = sum(kv_len - chunk + i + 1 for i in range(chunk))
    return 4 * heads * head_dim * visible


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunk", type=int, nargs="+", default=[512])
    ap.add_argument("--kv", type=int, nargs="+", default=[2000, 4000, 6000])
    ap.add_argument("--heads", type=int, nargs=3, default=[9, 3, 64], metavar=("HEADS", "KV_HEADS", "HEAD_DIM"))
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if cpu_attention.library() is None:
        raise SystemExit("the CPU attention kernel could not be built here")
    heads, kv_heads, head_dim = args.heads
    dtype = getattr(torch, args.dtype)
    print(f"{cpu_attention.SOURCE.parent.parent.parent.parent}: {args.threads} threads, {args.dtype}, "
          f"{heads}/{kv_heads} heads of {head_dim}; best of {args.rounds}")
    for chunk in args.chunk:
        for kv_len in args.kv:
            q, k_pool, v_pool, meta = step(chunk, kv_len, heads, kv_heads, head_dim, dtype)
            best = float("inf")
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                cpu_attention.paged_attention_cpu(q, k_pool, v_pool, meta.query_start, meta.kv_lens,
                                                  meta.block_tables, BLOCK_SIZE, head_dim ** -0.5)
                best = min(best, time.perf_counter() - t0)
            gflops = flops(chunk, kv_len, heads, head_dim) / best / 1e9
            print(f"chunk {chunk:4d} over {kv_len:5d}: {best * 1e3:8.2f} ms {gflops:6.1f} GFLOP/s", flush=True)


if __name__ == "__main__":
    main()
