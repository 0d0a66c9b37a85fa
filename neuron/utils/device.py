"""Host data to the device without making the host wait."""

from __future__ import annotations

import torch


def to_device(values, device: str | torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`values` (a list, a numpy array or a CPU tensor) as a tensor on `device`. On CUDA it travels
    from pinned memory without blocking: a copy from pageable memory would make the host wait for
    the GPU's queued work before it could go on preparing the next step. On CPU no copy is made
    where none is needed (a numpy array's memory is shared)."""
    host = torch.as_tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
