"""Prefix caching on a repeated-system-prompt workload: requests that share a long system prompt
and differ in a short user tail, sent one after another, with prefix caching on and off, same
checkpoint, same run. Each request generates one token, so its latency is its prefill.

    python scripts/bench_prefix.py                       # 25M-parameter Qwen3, 1024-token system prompt
    python scripts/bench_prefix.py --shape tiny-2L --system 512 --requests 16

Prints the prefix-cache hit rate (prompt tokens found in the cache over those looked up) and the
median prefill time per request for both, and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from bench_decode import SHAPES, build


def run(path: Path, prompts: list[list[int]], caching: bool, tp: int) -> tuple[float, float]:
    from neuron import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    with LLM(str(path), tensor_parallel_size=tp, device="cpu", dtype="float32", max_num_seqs=4,
             max_model_len=4096, enable_prefix_caching=caching) as llm:
        llm.generate({"prompt_token_ids": [1, 2, 3]}, params)  # warm-up, shares nothing
        times = []
        for prompt in prompts:
            t0 = time.perf_counter()
            llm.generate({"prompt_token_ids": prompt}, params)
            times.append(time.perf_counter() - t0)
        queries, hits = llm.engine.prefix_cache_counts()
    return statistics.median(times[1:]), hits / max(queries, 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="25M", choices=list(SHAPES))
    ap.add_argument("--system", type=int, default=1024, help="system prompt tokens")
    ap.add_argument("--tail", type=int, default=32, help="distinct user tokens per request")
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--tp", type=int, default=1)
    args = ap.parse_args()
    vocab = SHAPES[args.shape]["vocab_size"]
    system = [(7 * i + 3) % (vocab - 1) + 1 for i in range(args.system)]
    prompts = [system + [(31 * r + 5 * j) % (vocab - 1) + 1 for j in range(args.tail)] for r in range(args.requests)]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / args.shape
        params = build(path, SHAPES[args.shape])
        off, _ = run(path, prompts, False, args.tp)
        on, rate = run(path, prompts, True, args.tp)
    print(f"{args.shape} ({params / 1e6:.1f}M params), tp={args.tp}: {args.requests} requests of "
          f"{args.system} shared + {args.tail} own tokens")
    print(f"  prefix cache off: median prefill {off * 1e3:.1f} ms")
    print(f"  prefix cache on:  median prefill {on * 1e3:.1f} ms, hit rate {rate:.1%} -> {off / on:.1f}x faster")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
