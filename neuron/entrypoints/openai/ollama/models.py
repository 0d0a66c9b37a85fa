"""The models as Ollama's clients see them: /api/tags, /api/ps and /api/show from the host's
models, Ollama's model names, and keep_alive."""

from __future__ import annotations

import hashlib
import re
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from neuron.engine.engine_config import default_device
from neuron.engine.host import HostedModel, ModelHost
from neuron.engine.pooling import EMBED, GENERATE
from neuron.entrypoints.openai.api_errors import bad_request
from neuron.entrypoints.openai.response_parser import THINK_CLOSE, THINK_OPEN, tool_format
from neuron.worker.failure import resolve_dtype

_FOREVER = "2318-01-01T00:00:00Z"  # expires_at of a model that stays loaded, as Ollama writes it


def served_name(host: ModelHost, name: str) -> str:
    """The served model or LoRA adapter a request means: its name, or Ollama's `NAME:latest` for NAME."""
    if _served(host, name) or not name.endswith(":latest"):
        return name
    stem = name.removesuffix(":latest")
    return stem if _served(host, stem) else name


def _served(host: ModelHost, name: str) -> bool:
    return name in host.models or host.adapter_base(name) is not None


SPEC_KEEP_ALIVE = object()  # no keep_alive in the request: the model's own
_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_MAX_KEEP_S = 1e9


def parse_keep_alive(value: float | str | None):
    """Seconds to stay loaded once idle, None for good (any negative value), or SPEC_KEEP_ALIVE when the
    request says nothing. A number is seconds; a string is a Go duration ("5m", "1h30m", "-1s") or a
    number of seconds."""
    if value is None:
        return SPEC_KEEP_ALIVE
    seconds = value if not isinstance(value, str) else _duration_s(value)
    if seconds is None or seconds != seconds:
        raise bad_request(f'keep_alive must be seconds or a duration such as "5m", got {value!r:.40}',
                          param="keep_alive")
    return None if seconds < 0 else min(float(seconds), _MAX_KEEP_S)


def _duration_s(text: str) -> float | None:
    text = text.strip()
    sign, body = (-1, text[1:]) if text.startswith("-") else (1, text.removeprefix("+"))
    try:
        return sign * float(body)
    except ValueError:
        pass
    parts = _DURATION.findall(body)
    if not parts or "".join(n + u for n, u in parts) != body:
        return None
    return sign * sum(float(n) * _UNIT_S[u] for n, u in parts)


def _config(m: HostedModel):
    """The model's resolved configuration (ModelConfig) while it is loaded; None otherwise."""
    return m.engine.engine.model if m.engine is not None and m.engine.loaded else None


def _details(m: HostedModel) -> dict:
    cfg = _config(m)
    spec = cfg.spec if cfg is not None else m.spec.engine
    family = cfg.model_type if cfg is not None else ""
    gguf = cfg.gguf is not None if cfg is not None else str(spec.model).endswith(".gguf")
    level = (cfg.quantization if cfg is not None else None) or spec.quantization or _dtype(cfg, spec)
    return {"parent_model": "", "format": "gguf" if gguf else "safetensors", "family": family,
            "families": [family] if family else None, "parameter_size": "",
            "quantization_level": _LEVELS.get(level, str(level or "").upper())}


_LEVELS = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}  # Ollama's names of the dense dtypes


def _dtype(cfg, spec) -> str:
    """The dtype the weights are held in, `auto` resolved for the model's device (or the one it will
    load on)."""
    if spec.dtype != "auto":
        return spec.dtype
    device = cfg.device if cfg is not None else (spec.devices or [spec.device or default_device()])[0]
    return str(resolve_dtype(spec.dtype, device)).removeprefix("torch.")


def _modified_at(m: HostedModel, started: float) -> str:
    """When the checkpoint's folder last changed; the server's start for a model not loaded."""
    cfg = _config(m)
    try:
        at = Path(cfg.model_dir).stat().st_mtime if cfg is not None and cfg.model_dir else started
    except OSError:
        at = started
    return _iso(at)


def _iso(at: float) -> str:
    return datetime.fromtimestamp(at, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _digest(m: HostedModel) -> str:
    """An identifier of the model as served (its name and where it comes from), not of its files."""
    return hashlib.sha256(f"{m.name}\n{m.spec.engine.model}".encode()).hexdigest()


def card(m: HostedModel, started: float) -> dict:
    """A model as /api/tags lists it, with neuron's state of it (`status`)."""
    info = m.describe()
    return {"name": m.name, "model": m.name, "modified_at": _modified_at(m, started),
            "size": info.get("weight_bytes") or 0, "digest": _digest(m), "details": _details(m),
            "status": info["status"]}


def adapter_card(name: str, base: HostedModel, path: str, started: float) -> dict:
    """A LoRA adapter as /api/tags lists it: its base's card under its own name, with the base as
    `parent_model` (as vLLM's /v1/models gives it as `parent`) and the adapter's own files."""
    out = card(base, started)
    out.update(name=name, model=name, digest=hashlib.sha256(f"{name}\n{path}".encode()).hexdigest(),
               size=_folder_bytes(path), details={**out["details"], "parent_model": base.name})
    try:
        out["modified_at"] = _iso(Path(path).stat().st_mtime)
    except OSError:
        pass
    return out


def _folder_bytes(path: str) -> int:
    try:
        return sum(entry.stat().st_size for entry in Path(path).iterdir() if entry.is_file())
    except OSError:
        return 0


def running(m: HostedModel, started: float) -> dict:
    """A loaded model as /api/ps lists it: what it holds (weights and KV cache), on GPUs or not,
    and when keep_alive will unload it."""
    held = sum(r["weight_bytes"] + r["kv_bytes"] for r in m.engine.memory())
    on_gpu = any(d.startswith("cuda") for d in m.devices or m.engine.engine.footprint()["devices"])
    out = card(m, started)
    out.update(size=held, size_vram=held if on_gpu else 0, expires_at=_expires_at(m),
               context_length=m.engine.max_model_len)
    return out


def _expires_at(m: HostedModel) -> str:
    if m.keep_alive_s is None:
        return _FOREVER
    idle_from = time.time() - max(0.0, time.monotonic() - m.last_used)
    at = idle_from + m.keep_alive_s if not m.in_flight else time.time() + m.keep_alive_s
    return datetime.fromtimestamp(at, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def show_body(m: HostedModel, started: float) -> dict:
    """/api/show: the model's template, default parameters, details, architecture and capabilities
    (`completion` for a model that generates, and `tools`, `thinking`, `vision` where the checkpoint
    has them; `embedding` for one that embeds); a model not loaded shows what its spec says."""
    cfg = _config(m)
    body: dict[str, Any] = {"modelfile": "", "parameters": "", "template": "", "details": _details(m),
                            "model_info": {}, "capabilities": ["completion"],
                            "modified_at": _modified_at(m, started)}
    if cfg is None:
        return body
    engine, tok = m.engine, m.engine.tokenizer
    generates = GENERATE in cfg.tasks
    body["capabilities"] = (["completion"] if generates else []) + (["embedding"] if EMBED in cfg.tasks else [])
    if tok is not None:
        body["template"] = tok.chat_template or ""
        if generates and tool_format(tok) is not None:
            body["capabilities"].append("tools")
        if generates and tok.token_to_id(THINK_OPEN) is not None and tok.token_to_id(THINK_CLOSE) is not None:
            body["capabilities"].append("thinking")
    if generates and engine.vision is not None:
        body["capabilities"].append("vision")
    defaults = engine.default_sampling().items()
    body["parameters"] = "\n".join(f"{_PARAMETER_NAMES.get(k, k)} {v}" for k, v in defaults)
    arch, hf = cfg.model_type, cfg.hf_config
    info = {"general.architecture": arch, f"{arch}.context_length": engine.max_model_len}
    info.update({f"{arch}.{name}": hf[key] for key, name in _ARCH_INFO.items()
                 if isinstance(hf.get(key), (int, float))})
    body["model_info"] = info
    return body


_PARAMETER_NAMES = {"repetition_penalty": "repeat_penalty", "max_tokens": "num_predict"}
_ARCH_INFO = {"hidden_size": "embedding_length", "num_hidden_layers": "block_count",
              "intermediate_size": "feed_forward_length", "num_attention_heads": "attention.head_count",
              "num_key_value_heads": "attention.head_count_kv", "rms_norm_eps": "attention.layer_norm_rms_epsilon",
              "rope_theta": "rope.freq_base", "vocab_size": "vocab_size"}
