"""The `neuron` command: `serve`, `generate`, `bench`, and the hidden `--worker` mode."""

from __future__ import annotations

import argparse
import sys


def _worker_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="neuron --worker", description="one tensor-parallel rank (spawned by the leader)")
    ap.add_argument("--worker", action="store_true", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--tp-size", type=int, required=True)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    if not 0 < args.rank < args.tp_size:
        ap.error(f"--rank must be in 1..{args.tp_size - 1} (rank 0 is the leader)")
    from neuron.worker import main

    return main(args.rank, args.tp_size, args.device)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--worker" in argv:
        return _worker_main(argv)
    from neuron.commands import run_command

    return run_command(argv)
