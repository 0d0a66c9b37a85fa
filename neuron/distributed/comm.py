"""Collectives between ranks: in-place sum all-reduce and gather to rank 0.

Backends: `nccl` through CuPy's NCCL binding (GPUs, one rank per device), `gloo` through
torch.distributed's ProcessGroupGloo on a TCP store (CPU, and CUDA tensors when several ranks
share one GPU, which NCCL refuses), and a no-op for a single rank.
"""

from __future__ import annotations

import datetime
import logging

import torch

log = logging.getLogger("neuron.comm")


class Communicator:
    """The interface every backend implements."""

    backend = "none"

    def __init__(self, rank: int, world_size: int):
        self.rank = rank
        self.world_size = world_size

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` across ranks, in place."""
        raise NotImplementedError

    def gather_to_rank0(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank passes a tensor of the same shape; rank 0 gets all of them in rank order,
        the others get None."""
        raise NotImplementedError

    def abort(self) -> None:
        """Break any collective in progress so no rank stays blocked (used on failures)."""

    def close(self) -> None:
        pass


class SingleRank(Communicator):
    backend = "single"

    def __init__(self):
        super().__init__(0, 1)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        return None

    def gather_to_rank0(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        return [tensor]


def make_store(address: str, world_size: int, is_master: bool, timeout_s: float):
    """A TCP store on `host:port`. The master (the leader's rank 0) passes port 0 to get a free one."""
    from torch.distributed import TCPStore

    host, _, port = address.rpartition(":")
    return TCPStore(
        host,
        int(port),
        world_size,
        is_master=is_master,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


class GlooCommunicator(Communicator):
    backend = "gloo"

    def __init__(self, rank: int, world_size: int, store, timeout_s: float):
        super().__init__(rank, world_size)
        from torch.distributed import ProcessGroupGloo

        self._store = store  # keep the master store alive as long as the group
        self._pg = ProcessGroupGloo(store, rank, world_size, datetime.timedelta(seconds=timeout_s))

    def all_reduce(self, tensor: torch.Tensor) -> None:
        self._pg.allreduce([tensor]).wait()

    def gather_to_rank0(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        from torch.distributed import GatherOptions

        src = tensor.contiguous().cpu()
        out = [[torch.empty_like(src) for _ in range(self.world_size)]] if self.rank == 0 else []
        opts = GatherOptions()
        opts.rootRank = 0
        self._pg.gather(out, [src], opts).wait()
        if self.rank != 0:
            return None
        return [t.to(tensor.device) for t in out[0]]

    def abort(self) -> None:
        try:
            self._pg.abort()
        except Exception as exc:  # older torch has no abort on gloo; its timeout is the way out
            log.debug("gloo abort unavailable: %s", exc)

    def close(self) -> None:
        self._pg = None
        self._store = None


_NCCL_DTYPES = {torch.float32: 7, torch.float16: 6, torch.bfloat16: 9, torch.int64: 4, torch.int32: 2}


def nccl_unique_id_hex() -> str:
    """Made by the leader and sent to every rank in `init`."""
    from cupy.cuda import nccl

    return bytes(b & 0xFF for b in nccl.get_unique_id()).hex()


class NcclCommunicator(Communicator):
    backend = "nccl"

    def __init__(self, rank: int, world_size: int, unique_id_hex: str, device: torch.device):
        super().__init__(rank, world_size)
        import cupy
        from cupy.cuda import nccl

        self._nccl = nccl
        cupy.cuda.Device(device.index or 0).use()
        uid = tuple(b - 256 if b > 127 else b for b in bytes.fromhex(unique_id_hex))
        self._comm = nccl.NcclCommunicator(world_size, uid, rank)

    def _stream(self) -> int:
        return torch.cuda.current_stream().cuda_stream

    def all_reduce(self, tensor: torch.Tensor) -> None:
        assert tensor.is_contiguous()
        ptr = tensor.data_ptr()
        dtype = _NCCL_DTYPES[tensor.dtype]
        self._comm.allReduce(ptr, ptr, tensor.numel(), dtype, self._nccl.NCCL_SUM, self._stream())

    def gather_to_rank0(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        src = tensor.contiguous()
        out = torch.empty((self.world_size, *src.shape), dtype=src.dtype, device=src.device)
        dtype = _NCCL_DTYPES[src.dtype]
        self._comm.allGather(src.data_ptr(), out.data_ptr(), src.numel(), dtype, self._stream())
        return list(out.unbind(0)) if self.rank == 0 else None

    def abort(self) -> None:
        self._comm.abort()

    def close(self) -> None:
        try:
            self._comm.destroy()
        except Exception as exc:
            log.debug("nccl destroy: %s", exc)


def cupy_available() -> bool:
    try:
        import cupy  # noqa: F401
        from cupy.cuda import nccl  # noqa: F401
    except Exception:
        return False
    return True


def choose_backend(devices: list[str]) -> str:
    """nccl when every rank has its own CUDA device and CuPy's NCCL is importable; gloo otherwise."""
    if len(devices) == 1:
        return "single"
    cuda = all(d.startswith("cuda") for d in devices)
    distinct = len(set(devices)) == len(devices)
    if cuda and distinct and cupy_available():
        return "nccl"
    return "gloo"
