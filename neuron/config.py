"""Every setting neuron reads, in one table: name, environment variable, type, default, bounds and
help. `settings()` parses the `NEURON_*` environment into a frozen `Settings`, checking each value;
the engine, executor, wire and server configs and the command-line flags take their defaults from
it, so a default is written here and nowhere else.

Torch-free on purpose: the wire (neuron.rpc) imports it in mock workers without a GPU.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from neuron.errors import ConfigError

PREFIX = "NEURON_"
MAX_MODEL_LEN_CAP = 8192  # max_model_len left unset: the model's limit, capped here
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass(frozen=True, slots=True)
class Setting:
    """One row of the table. `kind` is int, float, str, bool, or "bytes" (an int that may be
    written with a unit, 4GiB). A None default means unset; `unset` says what that does."""

    kind: type | str
    default: Any
    help: str
    lo: float | None = None
    hi: float | None = None
    above: bool = False  # the value must exceed `lo`, not merely reach it
    choices: tuple[str, ...] = ()
    unset: str | None = None
    name: str = ""

    @property
    def env(self) -> str:
        return PREFIX + self.name.upper()

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def allowed(self) -> str:
        """What the setting takes, in words, for error messages and help."""
        if self.kind is bool:
            return "1, true, yes or on (or 0, false, no, off)"
        if self.choices:
            return "one of " + ", ".join(self.choices)
        if self.kind is str:
            return "a non-empty string"
        noun = {int: "an integer", float: "a number", "bytes": "a positive byte count (such as 4096, 512MiB or 4GiB)"}
        return noun[self.kind] + self._bounds()

    def _bounds(self) -> str:
        if self.lo is not None and self.hi is not None:
            return f" in ({self.lo:g}, {self.hi:g}]" if self.above else f" in {self.lo:g}..{self.hi:g}"
        if self.lo is not None:
            return f" > {self.lo:g}" if self.above else f" >= {self.lo:g}"
        return ""

    def shown(self) -> str:
        """The default as help and the README show it."""
        if self.default is None:
            return self.unset or "unset"
        if self.kind is bool:
            return "on" if self.default else "off"
        if self.kind == "bytes":
            return format_bytes(self.default)
        return f"{self.default:g}" if self.kind is float else str(self.default)

    def parse(self, text: str) -> Any:
        """The value `text` stands for; ValueError saying what is allowed when it stands for none."""
        try:
            value = _convert(self, text.strip())
        except (ValueError, ConfigError):
            value = None
        if value is None or not self.fits(value):
            raise ValueError(f"expected {self.allowed()}, got {text!r}")
        return value

    def fits(self, value: Any) -> bool:
        if self.kind is bool:
            return isinstance(value, bool)
        if self.choices:
            return value in self.choices
        if self.kind is str:
            return isinstance(value, str) and value != ""
        number = (int, float) if self.kind is float else int
        if isinstance(value, bool) or not isinstance(value, number):
            return False
        return self._in_bounds(value) and (self.kind != "bytes" or value > 0)

    def _in_bounds(self, n: float) -> bool:
        if math.isnan(n):
            return False
        low_ok = self.lo is None or (n > self.lo if self.above else n >= self.lo)
        return low_ok and (self.hi is None or n <= self.hi)

    def check(self, value: Any, what: str | None = None) -> Any:
        """`value` itself when the table allows it (None too where the default is unset); else a
        ConfigError naming `what` (a config field) and what it takes."""
        if (value is None and self.default is None) or self.fits(value):
            return value
        raise ConfigError(f"{what or self.name} must be {self.allowed()}, got {value!r}")


def _convert(s: Setting, text: str) -> Any:
    if s.kind is bool:
        low = text.lower()
        return True if low in _TRUE else False if low in _FALSE else None
    if s.choices:
        return text.lower()
    if s.kind == "bytes":
        return parse_bytes(text)
    return s.kind(text)


def _setting(kind: type | str, default: Any, help: str, **bounds: Any) -> Any:
    return field(default=default, metadata={"setting": Setting(kind, default, help, **bounds)})


@dataclass(frozen=True, slots=True)
class Settings:
    """The value of every setting; each comes from NEURON_<NAME> or its default (the table is `SETTINGS`)."""

    # What is served, and how it is split.
    model: str | None = _setting(
        str, None, "checkpoint directory or Hugging Face repo id in the local cache",
        unset="the embedded tiny default model, whose random weights make noise")
    served_model_name: str | None = _setting(str, None, "the name clients pass as `model`",
                                             unset="MODEL as given")
    models: str | None = _setting(
        str, None, "a JSON or YAML file listing the models to serve, each {name, model, and optionally tp, devices, "
        "dtype, quantization, max_model_len, speculative_config, hf_overrides, keep_alive, load (startup or "
        "on_demand), ...}; the other options are every model's defaults (README: Several models)",
        unset="MODEL(s) given on the command line")
    ollama_store: bool = _setting(
        bool, False, "also serve every model in Ollama's local store ($OLLAMA_MODELS, ~/.ollama/models) that "
        "neuron reads, by its Ollama name (qwen3:0.6b), each loaded at its first request and unloaded after "
        "keep_alive idle, as Ollama's server does")
    tokenizer: str | None = _setting(
        str, None, "a folder or cached repo id whose tokenizer.json (and chat template, generation_config.json) "
        "to use instead of the checkpoint's", unset="the checkpoint's own, or the one a GGUF file carries")
    chat_template: str | None = _setting(
        str, None, "a Jinja chat template used instead of the tokenizer's, as vLLM's --chat-template: a file, or the "
        "template itself; for a classification model, the template that renders a pair to score (a query message "
        "and a document message)", unset="the tokenizer's own")
    hf_overrides: str | None = _setting(
        str, None, "a JSON object merged into the checkpoint's config.json as it is read, such as "
        '\'{"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}\' '
        "to run a model past its native context with YaRN", unset="config.json as it is")
    task: str = _setting(
        str, "auto", "what the model is served for: generate (chat and completions), embed (/v1/embeddings, "
        "pooling the final hidden states), generate,embed (both), or classify (/classify, and /score and /rerank "
        "as a cross-encoder: a *ForSequenceClassification checkpoint's head over the last token, or "
        "classifier_from_token in --hf-overrides); auto is embed for a sentence-transformers checkpoint "
        "(modules.json with a Pooling module), a GGUF file with a pooling type or an encoder (BERT, RoBERTa), "
        "classify for a sequence-classification one, else generate",
        choices=("auto", "generate", "embed", "generate,embed", "classify"))
    tp: int = _setting(int, 1, "tensor-parallel size: how many ranks (devices) share the model", lo=1)
    hosts: str | None = _setting(
        str, None, "where the ranks run, in rank order: HOST:N entries, comma-separated (the first the leader's "
        "own host, localhost or its name: localhost:2,gpu2:2), or a file of them", unset="every rank on this machine")
    worker_launcher: str = _setting(str, "ssh -T {host}", "the command that starts a rank on another host of "
                                    "--hosts ({host} replaced; neuron --worker ... appended; its stdin and stdout "
                                    "carry the protocol): srun, kubectl exec -i and ip netns exec work alike; "
                                    "connect: those ranks are started elsewhere and dial in (neuron --worker "
                                    "--connect)")
    cluster_address: str | None = _setting(
        str, None, "the leader's IPv4 address that ranks on other hosts reach: the rendezvous listens there",
        unset="127.0.0.1 (required with ranks on other hosts, or --cluster-interface)")
    cluster_interface: str | None = _setting(
        str, None, "the network interface whose IPv4 address is the cluster address; also NCCL's socket interface",
        unset="none")
    cluster_port: int = _setting(int, 29600, "the port on the cluster address where ranks started by an "
                                 "orchestrator (--worker-launcher connect) dial in", lo=1, hi=65535)
    cluster_token: str | None = _setting(str, None, "the shared secret ranks that dial in present (set it on the "
                                         "leader and on every worker; never logged)", unset="none")
    cluster_token_file: str | None = _setting(str, None, "a file whose first line is the cluster token",
                                              unset="none")
    speculative_config: str | None = _setting(
        str, None, 'speculative decoding, a JSON object: \'{"method": "ngram", "num_speculative_tokens": 4}\'. '
        "Every method: method (ngram, suffix or draft), num_speculative_tokens, disable_by_batch_size; ngram: "
        "prompt_lookup_min, prompt_lookup_max; suffix: suffix_decoding_max_tree_depth, "
        "suffix_decoding_max_cached_requests, suffix_decoding_max_cache_bytes, suffix_decoding_max_spec_factor, "
        "suffix_decoding_min_token_prob; "
        "draft: model (the draft checkpoint), draft_tensor_parallel_size. Output is unchanged, only the number "
        "of steps", unset="off")
    device: str | None = _setting(str, None, "cpu, cuda or cuda:N", unset="cuda when present, else cpu")
    dtype: str = _setting(str, "auto", "weight and activation dtype; auto is bfloat16 on CUDA, float32 on CPU",
                          choices=("auto", "float32", "bfloat16", "float16"))
    quantization: str | None = _setting(
        str, None, "quantize each rank's linear-layer weights as it reads them and keep them quantized: int8, one "
        "symmetric scale per output row, the LM head's too; fp8, e4m3 with a scale per row and 128 inputs, the LM "
        "head left in the model dtype (embeddings and norms stay in it); a checkpoint stored quantized is kept as "
        "stored without it",
        choices=("int8", "fp8"),
        unset="weights as the checkpoint stores them")
    num_threads: int | None = _setting(
        int, None, "torch threads per CPU rank", lo=1,
        unset="cores / tp (fewer cores than ranks: one per core, 1 for steps of <= 8 rows, rank 0 one)")
    cache_dir: str | None = _setting(str, None, "where the embedded default model and the CPU kernels are built",
                                     unset="$XDG_CACHE_HOME/neuron, else ~/.cache/neuron")
    cxx: str | None = _setting(str, None, "C++ compiler that builds the CPU kernels, once per machine",
                               unset="the first of g++, c++, clang++ on PATH")

    enable_lora: bool = _setting(bool, False, "serve LoRA adapters on the model (PEFT folders): each rank holds a "
                                 "pool of --max-loras of them, and one step mixes requests for several adapters "
                                 "and for the base model")
    max_loras: int = _setting(int, 1, "LoRA adapters held at once on the ranks (the slot pool, sized at load); more "
                              "wait in host memory and are swapped in, least recently used out", lo=1)
    max_lora_rank: int = _setting(int, 16, "the largest LoRA rank (r) an adapter may have", lo=1, hi=1024)
    lora_host_bytes: int = _setting(int, 2**30, "bytes of host memory each rank keeps adapters in beyond its pool, "
                                    "least recently used first out (read again from their folder when needed)",
                                    lo=0)
    allow_runtime_lora_updating: bool = _setting(
        bool, False, "serve vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter, with which any client "
        "of the API may load adapters from this machine's paths (the admin API's key guards its own way)")
    lora_modules: str | None = _setting(
        str, None, "adapters to serve from the start, NAME=PATH entries separated by spaces or commas (implies "
        "--enable-lora); a request names one as its `model`", unset="none")

    # Batching and the KV cache.
    max_model_len: int | None = _setting(int, None, "longest sequence (prompt + output) in tokens", lo=2,
                                         unset=f"the model's limit, capped at {MAX_MODEL_LEN_CAP}")
    max_num_seqs: int = _setting(int, 16, "sequences decoded together; each holds one KV-cache slot", lo=1)
    max_num_batched_tokens: int | None = _setting(int, None, "token budget of one step", lo=1,
                                                  unset="the prefill chunk size, or max-num-seqs if larger")
    prefill_chunk_tokens: int = _setting(int, 512, "longest prompt piece run in one step", lo=1)
    kv_block_size: int = _setting(int, 16, "tokens per KV-cache block", lo=1)
    kv_cache_memory: int | None = _setting(
        "bytes", None, "KV-cache budget per rank, in bytes or with a unit such as 4GiB",
        unset="on CUDA from gpu-memory-utilization; on CPU room for max-num-seqs full-length sequences")
    kv_cache_dtype: str = _setting(
        str, "auto", "what the KV cache holds keys and values in: auto is the model dtype; float16 or bfloat16 "
        "halve an fp32 model's cache on CPU (twice the tokens in the same memory, less to read per token), each "
        "key and value rounded as it is stored while attention computes in fp32. On CUDA, and for a 16-bit "
        "model: the model dtype",
        choices=("auto", "float32", "bfloat16", "float16"))
    gpu_memory_utilization: float = _setting(
        float, 0.9, "share of each GPU's memory neuron may use for weights, activations and the KV cache",
        lo=0, hi=1, above=True)
    memory_budget: int | None = _setting(
        "bytes", None, "bytes each device may give the models a server hosts (the host's memory for its CPU "
        "ranks together): a load that does not fit unloads idle on-demand models, least recently used first, or "
        "is refused with 507", unset="what each device has")
    no_prefix_caching: bool = _setting(bool, False, "do not reuse the KV blocks of prompt prefixes seen before")
    attention: str = _setting(str, "paged", "how attention reads the KV cache: paged reads blocks where they "
                              "lie from one flat step (the Triton kernel on CUDA, the C++ kernel on CPU, a "
                              "PyTorch reference where neither is available); gather, a reference path for "
                              "tests, copies each context out of the block pool for SDPA",
                              choices=("gather", "paged"))
    kernels: str = _setting(str, "auto", "which fused CUDA kernels run: auto, each one that passed the start-up "
                            "self-check on this card (cached per card and versions); triton, all of them "
                            "unchecked; reference, none (PyTorch's operations)", choices=("auto", "triton", "reference"))
    no_onednn: bool = _setting(bool, False, "with the CPU kernels off (NEURON_NO_CPU_OPS), run CPU fp32 linear "
                               "layers of 5 rows and more through F.linear instead of oneDNN")
    no_cpu_ops: bool = _setting(bool, False, "hold CPU fp32 weights row-major, not as panels, and run the step's "
                                "linear layers (oneDNN from 5 rows) and element-wise passes (norms, rotary, SiLU) "
                                "in PyTorch instead of neuron's C++ kernels")
    no_fused_layers: bool = _setting(bool, False, "run a CPU fp32 step's dense decoder layers one kernel call at a "
                                     "time from Python instead of all of them in one C++ call (steps of up to 64 "
                                     "rows; the same numbers, less host time per layer)")
    no_quant_kernels: bool = _setting(bool, False, "multiply quantized weights by dequantizing them first (the "
                                      "reference) instead of through neuron's CPU kernel for them")
    quant_exact: bool = _setting(bool, False, "multiply int8 and 4-bit quantized weights on CPU in fp32, equal to "
                                 "dequantize-then-matmul, instead of rounding the activations to int8 per 32 "
                                 "inputs (per 256 for K-quants at a few rows, without VNNI) and multiplying "
                                 "integers (faster, a relative error of 2e-5 to 9e-5 in the mean square)")
    no_cuda_graphs: bool = _setting(bool, False, "run decode steps eagerly instead of replaying them from CUDA "
                                    "graphs (graphs need CUDA, attention=paged, one rank per GPU or tp 1, "
                                    "and a model without recurrent layers)")

    # The HTTP server.
    host: str = _setting(str, "127.0.0.1", "address to listen on; use 0.0.0.0 only behind a firewall or with "
                         "an API key")
    port: int = _setting(int, 8000, "TCP port to listen on; 0 picks a free one", lo=0, hi=65535)
    api_key: str | None = _setting(str, None, "require `Authorization: Bearer <key>` on /v1 routes; "
                                   "/health and /metrics stay open", unset="none, /v1 is open")
    admin_key: str | None = _setting(str, None, "turn the admin API on (/admin/models: load, unload and list "
                                     "models while serving), guarded by this bearer key, apart from --api-key",
                                     unset="none, the admin API is off")
    prefix_cache_isolation: str = _setting(
        str, "none", "which requests may reuse each other's cached prompt prefixes, whose speed tells one client "
        "what another sent (docs/reliability.md): none, all unless their cache_salt differs; api-key, only those "
        "presenting the same bearer token and cache_salt (behind a gateway that forwards per-client keys; refused "
        "with --api-key); salt, only those with the same cache_salt, a request without one sharing nothing",
        choices=("none", "api-key", "salt"))
    max_waiting: int = _setting(int, 256, "requests that may wait for a free slot; beyond that the server "
                                "answers 503 with Retry-After", lo=0)
    max_body_bytes: int = _setting("bytes", 8 * 2**20, "largest request body accepted, in bytes or with a unit "
                                  "such as 1MiB; larger ones get 413")
    keepalive_s: float = _setting(float, 10.0, "seconds between SSE keep-alive comments while a stream waits "
                                  "for tokens", lo=0, above=True)
    shutdown_grace_s: float = _setting(float, 10.0, "on SIGTERM or Ctrl-C, seconds in-flight requests get to "
                                       "finish before they are cancelled; new ones get 503 at once", lo=0)
    max_connections: int = _setting(int, 1024, "open HTTP connections served at once; more get 503 with "
                                    "Retry-After and are closed. Kept below the open-file limit by a margin "
                                    "that rebuilding the ranks needs", lo=1)
    max_connections_per_client: int = _setting(int, 256, "open HTTP connections one client address may hold; "
                                               "more get 503 like those past max-connections. 0: no "
                                               "per-client cap (behind a proxy, where every client has "
                                               "the proxy's address)", lo=0)
    header_timeout_s: float = _setting(float, 10.0, "seconds a client gets to send a request's headers, from "
                                       "connecting or from the first byte of its next request; then 408 and "
                                       "the connection is closed", lo=0, above=True)
    body_timeout_s: float = _setting(float, 30.0, "seconds a request body may pause between two reads, and "
                                     "the head start of its whole-body deadline; then 408 and the connection is "
                                     "closed", lo=0, above=True)
    min_body_rate: int = _setting("bytes", 64 * 2**10, "bytes per second a request body must average: its "
                                  "whole body is due body-timeout-s after it starts plus one second per this "
                                  "many bytes received, so a trickle cannot hold a connection")
    allowed_origins: str | None = _setting(str, None, "comma-separated origins (https://app.example) whose "
                                           "browser pages may call the API (CORS); requests from any other "
                                           "origin get 403", unset="none: browser pages of any origin are refused")
    idle_timeout_s: float = _setting(float, 5.0, "seconds a keep-alive connection may stay idle between "
                                     "requests before the server closes it", lo=0, above=True)
    log_level: str = _setting(str, "info", "log level", choices=("debug", "info", "warning", "error"))

    # Deadlines and recovery.
    tp_step_timeout_s: float = _setting(float, 120.0, "deadline of one batched step on every rank (an image "
                                        "prefill gets it per chunk)", lo=0, above=True)
    collective_timeout_s: float = _setting(float, 60.0, "collective timeout (a rank stuck in an all-reduce "
                                           "gets out), and deadline for every rank to join the group", lo=0,
                                           above=True)
    cpu_all_reduce: str = _setting(str, "shm", "how ranks on the CPUs of one host sum their tensors: shm, "
                                   "through a shared memory segment (microseconds), or gloo, over TCP "
                                   "loopback (a millisecond); ranks on several hosts use gloo",
                                   choices=("shm", "gloo"))
    cpu_bind: str = _setting(str, "auto", "the cores of each CPU rank on one host: auto (a NUMA node per rank "
                             "when tp equals the nodes, else the cores split evenly), nobind, or one core list "
                             "per rank, the lists separated by a vertical bar, as in vLLM's "
                             "VLLM_CPU_OMP_THREADS_BIND (README: Tensor parallelism on CPUs)")
    worker_start_timeout_s: float = _setting(float, 120.0, "deadline for every worker's `pong`", lo=0, above=True)
    liveness_interval_s: float = _setting(float, 1.0, "seconds between looks at every worker's process state: a "
                                          "rank seen stopped twice in a row is killed and the ranks rebuilt, "
                                          "whatever the step deadline", lo=0, above=True)
    heartbeat_timeout_s: float = _setting(float, 5.0, "how long a rank on another host may take to answer the "
                                          "ping it gets between steps (every liveness interval) before it is "
                                          "killed and the ranks rebuilt", lo=0, above=True)
    load_timeout_s: float = _setting(float, 600.0, "deadline for loading a model: finding and reading its files, "
                                     "building its tokenizer, starting its ranks and loading their shards; a load "
                                     "past it fails, naming the phase it was in", lo=0, above=True)
    recovery_attempts: int = _setting(int, 3, "rebuilds of the ranks tried after a failure before the model "
                                      "is `failed`; one that fails for lack of descriptors or memory does not "
                                      "count and is retried until the resource is back", lo=1)
    recovery_backoff_s: float = _setting(float, 1.0, "wait before the second rebuild, doubling after each "
                                         "failed one (up to 30 s)", lo=0)

    # Limits on what one request may ask for.
    max_prompt_logprobs: int = _setting(int, 2**18, "prompt log-probabilities one request may ask for (echo "
                                        "with logprobs, prompt_logprobs), counted as prompts x samples x prompt "
                                        "tokens x (top-k + 1); more is refused with 400", lo=1)

    # What the server keeps between requests.
    responses_max_stored: int = _setting(int, 1000, "responses of the Responses API kept in memory (store: true) "
                                         "for GET /v1/responses/{id} and previous_response_id; the least "
                                         "recently used is evicted first, and 0 keeps none", lo=0)
    responses_max_stored_bytes: int = _setting("bytes", 64 * 2**20, "bytes the kept responses may hold "
                                               "together, each with the conversation it continues; the least "
                                               "recently used are evicted to stay under it")

    # Limits on what peers send.
    max_line_bytes: int = _setting("bytes", 64 * 2**20, "longest protocol line between leader and workers")
    vision_max_pixels: int = _setting(int, 64 * 2**20, "images with more pixels (width x height, before "
                                      "resizing) are refused with 413", lo=1)


SETTINGS: dict[str, Setting] = {f.name: replace(f.metadata["setting"], name=f.name) for f in fields(Settings)}


def load_settings(environ: Mapping[str, str] = os.environ) -> Settings:
    """Parse every NEURON_* variable of `environ`; an empty one counts as unset. ConfigError names
    the first variable whose value is not allowed."""
    values = {}
    for name, s in SETTINGS.items():
        text = environ.get(s.env, "")
        if text == "":
            continue
        try:
            values[name] = s.parse(text)
        except ValueError as exc:
            raise ConfigError(f"{s.env}: {exc}") from None
    return Settings(**values)


_snapshot: tuple[tuple[str | None, ...], Settings] | None = None


def settings() -> Settings:
    """This process's settings. The environment is parsed once and the snapshot kept; it is parsed
    again only after a NEURON_* variable changed (tests set them between engines). A config built
    from an earlier snapshot keeps its values."""
    global _snapshot
    raw = tuple(os.environ.get(s.env) for s in SETTINGS.values())
    if _snapshot is None or _snapshot[0] != raw:
        _snapshot = (raw, load_settings(os.environ))
    return _snapshot[1]


def from_settings(name: str) -> Any:
    """A dataclass field whose default is setting `name` as it stands when the config is built."""
    if name not in SETTINGS:  # a misspelt name fails at import, not at first use
        raise KeyError(f"no setting {name!r} in neuron.config")
    return field(default_factory=lambda: getattr(settings(), name))


def check(name: str, value: Any, what: str | None = None) -> Any:
    """`value` when setting `name`'s bounds allow it; ConfigError naming `what` otherwise."""
    return SETTINGS[name].check(value, what)


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "t": 10**12, "tb": 10**12}


def parse_bytes(value: int | float | str, name: str = "size") -> int:
    """A byte count: a number, or a number with a unit (`512MiB`, `4GiB`, `2.5GB`)."""
    if isinstance(value, (int, float)):
        n = value
    else:
        text = value.strip().lower().replace(" ", "")
        digits = text.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = text[len(digits):]
        try:
            n = float(digits) * _UNITS[unit]
        except (ValueError, KeyError):
            raise ConfigError(f"{name} must be a byte count such as 2147483648, 512MiB or 4GiB, "
                              f"got {value!r}") from None
    if not n > 0:
        raise ConfigError(f"{name} must be positive, got {value!r}")
    return int(n)


def format_bytes(n: int) -> str:
    """`n` in the largest binary unit that divides it (8388608 is 8MiB)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n % size == 0:
            return f"{n // size}{unit}"
    return str(n)
