"""Environment settings (`NEURON_*`), read when asked so tests and children can override them."""

from __future__ import annotations

import os


def env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {raw!r}") from None


def env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None


def prefill_chunk_tokens() -> int:
    return max(1, env_int("NEURON_PREFILL_CHUNK_TOKENS", 512))


def vision_max_pixels() -> int:
    """Images with more pixels than this (width x height, before resizing) are refused with 413."""
    return max(1, env_int("NEURON_VISION_MAX_PIXELS", 64 * 2**20))


def step_timeout_s() -> float:
    return env_float("NEURON_TP_STEP_TIMEOUT_S", 120.0)


def collective_timeout_s() -> float:
    return env_float("NEURON_COLLECTIVE_TIMEOUT_S", 60.0)


def startup_timeout_s() -> float:
    return env_float("NEURON_WORKER_START_TIMEOUT_S", 120.0)


def load_timeout_s() -> float:
    return env_float("NEURON_LOAD_TIMEOUT_S", 600.0)


def recovery_attempts() -> int:
    return max(1, env_int("NEURON_RECOVERY_ATTEMPTS", 3))


def recovery_backoff_s() -> float:
    return max(0.0, env_float("NEURON_RECOVERY_BACKOFF_S", 1.0))


def shutdown_grace_s() -> float:
    return max(0.0, env_float("NEURON_SHUTDOWN_GRACE_S", 10.0))


def kv_block_size() -> int:
    size = env_int("NEURON_KV_BLOCK_SIZE", 16)
    if size < 1:
        raise ValueError(f"NEURON_KV_BLOCK_SIZE must be >= 1, got {size}")
    return size


def gpu_memory_utilization() -> float:
    return env_float("NEURON_GPU_MEMORY_UTILIZATION", 0.9)


def kv_cache_memory() -> int | None:
    raw = os.environ.get("NEURON_KV_CACHE_MEMORY")
    return None if raw is None or raw == "" else parse_bytes(raw, "NEURON_KV_CACHE_MEMORY")


def prefix_caching() -> bool:
    """On unless NEURON_NO_PREFIX_CACHING is set to a true value."""
    return os.environ.get("NEURON_NO_PREFIX_CACHING", "").lower() not in ("1", "true", "yes", "on")


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
            raise ValueError(f"{name} must be a byte count such as 2147483648, 512MiB or 4GiB, got {value!r}") from None
    if n <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return int(n)
