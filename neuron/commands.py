"""User-facing subcommands. Each lives in its own module and registers its own flags."""

from __future__ import annotations

import argparse

from neuron import __version__


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="neuron",
        description="Tensor-parallel LLM inference: an OpenAI-compatible server, offline generation and a load generator.",
    )
    ap.add_argument("--version", action="version", version=f"neuron {__version__}")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    from neuron import generate_cli
    from neuron.bench import cli as bench_cli
    from neuron.server import cli as serve_cli

    serve_cli.add_parser(sub)
    generate_cli.add_parser(sub)
    bench_cli.add_parser(sub)
    return ap


def run_command(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    return int(args.run(args) or 0)
