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
