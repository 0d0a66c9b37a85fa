"""Continuous batching pays: N requests at once against the same N one after another, through a
live `neuron serve` and the `neuron bench` load generator, in the same run.

    python scripts/bench_concurrency.py                 # embedded default model, tp=2, 8 requests
    python scripts/bench_concurrency.py --tp 1 --requests 8 --output-len 128

Prints each run's table and the ratio of aggregate output-token throughput (concurrent / sequential).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import anyio
import httpx

from neuron.bench import BenchConfig, format_table, result_summary, run_benchmark


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "neuron", "serve", "--tp", str(args.tp), "--device", "cpu", "--port", str(port),
           "--max-num-seqs", str(max(args.requests, 1)), "--log-level", "WARNING"]
    if args.model:
        cmd.insert(3, args.model)
    proc = subprocess.Popen(cmd, env={**os.environ, "NEURON_LOG_LEVEL": "WARNING"})
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with code {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("server did not become ready in 300 s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint (default: the embedded default model)")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--json-out")
    args = ap.parse_args()

    port = free_port()
    server = start_server(args, port)
    results = {}
    try:
        for name, concurrency in (("sequential", 1), ("concurrent", args.requests)):
            cfg = BenchConfig(f"http://127.0.0.1:{port}/v1", num_requests=args.requests, concurrency=concurrency,
                              input_len=(args.input_len, args.input_len),
                              output_len=(args.output_len, args.output_len), ignore_eos=True, warmup=1)
            result = anyio.run(run_benchmark, cfg)
            print(f"\n== {name} (concurrency {concurrency})\n{format_table(result)}")
            results[name] = result_summary(result)
    finally:
        server.terminate()
        server.wait(timeout=60)
    seq, conc = results["sequential"], results["concurrent"]
    ratio = conc.output_throughput / seq.output_throughput
    print(f"\naggregate output throughput: sequential {seq.output_throughput:.1f} tok/s, "
          f"concurrent {conc.output_throughput:.1f} tok/s, ratio {ratio:.2f}x (target >= 3x)")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"tp": args.tp, "requests": args.requests, "ratio": ratio,
                                                   "sequential_tok_s": seq.output_throughput,
                                                   "concurrent_tok_s": conc.output_throughput}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
