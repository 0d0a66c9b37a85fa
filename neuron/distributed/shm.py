"""The all-reduce of CPU ranks on one host, through a shared memory segment (`layers/csrc/shm_allreduce.cpp`).

Gloo sums CPU tensors over TCP loopback: a [1, 1024] all-reduce costs about a millisecond, and a
step makes two per layer. Ranks on one host can instead write their parts into one shared segment
and each sum them there: one barrier on a flag per rank, tens of microseconds (scripts/bench_allreduce.py).

The group is still built with gloo, which keeps the rendezvous and any tensor the segment does not sum
(a dtype other than fp32/bf16); the gather of the logits to rank 0 goes through the segment too. Once the gloo group stands, rank 0 creates
the segment under /dev/shm (mode 0600, a name with its pid and a random part), writes its header and
posts the name in the rendezvous store; the other ranks map it and check its header, and every rank
says through gloo whether it succeeded. Rank 0 then unlinks the name, so the segment lives exactly as
long as the ranks' mappings: no exit path, a crash included, leaves it behind. A rank that could not
map it (another host's, or /dev/shm full) makes every rank keep gloo, with one warning saying why.

Deadlines: a wait ends at the collective timeout, or at once when `abort` is called from another
thread of any rank (the leader calls it when a rank is lost): the segment's abort word wakes every
rank sleeping on it. Either ends the step with a CommFailure, and the ranks are rebuilt.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import os
import re
import secrets
from pathlib import Path

import torch

from neuron.distributed.comm import Communicator, GlooCommunicator, NativeAllReduce, Rendezvous
from neuron.errors import NeuronError
from neuron.utils import native

log = logging.getLogger("neuron.comm")

SOURCE = Path(__file__).resolve().parent.parent / "layers" / "csrc" / "shm_allreduce.cpp"
SHM_DIR = Path("/dev/shm")
PREFIX = "neuron-allreduce-"
SLOT_BYTES = 8 * 2**20  # per rank and buffer at most; larger tensors go through in pieces
MIN_SLOT_BYTES = 64 * 2**10
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_TIMED_OUT, _ABORTED, _BAD_SEGMENT = 1, 2, 3
_STORE_KEY = "neuron/shm-segment"

_P, _I = ctypes.c_void_p, ctypes.c_int64


class CommFailure(NeuronError):
    """A collective did not complete: a rank did not arrive in time, or the ranks were aborted."""


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded library, built if this machine has none yet; None where it cannot be built."""
    lib = native.load(SOURCE, "ranks on one host all-reduce through gloo")
    if lib is not None:
        lib.neuron_shm_segment_bytes.argtypes, lib.neuron_shm_segment_bytes.restype = [ctypes.c_int, _I], _I
        lib.neuron_shm_init.argtypes, lib.neuron_shm_init.restype = [_P, ctypes.c_int, _I], None
        lib.neuron_shm_check.argtypes, lib.neuron_shm_check.restype = [_P, ctypes.c_int, _I], ctypes.c_int
        lib.neuron_shm_all_reduce.argtypes = [_P, ctypes.c_int, _P, _I, ctypes.c_int, _I, _P, ctypes.c_int]
        lib.neuron_shm_all_reduce.restype = ctypes.c_int
        lib.neuron_shm_gather.argtypes = [_P, ctypes.c_int, _P, _I, _P, _I, _P]
        lib.neuron_shm_gather.restype = ctypes.c_int
        lib.neuron_shm_abort.argtypes, lib.neuron_shm_abort.restype = [_P], None
    return lib


class Segment:
    """One mapping of the shared file, made through libc so that no descriptor stays open (Python's
    mmap keeps a duplicate until it is collected). It is unmapped when the last reference to it goes,
    so a collective in flight on another thread keeps it mapped until it returns."""

    def __init__(self, path: Path, size: int, create: bool):
        self.address: int | None = None
        flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            elif os.fstat(fd).st_size != size:
                raise OSError(f"{path} holds {os.fstat(fd).st_size} bytes, not {size}")
            # populated now: the pages count in the rank's RSS from the start, not as steps grow
            address = _libc().mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE,
                                   mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), fd, 0)
            if address in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap of {path} failed: {os.strerror(ctypes.get_errno())}")
        finally:
            os.close(fd)
        self.address, self.size = address, size

    def __del__(self) -> None:
        if self.address is not None:
            _libc().munmap(self.address, self.size)


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mmap.restype = ctypes.c_void_p
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.munmap.restype = ctypes.c_int
    return libc


def segment_bytes(world_size: int, slot: int = SLOT_BYTES) -> int:
    lib = library()
    assert lib is not None
    return lib.neuron_shm_segment_bytes(world_size, slot)


def slot_bytes(largest: int) -> int:
    """A slot for tensors of `largest` bytes (0: the most), in whole pages, within the bounds."""
    wanted = -(-largest // 4096) * 4096 if largest > 0 else SLOT_BYTES
    return min(max(wanted, MIN_SLOT_BYTES), SLOT_BYTES)


def remove_stale_segments() -> list[str]:
    """Unlink segments left by leaders that are gone (one killed between creating a segment and every
    rank mapping it); returns their names."""
    removed = []
    for path in SHM_DIR.glob(PREFIX + "*"):
        found = re.fullmatch(re.escape(PREFIX) + r"(\d+)-[0-9a-f]+", path.name)
        if found and not Path(f"/proc/{found.group(1)}").exists():
            try:
                path.unlink()
                removed.append(path.name)
            except OSError:
                pass
    return removed


class ShmCommunicator(Communicator):
    """Sums fp32 and bf16 CPU tensors through the segment; everything else through its gloo group."""

    backend = "shm"

    def __init__(self, gloo: GlooCommunicator, segment: Segment, timeout_s: float):
        super().__init__(gloo.rank, gloo.world_size)
        self.gloo = gloo
        self._segment: Segment | None = segment
        self._timeout_ms = int(timeout_s * 1000)
        self._abort_word = ctypes.c_uint32(0)  # this process's abort, read by its waits

    @classmethod
    def join(cls, gloo: GlooCommunicator, rendezvous: Rendezvous, timeout_s: float,
             largest: int = 0) -> Communicator:
        """Every rank of `gloo`'s group calls this once the group stands: the segment's communicator,
        or `gloo` itself when any rank could not map the segment (every rank agrees which). A slot
        holds `largest` bytes (a step's largest all-reduce), within MIN_SLOT_BYTES..SLOT_BYTES."""
        rank, world = gloo.rank, gloo.world_size
        slot = slot_bytes(largest)
        segment, path, problem = None, None, None
        try:
            try:
                if library() is None:
                    raise OSError("the all-reduce kernel could not be built")
                size = segment_bytes(world, slot)
                if rank == 0:
                    remove_stale_segments()
                    path = SHM_DIR / f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
                    segment = Segment(path, size, create=True)
                    library().neuron_shm_init(segment.address, world, slot)
                    rendezvous.set(_STORE_KEY, path.name)
                else:
                    name = rendezvous.get(_STORE_KEY).decode()
                    if not re.fullmatch(re.escape(PREFIX) + r"\d+-[0-9a-f]+", name):
                        raise OSError(f"rank 0 posted an unexpected segment name {name!r:.80}")
                    segment = Segment(SHM_DIR / name, size, create=False)
                    if not library().neuron_shm_check(segment.address, world, slot):
                        raise OSError(f"{name} is not a segment for {world} ranks of this neuron")
            except OSError as exc:
                problem = str(exc)
                segment = None
            agreed = torch.tensor([0.0 if problem else 1.0])
            gloo.all_reduce(agreed)  # every rank has mapped the segment, or given up, past this point
        finally:  # whatever happened (a join aborted included), the name goes: only mappings keep it
            if path is not None:
                path.unlink(missing_ok=True)
        if agreed.item() != world:
            if problem:
                log.warning("rank %d: ranks all-reduce through gloo, not shared memory: %s", rank, problem)
            return gloo
        log.debug("rank %d: all-reduce through shared memory (%d bytes)", rank, segment.size)
        return cls(gloo, segment, timeout_s)

    def takes(self, tensor: torch.Tensor) -> bool:
        return tensor.is_cpu and tensor.dtype in _DTYPES and tensor.is_contiguous()

    def all_reduce(self, tensor: torch.Tensor) -> None:
        segment = self._segment  # held for the call: close() from another thread cannot unmap it under us
        if segment is None:
            raise CommFailure("the shared-memory all-reduce was closed")
        if not self.takes(tensor):
            self.gloo.all_reduce(tensor)
            return
        status = library().neuron_shm_all_reduce(segment.address, self.rank, tensor.data_ptr(), tensor.numel(),
                                                 _DTYPES[tensor.dtype], self._timeout_ms,
                                                 ctypes.addressof(self._abort_word), torch.get_num_threads())
        self._check(status, "all-reduce")

    def native_all_reduce(self) -> NativeAllReduce | None:
        """neuron_shm_all_reduce with this rank's arguments; None once closed (all_reduce raises then)."""
        segment = self._segment
        if segment is None:
            return None
        return NativeAllReduce(ctypes.cast(library().neuron_shm_all_reduce, ctypes.c_void_p).value, segment.address,
                               segment, self.rank, self._timeout_ms, ctypes.addressof(self._abort_word),
                               lambda status: self._check(status, "all-reduce"))

    def gather_to_rank0(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `tensor` (each the same shape and dtype) on rank 0, in rank order; None on the others."""
        segment = self._segment
        if segment is None:
            raise CommFailure("the shared-memory all-reduce was closed")
        if not tensor.is_cpu:
            return self.gloo.gather_to_rank0(tensor)
        src = tensor.contiguous()
        out = torch.empty((self.world_size, *src.shape), dtype=src.dtype) if self.rank == 0 else None
        nbytes = src.numel() * src.element_size()
        status = library().neuron_shm_gather(segment.address, self.rank, src.data_ptr(), nbytes,
                                             None if out is None else out.data_ptr(), self._timeout_ms,
                                             ctypes.addressof(self._abort_word))
        self._check(status, "gather")
        return None if out is None else list(out.unbind(0))

    def _check(self, status: int, what: str) -> None:
        if status == _TIMED_OUT:
            raise CommFailure(f"rank {self.rank}: {what} timed out after {self._timeout_ms / 1000:g} s "
                              "waiting for another rank")
        if status == _ABORTED:
            raise CommFailure(f"rank {self.rank}: {what} aborted (a rank was lost or the ranks are stopping)")
        if status == _BAD_SEGMENT:
            raise CommFailure(f"rank {self.rank}: the shared all-reduce segment is not one this rank can use")

    def abort(self) -> None:
        """From any thread: end this rank's wait, and every other rank's on the segment, at once."""
        self._abort_word.value = 1
        segment = self._segment
        if segment is not None:
            library().neuron_shm_abort(segment.address)
        self.gloo.abort()

    def close(self) -> None:
        self._segment = None
        self.gloo.close()
