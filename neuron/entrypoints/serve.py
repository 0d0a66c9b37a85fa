"""`neuron serve`: the OpenAI-compatible HTTP server.

Every option is a setting of neuron.config, so it can also come from its environment variable,
NEURON_ and the option's name in upper case (`--max-num-seqs` is NEURON_MAX_NUM_SEQS); a flag on
the command line wins.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from typing import TYPE_CHECKING

from neuron.config import settings
from neuron.entrypoints.options import add_model, add_options, given
from neuron.errors import ConfigError

if TYPE_CHECKING:
    from neuron.engine.llm_engine import EngineConfig
    from neuron.entrypoints.openai.app import ServerConfig

log = logging.getLogger("neuron.server")

_DESCRIPTION = """\
Serve a model over the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models), with
/health for readiness probes and /metrics for Prometheus. The model loads in the background:
/health answers 503 {"status": "loading"} until it is ready."""

_EPILOG = """\
Each option can also be set with the environment variable its help names (NEURON_ and the option
in upper case); a command-line flag wins over the variable.
Example: NEURON_TP=2 NEURON_API_KEY=secret neuron serve ./my-model"""


# The settings `neuron serve` takes as flags, in the order --help lists them.
OPTIONS = ("tp", "host", "port", "device", "dtype", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
           "kv_cache_memory", "gpu_memory_utilization", "no_prefix_caching", "max_waiting", "served_model_name",
           "api_key", "max_body_bytes", "keepalive_s", "shutdown_grace_s", "log_level")


def add_parser(sub) -> None:
    ap = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                        description=_DESCRIPTION, epilog=_EPILOG)
    add_model(ap)
    add_options(ap, OPTIONS)
    ap.set_defaults(run=run)


def configs(args: argparse.Namespace) -> tuple[EngineConfig, ServerConfig]:
    """The engine and server configs: the flags given, and the settings for everything else."""
    from neuron.engine.llm_engine import EngineConfig
    from neuron.entrypoints.openai.app import ServerConfig

    engine = given(args, EngineConfig)
    if args.no_prefix_caching:
        engine["enable_prefix_caching"] = False
    return EngineConfig(**engine), ServerConfig(**given(args, ServerConfig))


def run(args) -> int:
    from neuron.utils.log import setup_logging

    try:
        engine_cfg, server_cfg = configs(args)
        log_level = args.log_level or settings().log_level
    except ConfigError as exc:
        print(f"neuron serve: {exc}", file=sys.stderr)
        return 2
    setup_logging(level=log_level)
    if engine_cfg.model is None:
        log.info("no MODEL given: serving the embedded tiny default model (random weights: its output is noise)")
    try:
        return asyncio.run(serve(engine_cfg, server_cfg, log_level))
    except KeyboardInterrupt:  # a Ctrl-C before Uvicorn took over the signals: nothing was running yet
        return 0


async def serve(engine_cfg, server_cfg, log_level: str = "info") -> int:
    """Run the server until a signal stops it (0, after a graceful shutdown) or the model fails to
    load (1)."""
    import uvicorn

    from neuron.engine.async_engine import AsyncEngine, EngineState
    from neuron.engine.llm_engine import LLMEngine
    from neuron.entrypoints.openai.app import build_app
    from neuron.entrypoints.openai.shutdown import GracefulServer

    engine = AsyncEngine(lambda: LLMEngine(engine_cfg).start(), model_name=served_name(engine_cfg),
                         max_running=engine_cfg.max_num_seqs, max_waiting=server_cfg.max_waiting)
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
