"""Joining an NCCL group with a deadline and a way out.

`ncclCommInitRank` blocks in C until every rank has arrived and nothing interrupts it: a rank that
died before joining would hold the others there for good. The join therefore runs on a thread of
its own while the caller waits for it, until the deadline or until `abort` is called from another
thread (a rank died, the server stops). Then the caller gives up and the thread is left to finish
inside NCCL; a communicator it still makes later is destroyed at once, so nothing keeps it.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from neuron.distributed.comm import Communicator, RendezvousAborted

_POLL_S = 0.05


class NcclJoin:
    def __init__(self, make: Callable[[], Communicator], deadline_s: float):
        self._make = make
        self._deadline_s = deadline_s
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._finished = False
        self._abandoned = False
        self._aborted: str | None = None
        self._comm: Communicator | None = None
        self._error: BaseException | None = None

    def abort(self, reason: str) -> None:
        self._aborted = reason
        self._wake.set()

    def run(self) -> Communicator:
        """The communicator, once every rank joined; RendezvousAborted at the deadline or on abort."""
        threading.Thread(target=self._join, name="nccl-join", daemon=True).start()
        end = time.monotonic() + self._deadline_s
        while True:
            with self._lock:
                if self._finished:
                    break
                why = self._why_give_up(end)
                if why is not None:
                    self._abandoned = True
                    raise RendezvousAborted(why)
            self._wake.wait(_POLL_S)
        if self._error is not None:
            raise self._error
        return self._comm

    def _why_give_up(self, end: float) -> str | None:
        if self._aborted is not None:
            return f"joining the NCCL group was aborted: {self._aborted}"
        if time.monotonic() >= end:
            return f"ranks did not all join the NCCL group within {self._deadline_s:g} s"
        return None

    def _join(self) -> None:
        comm, error = None, None
        try:
            comm = self._make()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
            error = exc
        with self._lock:
            if not self._abandoned:
                self._comm, self._error, self._finished = comm, error, True
                self._wake.set()
                return
        if comm is not None:  # the caller gave up on this join: nobody will use or close it
            comm.close()
