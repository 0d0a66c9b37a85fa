"""Host data to the device without making the host wait."""

from __future__ import annotations

import numpy as np
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


class Staging:
    """A step's host arrays sent to the device in one copy. On CUDA they are packed into a pinned
    buffer kept from step to step (pinning memory costs more than copying a step's few kilobytes),
    copied without blocking, and handed out as views of the one device tensor; before the buffer is
    written again, the previous copy out of it must have finished (an event says so, at once in
    practice). On CPU each array becomes a tensor over its own memory (no copy, its dtype kept):
    packing them would only add work to a step whose host side is most of its time."""

    def __init__(self, device: str | torch.device):
        self.device = torch.device(device)
        self._host: torch.Tensor | None = None
        self._sent: torch.cuda.Event | None = None
        self.copies = 0  # host-to-device copies made, for the tests that count them

    def send(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """Each array (any shape, values that fit int32) as a flat int32 tensor on the device (on
        CPU: as it is, shape and dtype kept)."""
        if self.device.type != "cuda":
            return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
        sizes = [a.size for a in arrays]
        flat = np.concatenate([np.asarray(a, dtype=np.int32).ravel() for a in arrays])
        host = self._buffer(flat.size)
        host.numpy()[: flat.size] = flat
        device = host[: flat.size].to(self.device, non_blocking=True)
        self._sent = torch.cuda.Event()
        self._sent.record()
        self.copies += 1
        return list(device.split(sizes))

    def _buffer(self, n: int) -> torch.Tensor:
        if self._sent is not None:
            self._sent.synchronize()
        if self._host is None or self._host.numel() < n:
            self._host = torch.empty(max(n, 2 * (0 if self._host is None else self._host.numel())),
                                     dtype=torch.int32, pin_memory=True)
        return self._host
