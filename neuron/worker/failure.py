"""What a rank's request handling raises, and the dtype names ranks agree on."""

from __future__ import annotations

import torch

from neuron.errors import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class WorkerFailure(Exception):
    """A request this rank could not carry out; `kind` is the protocol's error tag."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def resolve_kv_dtype(kv_cache_dtype: str, dtype: str, device: str) -> torch.dtype:
    """What the KV pool holds: the model dtype for "auto" (or ""), else the type named."""
    return resolve_dtype(dtype, device) if kv_cache_dtype in ("", "auto") else resolve_dtype(kv_cache_dtype, device)


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if dtype not in DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not supported; choose auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]
