"""`neuron serve`: the OpenAI-compatible HTTP server.

Every option is a setting of neuron.config, so it can also come from its environment variable,
NEURON_ and the option's name in upper case (`--max-num-seqs` is NEURON_MAX_NUM_SEQS); a flag on
the command line wins.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import errno
import ipaddress
import logging
import socket
import sys
from typing import TYPE_CHECKING

from neuron.config import SETTINGS, settings
from neuron.entrypoints.options import add_options, describe, given
from neuron.errors import ConfigError

if TYPE_CHECKING:
    from neuron.engine.async_engine import AsyncEngine
    from neuron.engine.llm_engine import EngineConfig
    from neuron.entrypoints.openai.app import ServerConfig
    from neuron.entrypoints.openai.connections import ConnectionLimits

log = logging.getLogger("neuron.server")

_DESCRIPTION = """\
Serve a model over the OpenAI API (/v1/chat/completions, /v1/completions, /v1/embeddings,
/v1/models), with /health for readiness probes and /metrics for Prometheus. The model loads in the
background: /health answers 503 {"status": "loading"} until it is ready."""

_EPILOG = """\
Each option can also be set with the environment variable its help names (NEURON_ and the option
in upper case); a command-line flag wins over the variable.
Example: NEURON_TP=2 NEURON_API_KEY=secret neuron serve ./my-model"""


# The settings `neuron serve` takes as flags, in the groups and the order --help lists them.
OPTION_GROUPS = (
    ("model", "what is served, and how its weights are held",
     ("served_model_name", "models", "ollama_store", "task", "tokenizer", "chat_template", "hf_overrides", "dtype",
      "quantization", "max_model_len", "speculative_config", "load_timeout_s")),
    ("lora", "LoRA adapters on the model (README: LoRA adapters)",
     ("lora_modules", "enable_lora", "max_loras", "max_lora_rank", "allow_runtime_lora_updating")),
    ("parallel", "ranks, devices, batching and the KV cache",
     ("tp", "device", "cpu_all_reduce", "cpu_bind", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory",
      "kv_cache_dtype", "gpu_memory_utilization", "memory_budget", "no_prefix_caching")),
    ("server", "the HTTP server", ("host", "port", "api_key", "admin_key", "prefix_cache_isolation",
                                   "allowed_origins", "keepalive_s", "shutdown_grace_s", "log_level")),
    ("limits", "what clients may queue, send and hold open",
     ("max_waiting", "max_body_bytes", "max_connections", "max_connections_per_client", "header_timeout_s",
      "body_timeout_s", "min_body_rate", "idle_timeout_s", "responses_max_stored", "responses_max_stored_bytes")),
    ("multi-host", "ranks on other hosts (README: Ranks on several hosts)",
     ("hosts", "worker_launcher", "cluster_address", "cluster_interface", "cluster_port")),
)
OPTIONS = tuple(name for _, _, names in OPTION_GROUPS for name in names)


def add_parser(sub) -> None:
    ap = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                        description=_DESCRIPTION, epilog=_EPILOG)
    for title, description, names in OPTION_GROUPS:
        group = ap.add_argument_group(title, description)
        if title == "model":
            group.add_argument("model", nargs="*", metavar="MODEL",
                               help=describe(SETTINGS["model"])[:-1] + "; several: each served under its name as given)")
        if "lora_modules" in names:  # several NAME=PATH after one flag, as vLLM's
            group.add_argument("--lora-modules", dest="lora_modules", nargs="+", default=None, metavar="NAME=PATH",
                               help=describe(SETTINGS["lora_modules"]))
        add_options(group, [name for name in names if name != "lora_modules"])
    ap.set_defaults(run=run)


def configs(args: argparse.Namespace) -> tuple[EngineConfig, ServerConfig]:
    """The engine and server configs: the flags given, and the settings for everything else."""
    from neuron.engine.llm_engine import EngineConfig
    from neuron.entrypoints.openai.app import ServerConfig

    engine = given(args, EngineConfig)
    if isinstance(engine.get("lora_modules"), list):
        engine["lora_modules"] = " ".join(engine["lora_modules"])
    models = engine.pop("model", None) or []
    if len(models) == 1:
        engine["model"] = models[0]
    if args.no_prefix_caching:
        engine["enable_prefix_caching"] = False
    return EngineConfig(**engine), ServerConfig(**given(args, ServerConfig))


def model_specs(args: argparse.Namespace, engine_cfg: EngineConfig) -> list | None:
    """The models of a host (several MODELs, or --models FILE), each over the command line's options;
    None for the single model a server has always served."""
    import dataclasses

    from neuron.engine.host import ModelSpec, check_unique, read_models_file

    models = args.model or []
    file = args.models or settings().models
    store = args.ollama_store or settings().ollama_store
    if len(models) <= 1 and not file and not store:
        return None
    if engine_cfg.served_model_name is not None:
        raise ConfigError("--served-model-name names one model; with several, each is served under its name as "
                          "given (or a models file's `name`)")
    defaults = dataclasses.replace(engine_cfg, model=None)
    specs = [ModelSpec(name, dataclasses.replace(defaults, model=name, served_model_name=name)) for name in models]
    if file:
        specs += read_models_file(file, defaults)
    check_unique(specs)
    if store:
        specs += _ollama_specs(defaults, {s.name for s in specs})
    return specs


def _ollama_specs(defaults, taken: set[str]) -> list:
    """--ollama-store: each model of Ollama's store that neuron reads, on demand under its Ollama
    name (a name the command line or models file serves already is theirs)."""
    import dataclasses

    from neuron.engine.host import ON_DEMAND_KEEP_ALIVE_S, ModelSpec
    from neuron.engine.model_config import ollama_models
    from neuron.models.ollama_store import store_dirs

    served, skipped = ollama_models()
    for name, why in skipped.items():
        log.warning("Ollama model %s is not served: %s", name, why)
    specs = [ModelSpec(name, dataclasses.replace(defaults, model=name, served_model_name=name), "on_demand",
                       ON_DEMAND_KEEP_ALIVE_S) for name in served if name not in taken]
    if not specs and not taken:
        raise ConfigError(f"--ollama-store: Ollama's store ({' or '.join(map(str, store_dirs()))}) holds no model "
                          "neuron reads" + (f" ({len(skipped)} left out, each logged)" if skipped else ""))
    log.info("serving %d model(s) of Ollama's store on demand: %s", len(specs), ", ".join(s.name for s in specs))
    return specs


def run(args) -> int:
    from neuron.utils.log import setup_logging

    try:
        engine_cfg, server_cfg = configs(args)
        log_level = args.log_level or settings().log_level
        setup_logging(level=log_level)  # model_specs may log (--ollama-store's models)
        specs = model_specs(args, engine_cfg)
        sock = listen_socket(server_cfg.host, server_cfg.port)  # before anything loads: a busy port fails at once
    except ConfigError as exc:
        print(f"neuron serve: {exc}", file=sys.stderr)
        return 2
    if engine_cfg.model is None and specs is None:
        log.info("no MODEL given: serving the embedded tiny default model (random weights: its output is noise)")
    try:
        return asyncio.run(serve(engine_cfg, server_cfg, log_level, sock, specs))
    except KeyboardInterrupt:  # a Ctrl-C before Uvicorn took over the signals: nothing was running yet
        return 0


def listen_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound to host:port; ConfigError in one line when it cannot be (a port
    in use, an address this machine does not have)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Uvicorn's own: a restart reuses the port
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(f"{host}:{port} is already in use: stop what listens there, or serve on another port "
                              "(--port, NEURON_PORT; --port 0 picks a free one)") from None
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc} (--host, --port)") from None
    return sock


async def serve(engine_cfg, server_cfg, log_level: str = "info", sock: socket.socket | None = None,
                specs: list | None = None) -> int:
    """Run the server until a signal stops it (0, after a graceful shutdown) or its one model fails
    to load (1). `sock`: bound already (listen_socket); else bound here, before the model loads.
    `specs`: the models of a host (model_specs), None for the one model of `engine_cfg`."""
    import uvicorn

    from neuron.engine.host import ModelHost
    from neuron.entrypoints.openai.app import build_app
    from neuron.entrypoints.openai.connections import rate_limit_server_logs
    from neuron.entrypoints.openai.shutdown import GracefulServer

    sock = sock or listen_socket(server_cfg.host, server_cfg.port)
    rate_limit_server_logs()
    warn_if_exposed(server_cfg.host, server_cfg.api_key)
    limits = connection_limits(server_cfg, max([engine_cfg.tp, *(s.engine.tp for s in specs or [])]))
    defaults = dataclasses.replace(engine_cfg, model=None, served_model_name=None)
    options = dict(defaults=defaults, max_waiting=server_cfg.max_waiting,
                   memory_budget=settings().memory_budget if server_cfg.memory_budget is None
                   else server_cfg.memory_budget)
    host = ModelHost.of_engine(async_engine(engine_cfg, server_cfg), **options) if specs is None \
        else ModelHost(specs, **options)
    app = build_app(host, server_cfg)
    # Uvicorn's own logs stay at warning: neuron logs one line per request itself.
    quiet = "warning" if log_level.lower() in ("info", "debug") else log_level.lower()
    # Uvicorn's own graceful timeout only backs up ours: by then every request has had its answer.
    config = uvicorn.Config(app, host=server_cfg.host, port=server_cfg.port, log_level=quiet,
                            timeout_graceful_shutdown=5)
    server = GracefulServer(config, host, server_cfg.shutdown_grace_s, limits)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not task.done() and not (server.started and not host.starting):
        await asyncio.sleep(0.05)
    single = host.single
    if server.started and host.startup_ready:
        port = server.servers[0].sockets[0].getsockname()[1]
        names = ", ".join(f"`{name}`" for name in host.models)
        log.info("ready: serving %s at http://%s:%d/v1%s", names, server_cfg.host, port,
                 _speculation(single.engine.speculative) if single is not None else "")
    failed = single is not None and single.status == "failed"
    if failed:  # a server of one model has nothing left to serve
        log.error("the model failed to load; stopping")
        server.should_exit = True
    for m in host.models.values():
        if single is None and m.status == "failed":
            log.error("model `%s` failed to load: %s; the others are served, and the admin API can load it "
                      "again", m.name, m.error or (m.engine.error if m.engine else ""))
    await task
    # The lifespan has stopped the engines already (this returns at once), unless a signal came
    # while Uvicorn was starting.
    await asyncio.to_thread(host.stop)
    log.info("stopped")
    return 1 if failed else 0


def async_engine(engine_cfg: EngineConfig, server_cfg: ServerConfig) -> AsyncEngine:
    """The engine behind the server, loading in the background; stopping it interrupts a load or a
    rebuild of the ranks rather than waiting for it."""
    from neuron.engine.async_engine import AsyncEngine
    from neuron.engine.llm_engine import interruptible_load

    load, interrupt = interruptible_load(engine_cfg)
    return AsyncEngine(load, model_name=served_name(engine_cfg), max_running=engine_cfg.max_num_seqs,
                       max_waiting=server_cfg.max_waiting, interrupt=interrupt)


def connection_limits(cfg: ServerConfig, tp: int) -> ConnectionLimits:
    """The server's connection limits, the cap lowered to keep descriptors for a rebuild of the ranks."""
    from neuron.entrypoints.openai.connections import ConnectionLimits, connection_cap

    return ConnectionLimits(connection_cap(cfg.max_connections, tp), cfg.header_timeout_s, cfg.body_timeout_s,
                            cfg.idle_timeout_s, cfg.max_connections_per_client)


def warn_if_exposed(host: str, api_key: str | None) -> bool:
    """Warn when the API listens beyond loopback with no API key; returns whether it warned."""
    if api_key is not None or is_loopback(host):
        return False
    log.warning("listening on %s without an API key: anyone who can reach this port can use the model; set "
                "--api-key (NEURON_API_KEY), or keep --host at 127.0.0.1 behind a proxy", host)
    return True


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: it may resolve to anything
        return False


def _speculation(summary: dict | None) -> str:
    """The ready line's ending when speculative decoding is on: its method and settings."""
    if summary is None:
        return ""
    return " with speculative decoding (" + ", ".join(f"{k}={v}" for k, v in summary.items()) + ")"


def served_name(cfg) -> str:
    """The name the engine will report, known before it loads (EngineConfig's rule)."""
    return cfg.served_model_name or cfg.model or "neuron-default"
