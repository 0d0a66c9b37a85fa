"""Collectives between ranks: in-place sum all-reduce and gather to rank 0.

Backends: `nccl` through CuPy's NCCL binding (GPUs, one rank per device; CuPy 13 or 14, built
for torch's CUDA major), `gloo` through torch.distributed's ProcessGroupGloo on a TCP store (CPU,
and CUDA tensors when several ranks share one GPU, which NCCL refuses), and a no-op for a single
rank.

Ranks share one host, so the gloo rendezvous store and gloo's own pair sockets listen on the
loopback address only. Joining the group has a deadline and can be aborted from another thread (a
rank that died while joining), so rank 0 never waits on a peer that is gone.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import string
import threading
import time
from dataclasses import dataclass

import torch
from torch.distributed import ProcessGroupGloo, Store, TCPStore

from neuron.distributed.net import LOOPBACK
from neuron.errors import NeuronError

log = logging.getLogger("neuron.comm")


class CommError(NeuronError):
    """A collective backend cannot start on this machine; the message says why and what to change."""


@dataclass(slots=True, frozen=True)
class NativeAllReduce:
    """A communicator's fp32 all-reduce as a C entry point, for a loop in C that sums between its
    own kernels (neuron/layers/cpu_decoder.py): `int function(segment, rank, data, n, dtype,
    timeout_ms, abort_word, threads)`, 0 when it completed (csrc/shm_allreduce.cpp). `holder` keeps
    the segment mapped while the caller holds this; `check` raises what the communicator raises for
    a nonzero status."""

    function: int
    segment: int
    holder: object
    rank: int
    timeout_ms: int
    abort_word: int
    check: object


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

    def native_all_reduce(self) -> NativeAllReduce | None:
        """The all-reduce as a C entry point, where this backend has one (shared memory), else None."""
        return None

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


# Gloo retries a refused pair connection for five times the group's timeout: the group is built with
# this short one, so a rank that died after posting its address fails the join within seconds, and
# then gets the collective timeout for its operations.
_CONNECT_TIMEOUT_S = 1.0
_POLL_S = 0.05


def host_store(world_size: int, timeout_s: float, address: str = LOOPBACK) -> TCPStore:
    """The rendezvous store's server, on a free port of `address` (rank 0; loopback unless ranks
    on other hosts must reach it). TCPStore binds every interface when it opens the port itself,
    so it is handed a socket bound to that one address."""
    sock = socket.create_server((address, 0), backlog=max(16, 2 * world_size))
    port, inode = sock.getsockname()[1], os.fstat(sock.fileno()).st_ino
    fd = sock.detach()  # the store owns the descriptor from here and closes it
    try:
        return TCPStore(address, port, world_size, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
                        wait_for_workers=False, master_listen_fd=fd, use_libuv=True)
    except BaseException:
        _close_if_ours(fd, inode)
        raise


def _close_if_ours(fd: int, inode: int) -> None:
    """Close `fd` unless the failed store closed it already (and the number was reused since)."""
    try:
        if os.fstat(fd).st_ino == inode:
            os.close(fd)
    except OSError:
        pass


def make_store(address: str, world_size: int, timeout_s: float) -> TCPStore:
    """A client of the store at `host:port` (the other ranks)."""
    host, _, port = address.rpartition(":")
    return TCPStore(host, int(port), world_size, is_master=False, timeout=datetime.timedelta(seconds=timeout_s),
                    wait_for_workers=False)


class RendezvousAborted(CommError):
    """Joining the group was given up: a rank died, the deadline passed, or the server is stopping."""


class Rendezvous(Store):
    """The store as the gloo group sees it while ranks join. TCPStore's waits block in C++ for the
    store's whole timeout; these poll instead, so a join ends at its deadline or as soon as `abort`
    is called from another thread. Gloo calls back into this object: keep it alive with the group."""

    def __init__(self, store: TCPStore, deadline_s: float):
        super().__init__()
        self.store = store
        self._deadline = time.monotonic() + deadline_s
        self._aborted: str | None = None
        self._wake = threading.Event()

    def abort(self, reason: str) -> None:
        self._aborted = reason
        self._wake.set()

    def wait(self, keys, timeout=None) -> None:  # gloo's own timeout is the short connect one: ours rules
        while not self.store.check(keys):
            if self._aborted is not None:
                raise RendezvousAborted(f"joining the gloo group was aborted: {self._aborted}")
            if time.monotonic() > self._deadline:
                raise RendezvousAborted(f"ranks did not all join the gloo group before the deadline (waiting for "
                                        f"{', '.join(keys)})")
            self._wake.wait(_POLL_S)

    def get(self, key):
        self.wait([key])
        return self.store.get(key)

    def set(self, key, value) -> None:
        self.store.set(key, value)

    def add(self, key, amount) -> int:
        return self.store.add(key, amount)

    def check(self, keys) -> bool:
        return self.store.check(keys)

    def compare_set(self, key, expected, desired):
        return self.store.compare_set(key, expected, desired)

    def delete_key(self, key) -> bool:
        return self.store.delete_key(key)

    def num_keys(self) -> int:
        return self.store.num_keys()

    def set_timeout(self, timeout) -> None:
        self.store.set_timeout(timeout)


class GlooCommunicator(Communicator):
    backend = "gloo"

    def __init__(self, rank: int, world_size: int, rendezvous: Rendezvous, timeout_s: float,
                 address: str = LOOPBACK):
        """Join the group through `rendezvous` (raises RendezvousAborted when that is given up);
        collectives then time out after `timeout_s`. Pair sockets bind `address` (this rank's
        address on the route to the rendezvous: loopback on one host)."""
        super().__init__(rank, world_size)
        options = ProcessGroupGloo._Options()
        options._devices = [ProcessGroupGloo.create_device(hostname=address)]
        options._timeout = datetime.timedelta(seconds=min(timeout_s, _CONNECT_TIMEOUT_S))
        self._store = rendezvous  # gloo calls back into it: it lives as long as the group
        self._pg = ProcessGroupGloo(rendezvous, rank, world_size, options)
        self._pg.set_timeout(datetime.timedelta(seconds=timeout_s))

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
NCCL_UNIQUE_ID_BYTES = 128  # sizeof(ncclUniqueId)
# How CuPy's NcclCommunicator takes the id: bytes since CuPy 14; a tuple of C chars in CuPy 13,
# signed where char is signed (x86) and unsigned where it is not (ARM).
UNIQUE_ID_FORMS = ("bytes", "signed", "unsigned")


def encode_unique_id(raw) -> str:
    """The id `nccl.get_unique_id()` returned, as hex: bytes in CuPy 14, a tuple of C chars in
    CuPy 13, whose ints are read modulo 256 so both signednesses give the same bytes."""
    if isinstance(raw, (bytes, bytearray)):
        data = bytes(raw)
    elif all(isinstance(b, int) and -128 <= b <= 255 for b in raw):
        data = bytes(b & 0xFF for b in raw)
    else:
        raise CommError(f"NCCL unique id from CuPy holds values that are not bytes: {raw!r:.80}")
    if len(data) != NCCL_UNIQUE_ID_BYTES:
        raise CommError(f"NCCL unique id from CuPy has {len(data)} bytes, not {NCCL_UNIQUE_ID_BYTES}; "
                        "use CuPy 13 or 14")
    return data.hex()


def decode_unique_id(unique_id_hex: str, form: str) -> bytes | tuple[int, ...]:
    """The leader's hex id in one of UNIQUE_ID_FORMS, as CuPy's NcclCommunicator takes it."""
    data = unique_id_bytes(unique_id_hex)
    if form == "bytes":
        return data
    if form == "signed":
        return tuple(b - 256 if b > 127 else b for b in data)
    if form == "unsigned":
        return tuple(data)
    raise ValueError(f"unknown unique id form {form!r}; expected one of {UNIQUE_ID_FORMS}")


def unique_id_bytes(unique_id_hex: str) -> bytes:
    want = 2 * NCCL_UNIQUE_ID_BYTES
    well_formed = isinstance(unique_id_hex, str) and len(unique_id_hex) == want
    if not (well_formed and all(c in string.hexdigits for c in unique_id_hex)):
        raise CommError(f"NCCL unique id must be {want} hex characters, got {unique_id_hex!r:.40}; "
                        "the leader and every worker must run the same neuron")
    return bytes.fromhex(unique_id_hex)


def nccl_unique_id_hex() -> str:
    """Made by the leader and sent to every rank in `init`."""
    from cupy.cuda import nccl

    return encode_unique_id(nccl.get_unique_id())


def torch_cuda_major() -> int | None:
    """The CUDA major torch was built for; None for a CPU build."""
    return int(torch.version.cuda.split(".")[0]) if torch.version.cuda else None


def cuda_extra_hint(major: int | None) -> str:
    if major in (12, 13):
        return f'install the matching extra: pip install -e ".[cuda{major}]"'
    if major is None:
        return "install a CUDA build of torch, then the cuda12 or cuda13 extra that matches it"
    return f"install cupy-cuda{major}x and nvidia-nccl-cu{major} (neuron's extras cover CUDA 12 and 13)"


def nccl_problem() -> str | None:
    """Why CuPy's NCCL cannot serve this process's torch, or None when it can. CuPy and NCCL
    built for another CUDA major than torch's load a second CUDA runtime and fail at init."""
    major = torch_cuda_major()
    hint = cuda_extra_hint(major)
    if major is None:
        return f"torch {torch.__version__} is a CPU build; {hint}"
    try:
        import cupy
        from cupy.cuda import nccl, runtime
    except Exception as exc:
        return f"CuPy is not importable ({exc}); {hint}"
    if not getattr(nccl, "available", True):  # CuPy imports without NCCL and says so here
        return f"CuPy {cupy.__version__} found no NCCL library; {hint}"
    try:
        cupy_major = runtime.runtimeGetVersion() // 1000
    except Exception as exc:
        return f"CuPy {cupy.__version__} cannot load its CUDA runtime ({exc}); {hint}"
    if cupy_major != major:
        return (f"CuPy {cupy.__version__} is built for CUDA {cupy_major} but torch {torch.__version__} "
                f"for CUDA {torch.version.cuda}; uninstall cupy-cuda{cupy_major}x and {hint}")
    return None


class NcclCommunicator(Communicator):
    backend = "nccl"

    def __init__(self, rank: int, world_size: int, unique_id_hex: str, device: torch.device):
        super().__init__(rank, world_size)
        problem = nccl_problem()
        if problem:
            raise CommError(f"NCCL cannot start on rank {rank}: {problem}")
        import cupy
        from cupy.cuda import nccl

        self._nccl = nccl
        index = rank_device_index(device)
        cupy.cuda.Device(index).use()
        self._comm = open_nccl(nccl, world_size, unique_id_hex, rank, index)

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
        """Free the communicator without waiting for the peers: ncclCommDestroy synchronises with
        every rank, and a rank that died (the reason the pool is being torn down, often) never
        answers, so it would block forever; ncclCommAbort frees the same resources at once."""
        try:
            self._comm.abort()
        except Exception as exc:  # already aborted (a step that failed), or the device is gone
            log.debug("nccl abort on close: %s", exc)


def rank_device_index(device: torch.device) -> int:
    """The GPU this rank drives, refused when this process cannot see it."""
    index = torch.cuda.current_device() if device.index is None else device.index
    count = torch.cuda.device_count()
    if not 0 <= index < count:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise CommError(f"rank device cuda:{index} is not one of the {count} GPUs this process sees "
                        f"(CUDA_VISIBLE_DEVICES={visible!r}); use no more ranks than visible GPUs")
    return index


def open_nccl(nccl, world_size: int, unique_id_hex: str, rank: int, index: int):
    """Join the NCCL group, handing CuPy the id in the form its version takes. A form the binding
    refuses fails while converting the argument, before NCCL is called, so trying the next is safe."""
    unique_id_bytes(unique_id_hex)  # a malformed id is refused as such, not as a CuPy mismatch
    refusals = []
    for form in UNIQUE_ID_FORMS:
        uid = decode_unique_id(unique_id_hex, form)
        try:
            return nccl.NcclCommunicator(world_size, uid, rank)
        except (TypeError, OverflowError) as exc:
            refusals.append(f"{form}: {exc}")
        except Exception as exc:
            raise CommError(
                f"ncclCommInitRank failed on rank {rank} of {world_size} (cuda:{index}, "
                f"{torch.cuda.device_count()} GPUs visible): {exc}; every rank needs its own GPU and the "
                "leader's id, and NCCL_DEBUG=INFO tells more") from exc
    raise CommError(f"CuPy's NcclCommunicator took the unique id in no known form ({'; '.join(refusals)}); "
                    "use CuPy 13 or 14")


def choose_backend(devices: list[str], hosts: tuple[str, ...] | None = None, cpu_all_reduce: str = "shm") -> str:
    """nccl when every rank has its own CUDA device (on its host) and CuPy's NCCL fits torch; shm
    (gloo's group, all-reduce through shared memory: distributed/shm.py) when every rank is on the CPU
    of one host, unless `cpu_all_reduce` says gloo; gloo otherwise."""
    if len(devices) == 1:
        return "single"
    if all(d == "cpu" for d in devices) and len(set(hosts or [""])) == 1:
        return "shm" if cpu_all_reduce == "shm" else "gloo"
    cuda = all(d.startswith("cuda") for d in devices)
    distinct = len(set(zip(hosts or [""] * len(devices), devices))) == len(devices)
    if not (cuda and distinct):
        return "gloo"
    problem = nccl_problem()
    if problem:
        log.warning("%d ranks on their own GPUs use gloo, slower than nccl, because %s", len(devices), problem)
        return "gloo"
    return "nccl"
