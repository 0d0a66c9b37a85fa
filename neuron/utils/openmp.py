"""OpenMP's thread pools: one per thread that starts parallel work, and what an extra one costs.

libgomp, torch's OpenMP runtime on Linux and the one neuron's C++ kernels share, gives every thread
that starts a parallel region a pool of worker threads of its own, kept for as long as that thread
lives. Once a process holds more pool threads than it has CPUs, libgomp spins 100 times instead of
300,000 at each barrier before it sleeps, so every fork and join of a parallel region becomes a
futex sleep and a wake-up. A model's load runs on a thread that stays alive until the model is shut
down (loading.py): its pool, made by the load's own tensor work, put every later step's parallel
regions (about 200 a token on a 30-layer model) on that slow path. SmolLM2-135M's Q4_1 decode on two
cores went from 63 to 130-147 tok/s once the loading thread gave its pool back
(docs/benchmarks.md).

So a thread that runs tensor work and then lives on without stepping calls `release_pool` when its
work is done. The thread that steps keeps its pool while it has work, and gives it back when it runs
out (async_engine.py): a host serving several models steps each on a thread of its own, and an idle
model's pool would count against the CPUs for the busy ones.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from collections.abc import Callable
from typing import TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

WAIT_POLICY = "OMP_WAIT_POLICY"  # how a runtime's idle threads wait: spinning (active) or asleep (passive)
_OMP_PAUSE_HARD = 2  # omp_pause_resource_t: the pool's threads end, as opposed to sleeping
_RUNTIMES = ("libgomp.so.1", "libomp.so", "libomp.dylib", "libiomp5.so")


@functools.cache
def _pause() -> Callable[[int], int] | None:
    """omp_pause_resource_all of the OpenMP runtime already in the process, or None (none loaded yet,
    or one older than OpenMP 5.0)."""
    mode = getattr(os, "RTLD_NOLOAD", 0) | getattr(os, "RTLD_LAZY", 0)
    for name in _RUNTIMES:
        try:
            fn = ctypes.CDLL(name, mode=mode).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
        return fn
    return None


def usable_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity, where the platform has one)."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def release_pool() -> bool:
    """End the calling thread's OpenMP pool (it is made again if this thread starts parallel work
    later). True if a runtime took the request; never raises."""
    import torch  # noqa: F401 - the runtime it loads is the one to ask

    pause = _pause()
    if pause is None:
        return False
    done = pause(_OMP_PAUSE_HARD) == 0
    if not done:
        log.debug("the OpenMP runtime kept this thread's pool (called inside a parallel region?)")
    return done


def then_release_pool(fn: Callable[..., T], *args) -> T:
    """`fn(*args)`, then the calling thread's pool released: for work handed to a pooled thread
    (`asyncio.to_thread`) that will live on doing other things."""
    try:
        return fn(*args)
    finally:
        release_pool()
