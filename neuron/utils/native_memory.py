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
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

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
