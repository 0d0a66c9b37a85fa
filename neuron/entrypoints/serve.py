"""`neuron serve`: the OpenAI-compatible HTTP server.

Every option can also come from an environment variable, NEURON_ and the option's name in upper
case (`--max-num-seqs` is NEURON_MAX_NUM_SEQS); a flag on the command line wins.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

log = logging.getLogger("neuron.server")

_DESCRIPTION = """\
Serve a model over the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models), with
/health for readiness probes and /metrics for Prometheus. The model loads in the background:
/health answers 503 {"status": "loading"} until it is ready."""

_EPILOG = """\
Each option can also be set with the environment variable shown in brackets; a command-line
flag wins over the variable. Example: NEURON_TP=2 NEURON_API_KEY=secret neuron serve ./my-model"""


def _int(value: str, lo: int, hi: int | None = None) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None
    if hi is not None and not lo <= n <= hi:
        raise argparse.ArgumentTypeError(f"must be in {lo}..{hi}, got {n}")
    if n < lo:
        raise argparse.ArgumentTypeError(f"must be >= {lo}, got {n}")
    return n


def _positive(value: str) -> int:
    return _int(value, 1)


def _non_negative(value: str) -> int:
    return _int(value, 0)


def _seconds(value: str) -> float:
    try:
        s = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {value!r}") from None
    if not s >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return s


def _port(value: str) -> int:
    return _int(value, 0, 65535)


def _env_name(flag: str) -> str:
    return "NEURON_" + flag.lstrip("-").upper().replace("-", "_")


def _option(ap: argparse.ArgumentParser, flag: str, help: str, default=None, **kwargs) -> None:
    """An option whose default comes from its environment variable (argparse converts strings)."""
    env = _env_name(flag)
    ap.add_argument(flag, default=os.environ.get(env, default), help=f"{help} [{env}]", **kwargs)


def add_parser(sub) -> None:
    ap = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                        description=_DESCRIPTION, epilog=_EPILOG,
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("model", nargs="?", default=os.environ.get("NEURON_MODEL"), metavar="MODEL",
                    help="checkpoint directory or Hugging Face repo id in the local cache; omitted: the embedded "
                         "tiny default model (random weights: its output is noise) [NEURON_MODEL]")
    _option(ap, "--tp", "tensor-parallel size: how many ranks (devices) share the model", 1, type=_positive)
    _option(ap, "--host", "address to listen on; use 0.0.0.0 only behind a firewall or with --api-key",
            "127.0.0.1")
    _option(ap, "--port", "TCP port to listen on", 8000, type=_port)
    _option(ap, "--device", "cpu or cuda (default: cuda when present, else cpu)")
    _option(ap, "--dtype", "weight and activation dtype: auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16, float16", "auto")
    _option(ap, "--max-model-len", "longest sequence (prompt + output) in tokens "
            "(default: the model's limit, capped at 8192)", type=_positive)
    _option(ap, "--max-num-seqs", "sequences decoded together; each holds one KV-cache slot", 16, type=_positive)
    _option(ap, "--max-num-batched-tokens", "token budget of one step (default: the prefill chunk size)",
            type=_positive)
    _option(ap, "--kv-cache-memory", "KV-cache budget per rank, in bytes or with a unit (e.g. 4GiB) "
            "(default: CPU, enough for max-num-seqs full-length sequences; CUDA, from --gpu-memory-utilization)")
    _option(ap, "--gpu-memory-utilization", "share of each GPU's memory neuron may use for weights, activations "
            "and the KV cache", 0.9, type=float)
    ap.add_argument("--no-prefix-caching", action="store_true",
                    help="do not reuse the KV blocks of prompt prefixes seen before [NEURON_NO_PREFIX_CACHING=1]")
    _option(ap, "--max-waiting", "requests that may wait for a free slot; beyond that the server answers 503 "
            "with Retry-After", 256, type=_non_negative)
    _option(ap, "--served-model-name", "the name clients pass as `model` (default: MODEL as given)")
    _option(ap, "--api-key", "require `Authorization: Bearer <key>` on /v1 routes (/health and /metrics stay open)")
    _option(ap, "--max-body-bytes", "largest request body accepted; larger ones get 413", 8 * 1024 * 1024,
            type=_positive)
    _option(ap, "--keepalive-s", "seconds between SSE keep-alive comments while a stream waits for tokens", 10.0,
            type=float)
    _option(ap, "--shutdown-grace-s", "on SIGTERM or Ctrl-C, seconds in-flight requests get to finish before they "
            "are cancelled (new ones get 503 at once); a second signal cuts it short", 10.0, type=_seconds)
    _option(ap, "--log-level", "debug, info, warning or error", "info")
    ap.set_defaults(run=run)


def run(args) -> int:
    from neuron.engine.llm_engine import EngineConfig
    from neuron.utils.log import setup_logging
    from neuron.entrypoints.openai.app import ServerConfig

    setup_logging(level=args.log_level)
    if args.model is None:
        log.info("no MODEL given: serving the embedded tiny default model (random weights: its output is noise)")
    engine_cfg = EngineConfig(model=args.model, tp=args.tp, device=args.device, dtype=args.dtype,
                              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                              max_num_batched_tokens=args.max_num_batched_tokens,
                              served_model_name=args.served_model_name, kv_cache_memory=args.kv_cache_memory,
                              gpu_memory_utilization=args.gpu_memory_utilization,
                              enable_prefix_caching=False if args.no_prefix_caching else None)
    server_cfg = ServerConfig(host=args.host, port=args.port, api_key=args.api_key,
                              max_body_bytes=args.max_body_bytes, keepalive_s=args.keepalive_s,
                              shutdown_grace_s=args.shutdown_grace_s)
    try:
        return asyncio.run(serve(engine_cfg, server_cfg, args.max_waiting, args.log_level))
    except KeyboardInterrupt:  # a Ctrl-C before Uvicorn took over the signals: nothing was running yet
        return 0


async def serve(engine_cfg, server_cfg, max_waiting: int, log_level: str = "info") -> int:
    """Run the server until a signal stops it (0, after a graceful shutdown) or the model fails to
    load (1)."""
    import uvicorn

    from neuron.engine.llm_engine import LLMEngine
    from neuron.entrypoints.openai.app import build_app
    from neuron.engine.async_engine import AsyncEngine, EngineState
    from neuron.entrypoints.openai.shutdown import GracefulServer

    engine = AsyncEngine(lambda: LLMEngine(engine_cfg).start(), model_name=served_name(engine_cfg),
                         max_running=engine_cfg.max_num_seqs, max_waiting=max_waiting)
    app = build_app(engine, server_cfg)
    # Uvicorn's own logs stay at warning: neuron logs one line per request itself.
    quiet = "warning" if log_level.lower() in ("info", "debug") else log_level.lower()
    # Uvicorn's own graceful timeout only backs up ours: by then every request has had its answer.
    config = uvicorn.Config(app, host=server_cfg.host, port=server_cfg.port, log_level=quiet,
                            timeout_graceful_shutdown=5)
    server = GracefulServer(config, engine, server_cfg.shutdown_grace_s)
    task = asyncio.create_task(server.serve())
    while not task.done() and not (server.started and engine.state is not EngineState.LOADING):
        await asyncio.sleep(0.05)
    if engine.state is EngineState.READY and server.started:
        port = server.servers[0].sockets[0].getsockname()[1]
        log.info("ready: serving `%s` at http://%s:%d/v1", engine.model_name, server_cfg.host, port)
    failed = engine.state is EngineState.FAILED
    if failed:
        log.error("the model failed to load; stopping")
        server.should_exit = True
    await task
    # The lifespan has stopped the engine already, unless a signal came while Uvicorn was starting.
    await asyncio.to_thread(engine.stop)
    log.info("stopped")
    return 1 if failed else 0


def served_name(cfg) -> str:
    """The name the engine will report, known before it loads (EngineConfig's rule)."""
    return cfg.served_model_name or cfg.model or "neuron-default"
