"""Prompt throughput through the offline API: one prompt of random token ids, one token out.

    python scripts/bench_prefill.py /tmp/h/smol/fp32                       # 2,000, 4,000, 6,000 tokens
    NEURON_PREFILL_CHUNK_TOKENS=1024 python scripts/bench_prefill.py MODEL --lengths 4000

Whichever tree is on PYTHONPATH runs, so running the script once with each tree, in turns,
compares two trees under the same load. Every prompt is new (no cached prefix); one prompt warms
up first. The figure is prompt tokens over the wall time of `generate`, the best of --rounds.
"""

from __future__ import annotations

import argparse
import random
import time

from neuron import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2000, 4000, 6000])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    llm = LLM(args.model, device="cpu", dtype=args.dtype, max_model_len=max(args.lengths) + 400)
    vocab = llm.get_tokenizer().vocab_size
    rand = random.Random(0)
    params = SamplingParams(max_tokens=1, temperature=0.0)

    def prompt(n: int) -> list[int]:
        return [rand.randrange(vocab) for _ in range(n)]

    llm.generate([prompt(256)], params)
    for n in args.lengths:
        best = float("inf")
        for _ in range(args.rounds):
            ids = prompt(n)
            t0 = time.perf_counter()
            llm.generate([ids], params)
            best = min(best, time.perf_counter() - t0)
        print(f"{n:5d} tokens: {best:6.2f} s {n / best:6.0f} tok/s", flush=True)


if __name__ == "__main__":
    main()
