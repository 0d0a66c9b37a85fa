"""A model host: one server, several models, each its own engine, loaded and unloaded while it runs.

Each model (`ModelSpec`: a name, the engine's arguments, when to load it and how long to keep it
idle) gets its own `AsyncEngine`, so its own scheduler, KV cache, executor and worker processes on
its own devices, and a model that fails or recovers touches no other. `ModelHost` keeps the map
of them, routes a request by its `model` to that model's engine (loading an on-demand model at
its first request), loads and unloads models while the server runs (the admin API), unloads
models idle past their `keep_alive`, and runs the memory pre-flight before any worker starts
(`host_memory`): a model that does not fit what its devices have left unloads idle on-demand
models, least recently used first, or is refused with 507 and the sizes.

Everything here runs on the server's event loop except a model's resolution (files read, the
tokenizer built) and its engine's stop, which run in worker threads.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neuron.config import parse_bytes, settings
from neuron.engine.async_engine import AsyncEngine, EngineState
from neuron.engine.engine_config import EngineConfig
from neuron.engine.host_memory import MemoryLedger, place
from neuron.engine.llm_engine import interruptible_load
from neuron.engine.metrics import Metrics
from neuron.engine.model_config import ModelConfig, resolve_model_config
from neuron.errors import ConfigError, NeuronError
from neuron.utils import safe_yaml
from neuron.utils.openmp import then_release_pool

log = logging.getLogger("neuron.host")

LOAD_POLICIES = ("startup", "on_demand")
ON_DEMAND_KEEP_ALIVE_S = 300.0  # Ollama's default
_REAP_INTERVAL_S = 1.0
_MIN_IDLE_S = 1.0  # the least idleness that unloads a model, whatever its keep_alive
# The spec keys that are EngineConfig fields of the same name; `name`, `load`, `keep_alive` and
# `share_devices` are the host's own.
_ENGINE_KEYS = ("model", "tp", "devices", "dtype", "quantization", "max_model_len", "speculative_config",
                "hf_overrides", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory", "kv_cache_dtype",
                "gpu_memory_utilization", "tokenizer", "chat_template", "task", "enable_lora", "max_loras",
                "max_lora_rank", "lora_modules")
SPEC_KEYS = ("name", *_ENGINE_KEYS, "keep_alive", "load", "share_devices")


class HostError(NeuronError):
    """A request of the host that cannot be carried out; `status` is the HTTP answer."""

    status = 400
    code = "invalid_request"


class UnknownModel(HostError):
    status, code = 404, "model_not_found"


class LoadFailed(HostError):
    """A load that got past the pre-flight and failed in its ranks (a checkpoint that cannot run)."""

    def __init__(self, name: str, cause: str):
        super().__init__(f"model `{name}` failed to load: {cause}")
        self.cause = cause


class ModelExists(HostError):
    status, code = 409, "model_exists"


class InsufficientMemory(HostError):
    status, code = 507, "insufficient_memory"


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """One model the host serves: the name clients call it, the engine's arguments, whether it loads
    when the server starts or at its first request, and how long it may stay idle (None: for good)."""

    name: str
    engine: EngineConfig
    load: str = "startup"
    keep_alive_s: float | None = None
    share_devices: bool = False  # its `devices` may be another model's (each sizes its KV from what is free)

    @classmethod
    def parse(cls, d: Any, defaults: EngineConfig, where: str) -> "ModelSpec":
        """A spec from a models file entry or an admin request: unknown keys refused by name, the rest
        over `defaults` (the command line's options), checked as the engine checks them."""
        if not isinstance(d, dict):
            raise HostError(f"{where}: a model spec must be an object, got {type(d).__name__}")
        unknown = sorted(set(d) - set(SPEC_KEYS))
        if unknown:
            raise HostError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; a spec takes "
                            f"{', '.join(SPEC_KEYS)}")
        name = d.get("name")
        if not isinstance(name, str) or not name or len(name) > 256 or any(c in name for c in "\n\r\t/"):
            raise HostError(f"{where}: name must be a non-empty string of at most 256 characters without "
                            f"slashes or newlines, got {name!r:.80}")
        if not isinstance(d.get("model"), str):
            raise HostError(f"{where}: model must be a path, a cached repo id or a GGUF file, got "
                            f"{d.get('model')!r:.80}")
        load = d.get("load", "startup")
        if load not in LOAD_POLICIES:
            raise HostError(f"{where}: load must be startup or on_demand, got {load!r:.80}")
        fields = {k: d[k] for k in _ENGINE_KEYS if k in d}
        if fields.get("devices") is not None:
            fields["devices"] = _devices(fields["devices"], where)
        if "tp" not in fields and fields.get("devices"):
            fields["tp"] = len(fields["devices"])
        try:
            engine = dataclasses.replace(defaults, served_model_name=name, **fields)
        except (ConfigError, TypeError, ValueError) as exc:
            raise HostError(f"{where}: {exc}") from None
        share = d.get("share_devices", False)
        if not isinstance(share, bool):
            raise HostError(f"{where}: share_devices must be true or false, got {share!r:.80}")
        return cls(name, engine, load, _keep_alive(d.get("keep_alive"), load, where), share)


def _devices(value: Any, where: str) -> list[str]:
    """`devices` as device strings: "cuda:1", 1 (a GPU index), "cpu"."""
    items = value if isinstance(value, list) else [value]
    out = []
    for item in items:
        if isinstance(item, bool) or not isinstance(item, (int, str)):
            raise HostError(f"{where}: devices must name GPUs (0, \"cuda:1\") or cpu, got {value!r:.80}")
        out.append(f"cuda:{item}" if isinstance(item, int) else item)
    return out


def _keep_alive(value: Any, load: str, where: str) -> float | None:
    """Seconds a model may stay idle before it is unloaded; None: for good. -1 keeps it for good, 0
    unloads it right after its last request; the default is for good for models loaded at start-up
    and 5 minutes for on-demand ones, as Ollama's."""
    if value is None:
        return None if load == "startup" else ON_DEMAND_KEEP_ALIVE_S
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value == -1 or 0 <= value <= 1e9):
        raise HostError(f"{where}: keep_alive must be seconds (0 or more), or -1 for never, got {value!r:.80}")
    return None if value == -1 else float(value)


def read_models_file(path: str | Path, defaults: EngineConfig) -> list[ModelSpec]:
    """The specs of a --models file: a JSON or YAML list (or {"models": [...]}) of specs."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            data = f.read((1 << 20) + 1)
    except OSError as exc:
        raise ConfigError(f"--models {path}: {exc.strerror or exc}") from None
    if len(data) > 1 << 20:
        raise ConfigError(f"--models {path}: more than a models file holds (1 MiB)")
    data = safe_yaml.load(data, f"--models {path}")  # JSON is YAML too
    entries = data.get("models") if isinstance(data, dict) else data
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"--models {path}: expected a list of model specs (or {{\"models\": [...]}})")
    specs = []
    for i, entry in enumerate(entries):
        try:
            specs.append(ModelSpec.parse(entry, defaults, f"--models {path}: entry {i + 1}"))
        except HostError as exc:
            raise ConfigError(str(exc)) from None
    check_unique(specs)
    return specs


def check_unique(specs: list[ModelSpec]) -> None:
    seen = set()
    for spec in specs:
        if spec.name in seen:
            raise ConfigError(f"the model name {spec.name!r} is given twice: each model needs its own")
        seen.add(spec.name)


class HostedModel:
    """One model of the host, loaded or not."""

    def __init__(self, spec: ModelSpec):
        self.spec = spec
        self.engine: AsyncEngine | None = None
        self.model: ModelConfig | None = None  # resolved, while loaded
        self.devices: list[str] = []
        self.error: str | None = None  # why the last load failed, when it did
        self.unloading = False
        self.last_used = time.monotonic()
        self.loading: asyncio.Task | None = None  # the load under way, for on-demand requests to wait on
        self.keep_alive_s = spec.keep_alive_s  # the spec's, or what the last request that said set (keep_for)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def status(self) -> str:
        """available, loading, ready, recovering, failed (see `error`) or unloading."""
        if self.unloading:
            return "unloading"
        if self.engine is None:
            if self.loading is not None:
                return "loading"
            return "failed" if self.error else "available"
        state = self.engine.state
        if state is EngineState.FAILED:
            return "failed"
        return "unloading" if state is EngineState.SHUTTING_DOWN else state.value

    def keep_for(self, seconds: float | None) -> None:
        """A request's keep_alive (Ollama's): how long this model may stay idle from now on; None:
        for good. Only a model that loads on demand takes it, since nothing would load one loaded at
        start-up again."""
        if self.spec.load == "on_demand":
            self.keep_alive_s = seconds

    @property
    def in_flight(self) -> int:
        return len(self.engine.open_streams) if self.engine is not None else 0

    def describe(self) -> dict:
        """The model as /v1/models and /admin/models show it."""
        engine = self.engine.engine if self.engine is not None else None  # the LLMEngine, once loaded
        out: dict[str, Any] = {"status": self.status, "tp": self.spec.engine.tp, "devices": self.devices,
                               "load": self.spec.load, "keep_alive": self.keep_alive_s}
        error = self.error or (self.engine.error if self.engine is not None else None)
        if error and self.status == "failed":
            out["error"] = error
        if engine is not None:
            out.update(engine.footprint())
        return out


class AdapterEngine:
    """A base model's engine as the requests for one of its LoRA adapters see it: it answers to the
    adapter's name and every request it opens runs the adapter; the rest is the base engine's."""

    def __init__(self, engine: AsyncEngine, adapter: str):
        self.base, self.model_name = engine, adapter

    def open(self, *args, **kwargs):
        return self.base.open(*args, lora=self.model_name, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.base, name)


EngineFactory = Callable[[ModelConfig, ModelSpec], AsyncEngine]


class ModelHost:
    """The models of one server, by name."""

    def __init__(self, specs: list[ModelSpec], metrics: Metrics | None = None, max_waiting: int | None = None,
                 memory_budget: int | None = None, load_timeout_s: float | None = None,
                 make_engine: EngineFactory | None = None, defaults: EngineConfig | None = None):
        """`defaults`: the arguments a spec loaded later (the admin API) starts from: the command
        line's options."""
        check_unique(specs)
        self.models: dict[str, HostedModel] = {spec.name: HostedModel(spec) for spec in specs}
        self.defaults = defaults or EngineConfig()
        self.metrics = metrics or Metrics()
        self.max_waiting = settings().max_waiting if max_waiting is None else max_waiting
        self.ledger = MemoryLedger(memory_budget)
        self.load_timeout_s = settings().load_timeout_s if load_timeout_s is None else load_timeout_s
        self._make_engine = make_engine or self._engine
        self._lock: asyncio.Lock | None = None  # one load's pre-flight and placement at a time
        self._reaper: asyncio.Task | None = None
        self._stopping = False
        self.adapter_idle: dict[str, list[float]] = {}  # LoRA adapters with a keep_alive: [seconds, last use]
        self.adapter_rest: dict[str, list[float]] = {}  # the same for a request's keep_alive (`keep_adapter` with rest)

    @classmethod
    def of_engine(cls, engine: AsyncEngine, **kwargs) -> "ModelHost":
        """A host of one engine made already (a single-model server's: it resolves and loads its
        model in its own thread, as it always has)."""
        spec = ModelSpec(engine.model_name, kwargs.pop("defaults", None) or EngineConfig())
        host = cls([spec], metrics=engine.metrics.server, **kwargs)
        host.models[spec.name].engine = engine
        return host

    # ---- lifecycle (the event loop) ----

    def start(self) -> None:
        """Begin loading the start-up models (one after another, each pre-flighted against what the
        ones before it took), and watch keep_alive."""
        self._lock = asyncio.Lock()
        for m in self.models.values():
            if m.engine is not None:  # made already (of_engine)
                m.engine.start()
            elif m.spec.load == "startup":
                m.loading = asyncio.ensure_future(self._load_in_turn(m))
        self._reaper = asyncio.ensure_future(self._reap())

    @property
    def single(self) -> HostedModel | None:
        """The model of a host of one model loaded at start-up (whose /health is that model's)."""
        if len(self.models) != 1:
            return None
        m = next(iter(self.models.values()))
        return m if m.spec.load == "startup" and m.engine is not None else None

    @property
    def starting(self) -> bool:
        """A model loaded at start-up is still on its way (resolving, or its engine loading)."""
        return any(m.spec.load == "startup" and (m.loading is not None or m.status == "loading")
                   for m in self.models.values())

    @property
    def startup_ready(self) -> bool:
        return all(m.status == "ready" for m in self.models.values() if m.spec.load == "startup")

    def model(self, name: str | None) -> HostedModel:
        """The model a request names; UnknownModel listing the names served otherwise."""
        m = self.models.get(name) if name else None
        if m is None:
            served = ", ".join(f"`{n}`" for n in self.models) or "no model"
            raise UnknownModel(f"the model `{name}` does not exist; this server serves {served}")
        return m

    async def engine_for(self, name: str) -> AsyncEngine:
        """The engine of model `name`, loading it first if it is on demand and not loaded (the
        request waits up to load_timeout_s, then gets the engine in whatever state it is in: the
        handlers answer 503 with Retry-After for one still loading)."""
        if name not in self.models and (base := self.adapter_base(name)) is not None:
            for idle in (self.adapter_idle, self.adapter_rest):
                if name in idle:
                    idle[name][1] = time.monotonic()
            return AdapterEngine(await self.engine_for(base.name), name)
        m = self.model(name)
        m.last_used = time.monotonic()
        if m.spec.load == "on_demand" and not m.unloading:
            if m.engine is None and m.loading is None:
                m.loading = asyncio.ensure_future(self._load_in_turn(m))
            if m.loading is not None:  # this request's load, or one under way: queue behind it
                await asyncio.wait({m.loading}, timeout=self.load_timeout_s)
                m.last_used = time.monotonic()  # keep_alive counts from now, not from before the load
        if m.engine is None:
            raise _not_loaded(m)
        return m.engine

    # ---- LoRA adapters: served by name on a loaded base model (engine/lora.py) ----

    def adapter_base(self, name: str) -> HostedModel | None:
        """The loaded model that serves LoRA adapter `name`, if one does."""
        return next((m for m in self.models.values() if _serves_lora(m) and name in m.engine.engine.loras.adapters),
                    None)

    def adapters(self) -> list[tuple[str, str, str]]:
        """Every adapter served: its name, its base model's and its folder."""
        return [(a.name, m.name, a.path) for m in self.models.values() if _serves_lora(m)
                for a in list(m.engine.engine.loras.adapters.values())]

    async def load_lora(self, name: str, path: str, base: str | None = None,
                        keep_alive_s: float | None = None) -> HostedModel:
        """Serve the PEFT adapter at `path` as `name` on model `base` (None: the one model with LoRA
        enabled), unloaded once idle for `keep_alive_s` (None: kept). Checked against the base
        before any rank sees it: a bad adapter is refused (400, naming why) and nothing loaded
        changes. It reaches the ranks with its first request."""
        if not isinstance(name, str) or not name or len(name) > 256 or any(c in name for c in "\n\r\t/"):
            raise HostError(f"lora_name must be a non-empty string of at most 256 characters without slashes or "
                            f"newlines, got {name!r:.80}")
        if not isinstance(path, str) or not path:
            raise HostError(f"lora_path must be the adapter's folder, got {path!r:.80}")
        if name in self.models or self.adapter_base(name) is not None:
            raise ModelExists(f"a model or LoRA adapter named `{name}` is already served; unload it first")
        m = self._lora_base(base)
        try:
            await asyncio.to_thread(then_release_pool, m.engine.engine.loras.register, name, path)
        except ConfigError as exc:
            raise HostError(str(exc)) from None
        self.keep_adapter(name, keep_alive_s)
        log.info("LoRA adapter `%s` loaded on `%s` from %r", name, m.name, path)
        return m

    def keep_adapter(self, name: str, keep_alive_s: float | None, rest: bool = False) -> None:
        """LoRA adapter `name` unloaded once idle for `keep_alive_s` from now (None: kept). With
        `rest`, a request's keep_alive (Ollama's): once idle that long, only its weights leave the
        ranks (`LoraSlots.rest`) and its next request loads them again. The adapter stays served:
        one client's request never takes it from the others, as a request's keep_alive never
        unloads a model loaded at start-up for good."""
        timers = self.adapter_rest if rest else self.adapter_idle
        if keep_alive_s is None:
            timers.pop(name, None)
        else:
            timers[name] = [keep_alive_s, time.monotonic()]

    def adapter_resting(self, name: str) -> bool:
        """Whether adapter `name`'s weights left the ranks while it was idle and no request has loaded
        them since."""
        m = self.adapter_base(name)
        adapter = m.engine.engine.loras.adapters.get(name) if m is not None else None
        return adapter is not None and adapter.resting

    def _lora_base(self, base: str | None) -> HostedModel:
        """Model `base`, or the one model with LoRA enabled; it must be loaded."""
        lora = [m for m in self.models.values() if _serves_lora(m) or m.spec.engine.enable_lora]
        if base is None and len(lora) != 1:
            raise HostError("name the base model the adapter is for (`base`): "
                            + (f"{len(lora)} models serve LoRA adapters" if lora else
                               "no model serves LoRA adapters (start it with --enable-lora)"))
        m = lora[0] if base is None else self.model(base)
        if not _serves_lora(m):
            raise HostError(f"model `{m.name}` does not serve LoRA adapters (it needs enable_lora, and to be "
                            f"loaded; it is {m.status})")
        return m

    async def unload_lora(self, name: str, drain_s: float = 0.0) -> int:
        """Stop serving adapter `name`: requests for it in flight get `drain_s` to finish, then end
        with an error; how many were cancelled."""
        m = self.adapter_base(name)
        if m is None:
            raise UnknownModel(f"no LoRA adapter named `{name}` is loaded")
        self.adapter_idle.pop(name, None)
        self.adapter_rest.pop(name, None)
        cancelled = await m.engine.unload_lora(name, drain_s)
        log.info("LoRA adapter `%s` unloaded from `%s` (%d request(s) cancelled)", name, m.name, cancelled)
        return cancelled

    async def load(self, spec: ModelSpec, wait: bool = True) -> HostedModel:
        """Load a model the host does not serve yet (ModelExists otherwise); with `wait`, once it is
        ready (or its load failed: its error is raised). The pre-flight refuses it before any worker
        starts when it does not fit (InsufficientMemory)."""
        if spec.name in self.models:
            raise ModelExists(f"a model named `{spec.name}` is already {self.models[spec.name].status}; unload it "
                              "first, or load under another name")
        m = self.models[spec.name] = HostedModel(spec)
        m.loading = task = asyncio.ensure_future(self._load_in_turn(m))
        if not wait:
            return m
        await asyncio.wait({task})
        if m.engine is None:
            self._forget(m)  # a refused load leaves nothing behind
            raise task.exception() or HostError(m.error or f"model `{spec.name}` was unloaded while it loaded")
        engine = m.engine
        await self._until_loaded(engine, None)
        if engine.state is not EngineState.READY and m.engine is engine:
            error = engine.error
            await self._unload(m, 0.0, forget=True)  # nor does a failed one: its workers are gone, its memory back
            self._forget(m)
            raise HostError(f"model `{spec.name}` failed to load: {error}")
        return m

    def _forget(self, m: HostedModel) -> None:
        """Take `m` off the map, unless the name is another model's by now (unloaded and loaded again)."""
        if self.models.get(m.name) is m:
            del self.models[m.name]

    async def unload(self, name: str, drain_s: float = 0.0) -> None:
        """Unload a model: new requests for it are refused at once, those in flight get up to
        `drain_s` to finish and the rest end with an error and finish_reason `abort`; returns once
        its workers have exited and its memory is given back."""
        m = self.models.get(name)
        if m is None and self.adapter_base(name) is not None:
            await self.unload_lora(name, drain_s)
            return
        if m is None or (m.engine is None and m.loading is None and m.status != "failed"):
            raise UnknownModel(f"no model named `{name}` is loaded")
        await self._unload(m, drain_s, forget=True)

    async def _unload(self, m: HostedModel, drain_s: float, forget: bool) -> None:
        if m.unloading:
            while m.unloading:
                await asyncio.sleep(0.05)
            return
        m.unloading = True
        try:
            while m.loading is not None and not m.loading.done() and m.engine is None:
                await asyncio.sleep(0.05)  # resolving or waiting its turn: no engine to stop yet
            engine, m.engine = m.engine, None
            if engine is not None:
                try:
                    await engine.drain(drain_s, why=f"model `{m.name}` is being unloaded", failure_kind="unloaded")
                    await asyncio.to_thread(engine.stop)
                    engine.metrics.forget()
                except Exception:  # the engine is let go all the same: the model must not stay half unloaded
                    log.exception("model `%s` did not stop cleanly", m.name)
            m.model = None
            self.ledger.release(m.name)
            gc.collect()
            _trim_memory()
            log.info("model `%s` unloaded", m.name)
        finally:
            m.unloading, m.loading, m.error = False, None, None
            m.devices = []
            if forget and not self._stopping and m.spec.load != "on_demand":
                self._forget(m)

    def describe(self) -> dict[str, dict]:
        return {name: m.describe() for name, m in self.models.items()}

    # ---- loading ----

    async def _load_in_turn(self, m: HostedModel) -> None:
        """Resolve, pre-flight and start one model, the host's loads one at a time (each sees what
        the ones before it took). A refusal or failure is the model's `error`; the engine itself then
        loads in its own thread, as a single-model server's does."""
        try:
            async with self._lock:
                model = await asyncio.to_thread(resolve_model_config, m.spec.engine)
                model, m.devices = await self._make_room(m, model)
                m.model = model
                m.engine = engine = self._make_engine(model, m.spec)
                engine.start()
                m.error = None
                # one load at a time, to its end: the next pre-flight sees what this one took
                await self._until_loaded(engine, None)
                if engine.state is EngineState.FAILED and m.engine is engine:  # its ranks are stopped already
                    error = engine.error
                    m.engine, m.model, m.devices = None, None, []
                    self.ledger.release(m.name)
                    await asyncio.to_thread(engine.stop)
                    engine.metrics.forget()
                    raise LoadFailed(m.name, error or "its ranks failed")
        except Exception as exc:
            m.error = exc.cause if isinstance(exc, LoadFailed) else str(exc)
            log.error("model `%s` was not loaded: %s", m.name, exc)
            if isinstance(exc, NeuronError):
                raise
            raise HostError(str(exc)) from exc
        finally:
            m.loading = None

    async def _make_room(self, m: HostedModel, model: ModelConfig) -> tuple[ModelConfig, list[str]]:
        """Place the model's ranks and check its bytes against what their devices have left,
        unloading idle on-demand models, least recently used first, until it fits; InsufficientMemory
        with the sizes when it cannot. Returns the model with its KV budget set where the devices
        hold less than the default asks for, and its devices."""
        devices = place(model, self.ledger.taken_gpus(), m.spec.share_devices)
        fitted, shortfall = self.ledger.fit(m.name, model, devices)
        idle = frozenset(v.name for v in self._evictable(exclude=m))
        if fitted is None and self.ledger.fit(m.name, model, devices, without=idle, reserve=False)[0] is None:
            # unloading every idle model would not make room either: keep them
            raise InsufficientMemory(f"model `{m.name}` does not fit: {shortfall}; unload a model first")
        while fitted is None:
            idle_now = self._evictable(exclude=m)
            if not idle_now:  # one took a request meanwhile
                raise InsufficientMemory(f"model `{m.name}` does not fit: {shortfall}; unload a model first")
            victim = min(idle_now, key=lambda v: v.last_used)
            log.info("unloading idle model `%s` (last used %.0f s ago) to make room for `%s`", victim.name,
                     time.monotonic() - victim.last_used, m.name)
            await self._unload(victim, 0.0, forget=False)
            fitted, shortfall = self.ledger.fit(m.name, model, devices)
        return fitted, devices

    def _evictable(self, exclude: HostedModel) -> list[HostedModel]:
        """The loaded models that may go to make room: on demand (start-up ones are pinned), ready,
        with nothing in flight."""
        return [m for m in self.models.values() if m is not exclude and m.spec.load == "on_demand"
                and m.engine is not None and m.status == "ready" and not m.in_flight]

    def _engine(self, model: ModelConfig, spec: ModelSpec) -> AsyncEngine:
        """A model's engine, loading in its own thread within its deadline."""
        load, interrupt = interruptible_load(model)
        return AsyncEngine(load, model_name=spec.name, max_running=spec.engine.max_num_seqs,
                           max_waiting=self.max_waiting, metrics=self.metrics.for_model(spec.name),
                           interrupt=interrupt)

    @staticmethod
    async def _until_loaded(engine: AsyncEngine, timeout_s: float | None) -> None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while engine.state is EngineState.LOADING and (deadline is None or time.monotonic() < deadline):
            await asyncio.sleep(0.05)

    # ---- keep_alive ----

    async def _reap(self) -> None:
        """Unload each model idle past its keep_alive (a model in use is never idle)."""
        while not self._stopping:
            await asyncio.sleep(_REAP_INTERVAL_S)
            now = time.monotonic()
            for m in list(self.models.values()):
                if m.engine is None or m.unloading or m.keep_alive_s is None:
                    continue
                if m.in_flight or m.status != "ready":
                    m.last_used = now  # idleness counts from the last request's end
                    continue
                # keep_alive 0 still leaves a request that has just been routed here a moment to be submitted
                if now - m.last_used >= max(m.keep_alive_s, _MIN_IDLE_S):
                    log.info("model `%s` idle for %.0f s (keep_alive %g s): unloading", m.name,
                             now - m.last_used, m.keep_alive_s)
                    await _logged(self._unload(m, 0.0, forget=False), f"unloading idle model `{m.name}`")
            await _logged(self._reap_adapters(now), "unloading idle LoRA adapters")

    async def _reap_adapters(self, now: float) -> None:
        """Unload each LoRA adapter idle past its keep_alive, and rest the weights of each idle past a
        request's (one with requests in flight is not idle)."""
        for idle, resting in ((self.adapter_idle, False), (self.adapter_rest, True)):
            for name, (keep_s, since) in list(idle.items()):
                m = self.adapter_base(name)
                if m is None:
                    idle.pop(name, None)
                elif any(stream.lora == name for stream in m.engine.open_streams):
                    idle[name][1] = now
                elif now - since < max(keep_s, _MIN_IDLE_S):
                    continue
                elif resting:
                    log.info("LoRA adapter `%s` idle for %.0f s (a request's keep_alive %g s): its weights leave "
                             "the ranks until its next request", name, now - since, keep_s)
                    idle.pop(name, None)
                    m.engine.rest_lora(name)
                else:
                    log.info("LoRA adapter `%s` idle for %.0f s (keep_alive %g s): unloading", name, now - since,
                             keep_s)
                    await self.unload_lora(name)

    # ---- shutdown ----

    async def drain(self, grace_s: float, hurry: asyncio.Event | None = None) -> int:
        """Every model's drain at once (the server's shutdown); how many requests were cancelled."""
        engines = [m.engine for m in self.models.values() if m.engine is not None]
        counts = await asyncio.gather(*(e.drain(grace_s, hurry) for e in engines))
        return sum(counts)

    def stop(self) -> None:
        """Stop every engine (blocks; off the event loop)."""
        self._stopping = True
        if self._reaper is not None:
            self._reaper.cancel()
        for m in list(self.models.values()):
            if m.engine is not None:
                m.engine.stop()


async def _logged(work, what: str) -> None:
    """Await `work`; a failure is logged, so the keep_alive loop goes on watching every other model."""
    try:
        await work
    except Exception:
        log.exception("%s failed", what)


def _serves_lora(m: HostedModel) -> bool:
    return m.engine is not None and m.engine.loaded and getattr(m.engine.engine, "loras", None) is not None


def _not_loaded(m: HostedModel) -> HostError:
    """503 for a request whose model is not loaded: its load failed (the next request tries
    again), or it is still loading or being unloaded."""
    exc = HostError(f"model `{m.name}` failed to load: {m.error}" if m.error else f"model `{m.name}` is {m.status}")
    exc.status, exc.code = 503, "model_failed" if m.error else f"model_{m.status}"
    return exc


def _trim_memory() -> None:
    """Give the freed heap back to the system (glibc keeps it otherwise), so an unload shows."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def parse_memory_budget(value: int | str | None) -> int | None:
    return None if value is None else parse_bytes(value, "memory_budget")
