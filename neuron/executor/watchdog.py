"""The step deadline: one thread watches every step's (a timer thread per step cost a thread start
and its scheduling in each step, on the CPU a measurable share of a small model's step)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class StepWatchdog:
    """Calls `on_expiry` once when an armed deadline passes before `disarm`.

    Arming takes a lock and wakes the thread only when it would otherwise sleep past the new
    deadline; with steps back to back it wakes about once per deadline's length, finds the step
    then running armed later, and sleeps on."""

    def __init__(self, on_expiry: Callable[[], None], name: str = "step-watchdog"):
        self._on_expiry = on_expiry
        self._name = name
        self._cond = threading.Condition()
        self._deadline: float | None = None  # while armed: when the running step expires
        self._wakes_at: float | None = None  # when the thread wakes next; None: when notified
        self._armed = 0  # counts armings, so that a firing names the step it belongs to
        self._fired = 0
        self._generation = 0  # stop() ends the thread of this generation; a later arm() starts another
        self._thread: threading.Thread | None = None

    def arm(self, timeout_s: float) -> int:
        """Watch a step that must end within `timeout_s`; returns its token for `fired`."""
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, args=(self._generation,), name=self._name,
                                                daemon=True)
                self._thread.start()
            self._armed += 1
            self._deadline = time.monotonic() + timeout_s
            if self._wakes_at is None or self._deadline < self._wakes_at:
                self._cond.notify()
            return self._armed

    def disarm(self) -> None:
        with self._cond:
            self._deadline = None

    def fired(self, token: int) -> bool:
        """Whether the step `arm` returned `token` for ran past its deadline."""
        return self._fired == token

    def stop(self, join_s: float = 1.0) -> None:
        """End the thread (the pool is torn down); arming again starts a new one."""
        with self._cond:
            thread, self._thread = self._thread, None
            self._generation += 1
            self._deadline = None
            self._cond.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join(join_s)

    def _run(self, generation: int) -> None:
        with self._cond:
            while self._generation == generation:
                now = time.monotonic()
                if self._deadline is not None and now >= self._deadline:
                    self._deadline, self._fired = None, self._armed
                    self._cond.release()
                    try:
                        self._on_expiry()
                    finally:
                        self._cond.acquire()
                    continue
                self._wakes_at = self._deadline
                self._cond.wait(None if self._deadline is None else self._deadline - now)
                self._wakes_at = None
