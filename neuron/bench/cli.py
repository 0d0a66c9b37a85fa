"""`neuron bench`: load-test any OpenAI-compatible endpoint and report throughput and latency."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import anyio

from neuron.bench.load import ENDPOINTS, BenchConfig, BenchResult, run_benchmark
from neuron.bench.report import format_table, require_matplotlib, result_summary, to_json, write_plot
from neuron.config import SETTINGS
from neuron.errors import ConfigError, NeuronError

# Where `neuron serve` listens when started without options.
DEFAULT_BASE_URL = f"http://{SETTINGS['host'].default}:{SETTINGS['port'].default}/v1"

EXAMPLES = """examples:
  neuron bench --num-requests 200 --concurrency 16 --input-len 512 --output-len 128 --ignore-eos
  neuron bench --base-url http://host:8000/v1 --request-rate 4 --random-input-len 64:1024 --json-out run.json
  neuron bench --endpoint chat --prompts-file prompts.jsonl --concurrency 8 --plot latency.png
  neuron bench --scenario scenarios.yaml --base-url http://a:8000/v1 --base-url http://b:8000/v1
"""


def add_parser(sub) -> None:
    ap = sub.add_parser("bench", help="load-test an OpenAI-compatible server",
                        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLES,
                        description="Send streaming requests to an OpenAI-compatible server and report request and "
                                    "token throughput with TTFT, TPOT, ITL and end-to-end latency (mean, p50, p90, "
                                    "p99). Ctrl-C stops early and still reports.")
    ap.add_argument("--base-url", action="append",
                    help=f"the API root, up to and including /v1 (default: {DEFAULT_BASE_URL}); several with "
                         "--scenario: the servers its scenarios spread load across")
    ap.add_argument("--scenario", metavar="FILE", help="run the named scenarios of a YAML or JSON file against "
                    "their servers and check their assertions: a PASS/FAIL report, exit status 1 on any FAIL "
                    "(the format: docs/bench_scenarios.yaml)")
    ap.add_argument("--model", help="model name to request (default: the first one GET /models lists)")
    ap.add_argument("--api-key", help="bearer token (default: $OPENAI_API_KEY when set)")
    ap.add_argument("--endpoint", choices=list(ENDPOINTS), default="completions", help="default: %(default)s")
    ap.add_argument("-n", "--num-requests", type=int, default=100, help="default: %(default)s")
    load = ap.add_mutually_exclusive_group()
    load.add_argument("-c", "--concurrency", type=int, help="keep this many requests in flight")
    load.add_argument("--request-rate", type=float, default=float("inf"),
                      help="requests per second with Poisson arrivals; inf sends all at once (the default)")
    prompt = ap.add_mutually_exclusive_group()
    prompt.add_argument("--input-len", type=int, help="prompt length in tokens (default: 128)")
    prompt.add_argument("--random-input-len", type=_length_range, metavar="A:B",
                        help="prompt length drawn uniformly from A..B per request")
    prompt.add_argument("--prompts-file", help="JSONL, one {\"prompt\": ..., \"max_tokens\": optional} per line; "
                                               "cycled when shorter than --num-requests")
    output = ap.add_mutually_exclusive_group()
    output.add_argument("--output-len", type=int, help="max_tokens per request (default: 128)")
    output.add_argument("--random-output-len", type=_length_range, metavar="A:B",
                        help="max_tokens drawn uniformly from A..B per request")
    ap.add_argument("--text-prompts", action="store_true",
                    help="completions: send random words instead of random token ids (chat always sends words; "
                         "a word is about one token)")
    ap.add_argument("--ignore-eos", action="store_true",
                    help="send ignore_eos=true (a vLLM and neuron extension) so every output reaches max_tokens")
    ap.add_argument("--logprobs", type=int, metavar="N",
                    help="ask for N logprobs per output token; a server whose checkpoint has no tokenizer streams "
                         "one chunk per token only then (0 is enough)")
    ap.add_argument("--seed", type=int, default=0, help="seeds prompts, lengths and arrivals (default: %(default)s)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds each request may take (default: %(default)s)")
    ap.add_argument("--warmup", type=int, default=0, help="requests sent and discarded before timing starts")
    ap.add_argument("--json-out", metavar="FILE", help="write the summary and every request's timings as JSON")
    ap.add_argument("--plot", metavar="FILE.png", help="write latency histograms and CDFs (needs matplotlib)")
    ap.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.scenario:
        return _run_scenarios(args)
    try:
        config = config_from_args(args)
        if args.plot:
            require_matplotlib()
        result = anyio.run(_run_until_interrupted, config, backend="asyncio")
    except NeuronError as e:
        print(f"neuron bench: {e}", file=sys.stderr)
        return 2
    summary = result_summary(result)
    print(format_table(result, summary))
    if args.json_out:
        Path(args.json_out).write_bytes(to_json(result, summary))
    if args.plot:
        write_plot(result, args.plot)
    if result.interrupted:
        return 130
    return 0 if summary.completed else 1


def _run_scenarios(args: argparse.Namespace) -> int:
    from neuron.bench import scenario

    try:
        scenarios = scenario.load_scenarios(args.scenario, args.base_url or [DEFAULT_BASE_URL])
        outcomes = [anyio.run(scenario.run_scenario, s, backend="asyncio") for s in scenarios]
    except NeuronError as e:
        print(f"neuron bench: {e}", file=sys.stderr)
        return 2
    print(scenario.format_report(outcomes))
    if args.json_out:
        Path(args.json_out).write_text(scenario.to_json(outcomes))
    return 0 if all(o.passed for o in outcomes) else 1


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    def length(fixed: int | None, span: tuple[int, int] | None) -> tuple[int, int]:
        return span or ((fixed, fixed) if fixed is not None else (128, 128))

    return BenchConfig(
        base_url=_one_url(args.base_url), model=args.model, api_key=args.api_key or os.environ.get("OPENAI_API_KEY"),
        num_requests=args.num_requests, concurrency=args.concurrency, request_rate=args.request_rate,
        endpoint=args.endpoint, input_len=length(args.input_len, args.random_input_len),
        output_len=length(args.output_len, args.random_output_len), prompts_file=args.prompts_file,
        text_prompts=args.text_prompts, seed=args.seed, ignore_eos=args.ignore_eos, timeout=args.timeout,
        warmup=args.warmup, progress=sys.stderr.isatty(), logprobs=args.logprobs,
    )


async def _run_until_interrupted(config: BenchConfig) -> BenchResult:
    stop = anyio.Event()
    with _sigint_sets(stop):
        return await run_benchmark(config, stop)


@contextmanager
def _sigint_sets(stop: anyio.Event) -> Iterator[None]:
    """The first Ctrl-C sets `stop` so the run ends with a report; the handler then steps aside, so a
    second one aborts."""
    loop = asyncio.get_running_loop()

    def interrupted() -> None:
        print("neuron bench: interrupted; reporting what finished (Ctrl-C again to abort)", file=sys.stderr)
        loop.remove_signal_handler(signal.SIGINT)
        stop.set()

    try:
        loop.add_signal_handler(signal.SIGINT, interrupted)
    except (NotImplementedError, RuntimeError):  # not on this platform or thread: Ctrl-C aborts as usual
        yield
        return
    try:
        yield
    finally:
        loop.remove_signal_handler(signal.SIGINT)


def _one_url(urls: list[str] | None) -> str:
    if urls and len(urls) > 1:
        raise ConfigError("several --base-url spread load only with --scenario")
    return urls[0] if urls else DEFAULT_BASE_URL


def _length_range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(":")
    try:
        span = (int(lo), int(hi if sep else lo))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected A:B with integers, got {text!r}") from None
    if not 1 <= span[0] <= span[1]:
        raise argparse.ArgumentTypeError(f"expected 1 <= A <= B, got {text!r}")
    return span
