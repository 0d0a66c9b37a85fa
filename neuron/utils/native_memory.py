"""Running native code that a client's input drives: on a thread with a stack deep enough for it,
and with the C heap's growth measured and handed back to the system afterwards.

Native libraries (llguidance's grammar compiler is one) may recurse as deep as their input nests.
A thread's stack is 8 MiB by default; past it the process dies with SIGSEGV, which no `except`
can catch. `run_with_stack` runs a function on a fresh thread whose stack is large enough for
the deepest input the caller admits. The stack is reserved address space: only the pages the
recursion touches use memory, and a fresh thread's stack is unmapped when it ends.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import mmap
import threading
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")

HUGE_PAGE = 2 << 20  # a transparent huge page on x86-64 and most aarch64 kernels

_stack_size_lock = threading.Lock()  # threading.stack_size is process-wide: set, start, restore


def run_with_stack(stack_bytes: int, fn: Callable[..., T], *args) -> T:
    """`fn(*args)` on a new thread with a `stack_bytes` stack; its result, or its exception re-raised.
    The thread takes the caller's name: it does the caller's work, and logs should say whose."""
    out: dict = {}

    def body() -> None:
        try:
            out["value"] = fn(*args)
        except BaseException as exc:  # carried to the caller's thread
            out["error"] = exc

    with _stack_size_lock:
        previous = threading.stack_size(stack_bytes)
        try:
            thread = threading.Thread(target=body, name=threading.current_thread().name, daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _libc():
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        lib.mallinfo2.restype = _MallInfo2
        lib.malloc_trim.argtypes = [ctypes.c_size_t]
        return lib
    except (OSError, AttributeError):  # not glibc (musl, macOS): no measurement, no trimming
        return None


_LIBC = _libc()


def heap_in_use() -> int | None:
    """Bytes the C heap has handed out (glibc's mallinfo2), or None where it cannot be read. It
    counts every thread's allocations, so a difference around a call is the call's only while
    nothing else allocates much meanwhile."""
    if _LIBC is None:
        return None
    info = _LIBC.mallinfo2()
    return info.uordblks + info.hblkhd


def release_free_heap() -> None:
    """Return the C heap's free pages to the system (glibc's malloc_trim), so memory a large
    native object held shows up as free again once that object is gone."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def huge_page_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor on a private anonymous mapping of its own, advised for transparent
    huge pages from its first 2 MiB boundary for as many whole huge pages as it spans. For what a
    step streams end to end (a weight's panels): with 4 KiB pages every page costs a TLB walk and
    stops the hardware prefetcher at its edge, and on the benchmark VM two ranks streaming their
    weights side by side read 10-15 % faster from huge pages when memory is contended
    (docs/benchmarks.md). Its pages are meant to be written at once (at load), so their faults fall
    there and never in a step. The advice is only advice: where the kernel has no huge pages to give,
    the pages are ordinary ones; under 2 MiB, or where nothing can be mapped, it is `torch.empty`."""
    nbytes = math.prod(shape) * dtype.itemsize
    whole_pages = nbytes // HUGE_PAGE * HUGE_PAGE
    if whole_pages == 0 or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype)
    try:  # private: a shared anonymous mapping is backed by shmem, whose pages cost more to fault
        pages = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:
        return torch.empty(shape, dtype=dtype)
    whole = torch.frombuffer(pages, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    try:
        pages.madvise(mmap.MADV_HUGEPAGE, start, whole_pages)
        # The tail past the last whole huge page stays in small pages even where THP is `always`, so
        # the tensor never holds more than its own bytes.
        pages.madvise(mmap.MADV_NOHUGEPAGE, start + whole_pages, len(pages) - start - whole_pages)
    except OSError:
        pass
    return whole[start:start + nbytes].view(dtype).view(shape)
