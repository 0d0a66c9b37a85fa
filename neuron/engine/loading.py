"""One deadline for a model's whole load, failing with the phase the load was in.

Each start-up step has its own deadline already (workers' pongs, the rendezvous, the shards), but
the leader's own work before them (reading a GGUF file's metadata, converting its tokenizer,
planning memory) had none, and a file built to make that work endless kept `/health` at `loading`
forever. The load now runs on a thread of its own; past `load_timeout_s` the caller gets
`LoadTimeout` naming the phase, the ranks are told to stop, and a load that finishes later shuts
itself down.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from neuron.errors import NeuronError
from neuron.utils.openmp import release_pool

log = logging.getLogger("neuron.engine.loading")


class LoadTimeout(NeuronError):
    """A model's load did not finish within its deadline."""


class Phases:
    """What a load is doing now, as the loading code announces it (`phases("reading ...")`)."""

    def __init__(self) -> None:
        self.now = "starting"
        self.since = time.monotonic()

    def __call__(self, what: str) -> None:
        log.debug("load: %s", what)
        self.now, self.since = what, time.monotonic()


def load_within(load: Callable[[Phases], Any], timeout_s: float, interrupt: Callable[[str], None] | None = None,
                close: Callable[[Any], None] | None = None, hold: Callable[[Any], None] | None = None) -> Any:
    """`load(phases)`'s result, or LoadTimeout after `timeout_s` naming the phase it was in. On a
    timeout `interrupt(reason)` is called (stop the ranks), and a load that completes afterwards is
    handed to `close`. The load's own errors are raised here as they are. The loading thread then
    runs `hold(result)`, which returns once the result is shut down: worker processes die with the
    thread that started them (PR_SET_PDEATHSIG), so it must outlive them."""
    phases = Phases()
    done = threading.Event()
    outcome: dict[str, Any] = {}
    abandoned = threading.Event()

    def run() -> None:
        try:
            outcome["result"] = load(phases)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
            outcome["error"] = exc
        finally:
            release_pool()  # this thread lives on holding the model: its OpenMP pool would slow every step
        with lock:
            late = abandoned.is_set()
            done.set()
        if late and "result" in outcome and close is not None:
            log.info("a load that missed its deadline finished; shutting it down")
            close(outcome["result"])
        elif "result" in outcome and hold is not None:
            hold(outcome["result"])

    lock = threading.Lock()
    thread = threading.Thread(target=run, name="neuron-load", daemon=True)
    thread.start()
    try:
        finished = done.wait(timeout_s)
    except BaseException:  # Ctrl-C while waiting: stop the ranks, let the load end itself
        abandoned.set()
        if interrupt is not None:
            interrupt("loading interrupted")
        raise
    if not finished:
        with lock:
            if not done.is_set():
                abandoned.set()
        if abandoned.is_set():
            reason = (f"loading did not finish within {timeout_s:g} s (load_timeout_s); it was {phases.now} "
                      f"for the last {time.monotonic() - phases.since:.0f} s")
            if interrupt is not None:
                interrupt(reason)
            raise LoadTimeout(reason)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]
