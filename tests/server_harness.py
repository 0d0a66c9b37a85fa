"""Servers for tests and what tests do with them: a live server in the test process (Uvicorn on a
free 127.0.0.1 port, in a thread), `neuron serve` as a subprocess, a scripted stand-in for the
engine for tests about the HTTP layer rather than the model, and the clients, metric reads and
polling that tests of any of them share."""

from __future__ import annotations

import logging
import os
import queue
import re
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import anthropic
import httpx
import ollama
import openai
import uvicorn

from neuron.engine.async_engine import AsyncEngine
from neuron.engine.llm_engine import EngineConfig, LLMEngine, RequestError, Update
from neuron.engine.structured_output import StructuredOutput
from neuron.entrypoints.openai.app import ServerConfig, build_app
from neuron.entrypoints.openai.shutdown import GracefulServer
from neuron.entrypoints.serve import served_name
from neuron.utils import procfs
from neuron.utils.procfs import child_pids


class LiveServer:
    def __init__(self, engine: AsyncEngine, cfg: ServerConfig | None = None):
        self.engine = engine
        cfg = cfg or ServerConfig()
        app = build_app(engine, cfg)
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", timeout_graceful_shutdown=2)
        self._server = GracefulServer(config, engine, cfg.shutdown_grace_s)
        self._thread = threading.Thread(target=self._server.run, name="test-server", daemon=True)

    def __enter__(self) -> "LiveServer":
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.base_url = f"{self.url}/v1"
        return self

    def wait_ready(self, timeout_s: float = 120) -> "LiveServer":
        deadline = time.monotonic() + timeout_s
        while httpx.get(f"{self.url}/health").status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not ready: {httpx.get(self.url + '/health').text}")
            time.sleep(0.05)
        return self

    def begin_shutdown(self) -> None:
        """What SIGTERM does to `neuron serve`: drain, then stop."""
        self._server.begin_shutdown()

    def wait_stopped(self, timeout_s: float = 30) -> bool:
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(30)


def real_engine(model: str | None, tp: int, name: str | None = None, max_waiting: int = 64, **kw) -> AsyncEngine:
    cfg = EngineConfig(model=model, tp=tp, device="cpu", dtype="float32", served_model_name=name, **kw)
    return AsyncEngine(lambda: LLMEngine(cfg).start(), model_name=served_name(cfg), max_running=cfg.max_num_seqs,
                       max_waiting=max_waiting)


ERROR = object()  # a script step that fails the request, as a broken pool would
RAISE = object()  # a script step on which step() raises, as a bug in the scheduler would


class ScriptedEngine:
    """Stands in for LLMEngine: answers each request with the text pieces of the first script whose
    key occurs in its prompt, one piece per step. A float step sleeps that many seconds; clearing
    `gate` stalls every request. Grammars compile for real (their 400s are the server's), but the
    script stands in for what a model would write under them."""

    def __init__(self, tokenizer, scripts: dict[str, list], max_model_len: int = 512):
        self.tokenizer = tokenizer
        self.structured = StructuredOutput(tokenizer, tokenizer.vocab_size, [])
        self.scripts = scripts
        self.model_name = "stub"
        self.max_model_len = max_model_len
        self.vocab_size = tokenizer.vocab_size
        # what LLMEngine keeps in its ModelConfig, executor and input processor, and the handlers ask
        self.model = SimpleNamespace(quantization=None, speculative=None, vision=None, eos_token_ids=(),
                                     default_sampling=dict, model_type="stub", hf_config={}, gguf=None,
                                     model_dir=None, spec=SimpleNamespace(quantization=None, dtype="float32"),
                                     tasks=frozenset({"generate"}), pooling=None)
        self.executor = SimpleNamespace(kernels=dict, memory=list)
        self.inputs = self
        self.eos_token_ids: list[int] = []
        self.gate = threading.Event()
        self.gate.set()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._active: dict[str, tuple[int, list, bool]] = {}  # prompt tokens, script, whether it wants logprobs
        self.cache_salts: dict[str, str | None] = {}  # each request's cache salt, by request id
        self.was_shut_down = False

    failure = None
    spec = None  # no speculative decoding

    def footprint(self) -> dict:
        return {"tp": 1, "devices": ["cpu"], "quantization": None, "max_model_len": self.max_model_len,
                "weight_bytes": 0}

    def on_failure(self, callback) -> None:
        pass

    def validate(self, prompt_token_ids, params, images=None) -> int:
        if len(prompt_token_ids) >= self.max_model_len:
            raise RequestError("prompt too long", code="context_length_exceeded", param="messages")
        if any(not 0 <= t < self.vocab_size for t in prompt_token_ids):
            raise RequestError("token id outside the vocabulary", param="prompt")
        return params.max_tokens

    def add_request(self, request_id, prompt_token_ids, params, images=None, grammar=None, cache_salt=None,
                    lora=None, types_from=None) -> None:
        assert types_from is None  # a scripted decoder: no encoder's pairs
        self.validate(prompt_token_ids, params, images)
        prompt = self.tokenizer.decode(prompt_token_ids, skip_special_tokens=False)
        script = next((s for key, s in self.scripts.items() if key in prompt), ["ok"])
        self.cache_salts[request_id] = cache_salt
        wants_logprobs = getattr(params, "logprobs", None) is not None
        self._inbox.put((request_id, (len(prompt_token_ids), list(script), wants_logprobs)))

    def abort(self, request_id) -> None:
        self._inbox.put((request_id, None))

    def has_unfinished(self) -> bool:
        return bool(self._active) or not self._inbox.empty()

    def num_running(self) -> int:
        return len(self._active)

    def num_waiting(self) -> int:
        return 0

    def kv_slot_usage(self) -> float:
        return 0.0

    def kv_cache_usage(self) -> float:
        return 0.0

    def prefix_cache_counts(self) -> tuple[int, int]:
        return 0, 0

    def step(self) -> list[Update]:
        while not self._inbox.empty():
            rid, item = self._inbox.get()
            if item is None:
                self._active.pop(rid, None)
            else:
                self._active[rid] = item
        if not self.gate.wait(0.01):
            return []
        updates = []
        for rid, (n_prompt, pieces, wants_logprobs) in list(self._active.items()):
            piece = pieces.pop(0)
            if isinstance(piece, float):
                time.sleep(piece)
                continue
            if piece is ERROR:
                del self._active[rid]
                updates.append(Update(rid, [], "", None, True, "error", error="rank 1 exited"))
                continue
            if piece is RAISE:
                raise RuntimeError("invalid multinomial distribution")
            done = not pieces
            if done:
                del self._active[rid]
            logprobs = [{1: 0.0}] if wants_logprobs else None  # token 1, certain: what the script writes
            updates.append(Update(rid, [1], piece, logprobs, done, "stop" if done else None, None, None, n_prompt))
        return updates

    def fail_in_flight(self, message: str) -> list[Update]:
        failed = [Update(rid, [], "", None, True, "error", error=message) for rid in self._active]
        self._active.clear()
        return failed

    def shutdown(self) -> None:
        self.was_shut_down = True


def scripted_engine(engine: ScriptedEngine, max_running: int = 4, max_waiting: int = 4, factory=None) -> AsyncEngine:
    return AsyncEngine(factory or (lambda: engine), model_name="stub", max_running=max_running,
                       max_waiting=max_waiting)


class ServeProcess:
    """`python -m neuron serve ARGS --port 0` as a subprocess: its URL (from the log line that says it
    is ready), its log lines, and its worker processes."""

    def __init__(self, *args: str, env: dict[str, str] | None = None):
        cmd = [sys.executable, "-m", "neuron", "serve", *args, "--port", "0", "--log-level", "info"]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
        self.pid = self.proc.pid
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.proc.stderr), daemon=True).start()

    def __enter__(self) -> "ServeProcess":
        deadline = time.monotonic() + 120
        while not any("ready: serving" in line for line in self.lines):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server did not start:\n" + "".join(self.lines[-30:]))
            time.sleep(0.05)
        ready = next(line for line in self.lines if "ready: serving" in line)
        self.url = re.search(r"(http://127\.0\.0\.1:\d+)/v1", ready).group(1)
        self.base_url = f"{self.url}/v1"
        return self

    def workers(self) -> list[int]:
        return child_pids(self.pid)

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


def gone(pid: int) -> bool:
    """The process has exited (a zombie that its new parent has not reaped yet counts)."""
    return not procfs.alive(pid)


def client(server, api_key: str = "unused", **kw) -> openai.OpenAI:
    """The official client on a server of any kind; no retries, so a test sees every error."""
    return openai.OpenAI(base_url=server.base_url, api_key=api_key, max_retries=0, timeout=60, **kw)


def ollama_client(server, **kw) -> ollama.Client:
    """The official Ollama client on a server of any kind (it speaks to the root, not /v1)."""
    return ollama.Client(host=server.url, timeout=60, **kw)


def async_client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def anthropic_client(server, api_key: str | None = "unused", **kw) -> anthropic.Anthropic:
    """Anthropic's official client on a server of any kind (it sends the key as x-api-key; pass
    `auth_token` instead for a bearer token); no retries, so a test sees every error."""
    return anthropic.Anthropic(base_url=server.url, api_key=api_key, max_retries=0, timeout=60, **kw)


def token_ids(logprobs) -> list[int]:
    """The ids of completion logprobs rendered with `return_tokens_as_token_ids`."""
    return [int(t.removeprefix("token_id:")) for t in logprobs.tokens]


def metric(server, name: str) -> float:
    """One sample from /metrics, `name` with its labels, summed over the models that carry it (a
    server of one model has one); 0 before the series first appears."""
    text = httpx.get(f"{server.url}/metrics").text
    if "{" in name:  # labels given: the model's label may come first or after them
        head, labels = name.rstrip("}").split("{", 1)
        pattern = rf"^{re.escape(head)}\{{(?:model=\"[^\"]*\",)?{re.escape(labels)}(?:,model=\"[^\"]*\")?\}} (\S+)$"
    else:
        pattern = rf"^{re.escape(name)}(?:\{{model=\"[^\"]*\"\}})? (\S+)$"
    return sum(float(v) for v in re.findall(pattern, text, re.M))


def wait_until(predicate, timeout_s: float = 5.0, message: str = "condition not reached") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, message
        time.sleep(0.01)


class Records(logging.Handler):
    """Records of the loggers it is attached to, whether or not they propagate."""

    def __init__(self, *names: str):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.loggers = [logging.getLogger(n) for n in names]

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def __enter__(self) -> "Records":
        for logger in self.loggers:
            logger.addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        for logger in self.loggers:
            logger.removeHandler(self)

    def errors(self) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno >= logging.ERROR]


def open_fds(pid: int | str = "self") -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def listening(pid: int | str = "self") -> set[str]:
    """`address:port` (hex, as /proc/net/tcp has them) of the TCP listeners process `pid` holds."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for row in f.read().splitlines()[1:]:
                cols = row.split()
                if cols[3] == "0A" and cols[9] in inodes:  # TCP_LISTEN
                    found.add(cols[1])
    return found


def health(server) -> dict:
    return httpx.get(f"{server.url}/health").json()
