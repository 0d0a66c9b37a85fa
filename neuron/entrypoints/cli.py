"""The `neuron` command: `serve`, `generate`, `bench`, `doctor`, `models`, and the hidden `--worker` mode. Each
subcommand lives in its own module and registers its own flags."""

from __future__ import annotations

import argparse
import sys

from neuron import __version__


def _worker_main(argv: list[str]) -> int:
    ap = worker_parser()
    args = ap.parse_args(argv)
    if not 0 < args.rank < args.tp_size:
        ap.error(f"--rank must be in 1..{args.tp_size - 1} (rank 0 is the leader)")
    if args.connect:
        host, _, port = args.connect.rpartition(":")
        if not host or not port.isdigit():
            ap.error("--connect takes LEADER:PORT")
        from neuron.worker.main import main_connect

        return main_connect(args.connect, args.rank, args.tp_size, args.device)
    from neuron.worker.main import main

    return main(args.rank, args.tp_size, args.device)


def worker_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="neuron --worker", description="one tensor-parallel rank (spawned by the leader)")
    ap.add_argument("--worker", action="store_true", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--tp-size", type=int, required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--connect", metavar="LEADER:PORT", help="dial the leader at its cluster address and port "
                    "instead of serving stdin/stdout (a rank started by an orchestrator; the cluster token comes "
                    "from NEURON_CLUSTER_TOKEN or NEURON_CLUSTER_TOKEN_FILE)")
    return ap


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="neuron",
        description="Tensor-parallel LLM inference: an OpenAI-compatible server, offline generation and a load generator.",
    )
    ap.add_argument("--version", action="version", version=f"neuron {__version__}")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    from neuron.bench import cli as bench
    from neuron.entrypoints import doctor, generate, models, serve

    serve.add_parser(sub)
    generate.add_parser(sub)
    bench.add_parser(sub)
    doctor.add_parser(sub)
    models.add_parser(sub)
    return ap


def run_command(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    return int(args.run(args) or 0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--worker" in argv:
        return _worker_main(argv)
    return run_command(argv)
