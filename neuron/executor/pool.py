"""The leader's side of the ranks: worker processes behind pipes plus rank 0 in-process.

Every fan-out is followed by a drain of exactly one reply per worker, on every path, matched by
`seq`: a reply with another seq is stale and is logged and dropped. Every wait has a deadline,
and a worker that exits is noticed at once (its reader thread sees EOF), not at the deadline. A
liveness monitor looks at every worker's process state each second, between steps too: a rank
stopped (SIGSTOP, a debugger) is killed as the step watchdog would kill it, and a rank whose
process is gone without its output closing is reported as exited.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from neuron.config import settings
from neuron.errors import PoolBroken, WorkerError
from neuron.executor.watchdog import StepWatchdog
from neuron.rpc import codec
from neuron.rpc import protocol as p
from neuron.utils import procfs

log = logging.getLogger("neuron.pool")

# Every worker process this leader started and has not yet seen exit. A worker ties its life to
# the leader's (PR_SET_PDEATHSIG) only once its interpreter is up, so one stopped before that (a
# rebuild's new worker frozen at birth) would outlive a leader that exits while it waits; at exit the
# leader kills whatever is still here.
_SPAWNED: set[subprocess.Popen] = set()
_SPAWNED_LOCK = threading.Lock()


def _kill_spawned() -> None:
    with _SPAWNED_LOCK:
        procs = list(_SPAWNED)
    for proc in procs:
        if proc.poll() is None:
            proc.kill()


atexit.register(_kill_spawned)

_EOF = object()
_DRAIN_GRACE_S = 2.0
_JOIN_S = 2.0  # how long a torn-down pool waits for a reader thread to see its worker's EOF
_REAP_S = 0.5  # a worker's output closes a moment before it can be reaped: wait this long for its code
# A rank seen stopped on this many checks in a row is frozen: one look could catch a whole process
# group stopped by Ctrl-Z and resumed, the leader waking a moment before its workers.
_FROZEN_CHECKS = 2


def default_worker_cmd(rank: int, world_size: int, device: str) -> list[str]:
    return [sys.executable, "-m", "neuron", "--worker", "--rank", str(rank), "--tp-size", str(world_size),
            "--device", device]


@dataclass
class WorkerProcess:
    """One worker process: its pipes, a reader thread feeding `replies`, its stderr passed through."""

    rank: int
    proc: subprocess.Popen
    replies: queue.Queue = field(default_factory=queue.Queue)
    on_exit: Callable[["WorkerProcess"], None] | None = None
    killed_because: str | None = None  # why the leader killed it (deadline, frozen), for the step's error
    exit_reported: bool = False
    threads: list[threading.Thread] = field(default_factory=list)

    def start_threads(self) -> None:
        self.threads = [threading.Thread(target=self._read_stdout, name=f"rank{self.rank}-stdout", daemon=True),
                        threading.Thread(target=self._pass_stderr, name=f"rank{self.rank}-stderr", daemon=True)]
        for t in self.threads:
            t.start()

    def kill(self, reason: str) -> None:
        """SIGKILL, remembering why: its reader then sees EOF and the step that waits on it fails
        with `reason` rather than with a plain exit."""
        self.killed_because = self.killed_because or reason
        if self.proc.poll() is None:
            self.proc.kill()

    def join_threads(self) -> None:
        for t in self.threads:
            t.join(_JOIN_S)

    def _read_stdout(self) -> None:
        limit = codec.max_line_bytes()
        while True:
            try:
                line = codec.read_line(self.proc.stdout, limit)
            except codec.LineTooLong:
                log.warning("rank %d sent a line over %d bytes; dropped", self.rank, limit)
                continue
            except (OSError, ValueError):
                line = None
            if line is None:  # the exit is reported (pool broken, rank 0 freed) before a waiting step sees it
                if self.on_exit:
                    self.on_exit(self)
                self.replies.put(_EOF)
                return
            reply = codec.decode_reply(line)
            if reply is None:
                log.warning("rank %d sent a non-protocol line: %r", self.rank, line[:200])
                continue
            self.replies.put(reply)

    def _pass_stderr(self) -> None:
        for line in iter(self.proc.stderr.readline, b""):
            sys.stderr.write(line.decode("utf-8", "replace"))
        sys.stderr.flush()

    def send(self, msg: p.Message) -> None:
        try:
            self.proc.stdin.write(codec.encode(msg))
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            raise WorkerError(self.rank, "worker_exited", self._exit_text()) from None

    def expect(self, seq: int, deadline: float) -> p.Reply:
        """The reply to `seq`, skipping stale ones; raises WorkerError on exit, error or deadline."""
        while True:
            remaining = deadline - time.monotonic()
            try:  # past the deadline, still take what already arrived: the drain must consume it
                reply = self.replies.get(timeout=remaining) if remaining > 0 else self.replies.get_nowait()
            except queue.Empty:
                if remaining > 0:
                    continue
                raise WorkerError(self.rank, "timeout", f"no reply to seq {seq} before the deadline") from None
            if reply is _EOF:
                self.replies.put(_EOF)  # later waits fail fast too
                if self.killed_because is not None:
                    raise WorkerError(self.rank, "timeout", f"{self.killed_because}; the rank was killed")
                raise WorkerError(self.rank, "worker_exited", self._exit_text())
            if reply.seq != seq:
                log.warning("rank %d: discarding stale %s (seq %d, awaiting %d)", self.rank,
                            type(reply).__name__, reply.seq, seq)
                continue
            if isinstance(reply, p.Error):
                raise WorkerError(self.rank, reply.kind, reply.message)
            return reply

    def _exit_text(self) -> str:
        try:
            code = self.proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            return "worker closed its output but is still running"
        return f"worker process exited with code {code}"

    def alive(self) -> bool:
        return self.proc.poll() is None


class WorkerPool:
    """Ranks 1..W-1 as subprocesses and rank 0 in-process, driven in lock-step."""

    def __init__(
        self,
        world_size: int,
        devices: list[str] | None = None,
        worker_cmd: Callable[[int, int, str], list[str]] = default_worker_cmd,
        env: dict[str, str] | None = None,
        listener=None,
        remote: set[int] | None = None,
    ):
        self.world_size = world_size
        self.devices = devices or ["cpu"] * world_size
        self.worker_cmd = worker_cmd  # None for a rank that dials in (through `listener`, rpc/dial_in.py)
        self.env = env
        self.listener = listener
        self.remote = remote or set()  # ranks on other hosts: heartbeats, as their processes cannot be seen
        self._step_lock = threading.Lock()  # a fan-out and a heartbeat never interleave
        self.workers: list[WorkerProcess] = []
        self.broken: str | None = None
        self._seq = itertools.count(1)
        self._on_worker_exit: Callable[[WorkerProcess], None] | None = None
        self._closing = False
        self._lock = threading.Lock()  # one exit report per worker, from its reader or the monitor
        self._monitor_stop = threading.Event()
        self._monitor: threading.Thread | None = None
        self._watchdog = StepWatchdog(self._kill_owing)

    # ---- lifecycle ----

    def spawn(self, deadline_s: float) -> list[p.Pong]:
        """Start every worker and wait for each one's `pong`."""
        env = {**os.environ, **(self.env or {}), "PYTHONUNBUFFERED": "1"}
        dialling = set()
        for rank in range(1, self.world_size):
            cmd = self.worker_cmd(rank, self.world_size, self.devices[rank])
            if cmd is None:
                dialling.add(rank)
                continue
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    env=env, start_new_session=False)
            with _SPAWNED_LOCK:
                _SPAWNED.add(proc)
            self._add_worker(rank, proc)
        log.info("spawned %d worker(s)", len(self.workers))
        if dialling:
            for rank, conn in self.listener.accept(dialling, deadline_s).items():
                self._add_worker(rank, conn)
            self.workers.sort(key=lambda w: w.rank)
        self._start_monitor()
        return self.broadcast(lambda seq: p.Ping(seq=seq), deadline_s)

    def _add_worker(self, rank: int, proc) -> None:
        worker = WorkerProcess(rank, proc, on_exit=self._worker_exited)
        worker.start_threads()
        self.workers.append(worker)

    def _worker_exited(self, worker: WorkerProcess) -> None:
        with self._lock:
            if self._closing or worker.exit_reported:
                return
            worker.exit_reported = True
        try:
            what = f"exited (code {worker.proc.wait(timeout=_REAP_S)})"
        except subprocess.TimeoutExpired:  # its output closed but the process lingers
            what = "closed its output without exiting"
        log.error("rank %d %s unexpectedly", worker.rank, what)
        self.broken = self.broken or f"rank {worker.rank} {what}"
        if self._on_worker_exit:
            self._on_worker_exit(worker)

    # ---- liveness ----

    def _start_monitor(self) -> None:
        if self.workers and self._monitor is None:
            s = settings()
            self._monitor = threading.Thread(target=self._watch_liveness,
                                             args=(s.liveness_interval_s, s.heartbeat_timeout_s),
                                             name="worker-liveness", daemon=True)
            self._monitor.start()

    def _stop_monitor(self) -> None:
        self._monitor_stop.set()
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(_JOIN_S)

    def _watch_liveness(self, interval_s: float, heartbeat_s: float) -> None:
        """Independent of any step deadline: a frozen rank is killed within about two intervals,
        between steps as well as during one, and a rank gone without its EOF is reported. A rank
        on another host, whose process cannot be seen from here, is pinged between steps instead:
        one that does not answer within `heartbeat_s` is killed (its host frozen, or cut off)."""
        stopped_checks = {w.rank: 0 for w in self.workers}
        while not self._monitor_stop.wait(interval_s):
            self._heartbeat(heartbeat_s)
            for w in list(self.workers):
                if w.proc.poll() is not None:
                    if not w.exit_reported:  # its reader never sees EOF while a child of it holds the pipe
                        self._worker_exited(w)
                        w.replies.put(_EOF)
                    continue
                if w.proc.pid is None:  # a rank that dialled in: no process here to look at
                    continue
                stopped_checks[w.rank] = stopped_checks.get(w.rank, 0) + 1 if procfs.stopped(w.proc.pid) else 0
                if stopped_checks[w.rank] >= _FROZEN_CHECKS and w.killed_because is None:
                    self._condemn(w, f"was frozen (process state {procfs.state(w.proc.pid)})")

    def _heartbeat(self, timeout_s: float) -> None:
        """Ping the ranks on other hosts while no step runs (a step has its own deadline)."""
        if not self.remote or not self._step_lock.acquire(blocking=False):
            return
        try:
            pinged = [w for w in self.workers if w.rank in self.remote and w.alive() and w.killed_because is None]
            if not pinged or self.broken or self._closing:
                return
            seq = next(self._seq)
            for w in list(pinged):
                try:
                    w.send(p.Ping(seq=seq))
                except WorkerError:
                    pinged.remove(w)  # gone: its reader reports the exit
            deadline = time.monotonic() + timeout_s
            for w in pinged:
                try:
                    w.expect(seq, deadline)
                except WorkerError as exc:
                    if exc.kind == "timeout" and w.killed_because is None:
                        self._condemn(w, f"did not answer a heartbeat within {timeout_s:g}s (its host frozen or "
                                         "cut off)")
        finally:
            self._step_lock.release()

    def _condemn(self, w: WorkerProcess, reason: str) -> None:
        """Kill a rank that cannot answer; its EOF then fails the step that waits on it, aborts rank 0's
        communicator and wakes the engine, as any exit does."""
        log.error("rank %d %s; killing it", w.rank, reason)
        self.broken = self.broken or f"rank {w.rank} {reason}"
        w.kill(reason)

    def on_worker_exit(self, callback: Callable[[WorkerProcess], None]) -> None:
        """Called from the worker's reader thread the moment its output closes."""
        self._on_worker_exit = callback

    def shutdown(self, grace_s: float = 5.0) -> None:
        """Ask every worker to exit, then reap it; kill whoever outstays the grace period."""
        self._closing = True
        self._stop_monitor()
        self._watchdog.stop()
        for w in self.workers:
            if w.alive():
                try:
                    w.send(p.Shutdown(seq=next(self._seq)))
                except WorkerError:
                    pass
            try:
                w.proc.stdin.close()
            except OSError:
                pass
        deadline = time.monotonic() + grace_s
        for w in self.workers:
            try:
                w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("rank %d did not exit within %.1fs; killing it", w.rank, grace_s)
                w.proc.kill()
                w.proc.wait()
        self._forget_workers()
        self.broken = self.broken or "shut down"

    def kill(self) -> None:
        """Tear down at once (the pool is beyond saving); nothing of it keeps running."""
        self._closing = True
        self._stop_monitor()
        self._watchdog.stop()
        for w in self.workers:
            if w.alive():
                w.proc.kill()
        for w in self.workers:
            w.proc.wait()
        self._forget_workers()
        self.broken = self.broken or "killed"

    def interrupt(self, reason: str) -> None:
        """From any thread: kill every worker so whatever waits on them (a start-up step, a step)
        fails at once. The owner still reaps them with `kill` or `shutdown`."""
        self.broken = self.broken or reason
        for w in list(self.workers):
            w.kill(reason)

    def _forget_workers(self) -> None:
        for w in self.workers:
            w.join_threads()
        with _SPAWNED_LOCK:
            _SPAWNED.difference_update(w.proc for w in self.workers if isinstance(w.proc, subprocess.Popen)
                                       and w.proc.poll() is not None)
        self.workers = []

    # ---- fan-out and drain ----

    def broadcast(self, make: Callable[[int], p.Message], deadline_s: float) -> list[p.Reply]:
        """Send one request to every worker and return their replies (rank 0 does nothing)."""
        return self.fan_out(make, None, deadline_s)[1]

    def fan_out(self, make: Callable[[int], p.Message], local: Callable[[p.Message], Any] | None,
                deadline_s: float) -> tuple[Any, list[p.Reply]]:
        """Send `make(seq)` to every worker first, run rank 0's part on the same message, then
        ALWAYS drain one reply per worker.

        Raises after the drain: rank 0's own error first, else the lowest failing rank's."""
        with self._step_lock:
            return self._fan_out(make, local, deadline_s)

    def _fan_out(self, make: Callable[[int], p.Message], local: Callable[[p.Message], Any] | None,
                 deadline_s: float) -> tuple[Any, list[p.Reply]]:
        if self.broken:
            raise PoolBroken(f"worker pool unusable: {self.broken}")
        seq = next(self._seq)
        msg = make(seq)
        deadline = time.monotonic() + deadline_s
        errors: list[BaseException] = []
        sent: list[WorkerProcess] = []
        for w in self.workers:
            try:
                w.send(msg)
                sent.append(w)
            except WorkerError as exc:
                errors.append(exc)
        result = None
        local_error: BaseException | None = None
        watched = self._watchdog.arm(deadline_s) if local is not None and self.workers else None
        if local is not None:
            try:
                result = local(msg)
            except BaseException as exc:  # noqa: BLE001 - re-raised after the drain
                local_error = exc
        replies = []
        if watched is not None:
            # Rank 0's part is done, so no rank waits on it inside a collective: the replies' own
            # deadline bounds the rest. Left armed, the watchdog raced that deadline and could kill
            # a rank that was only late, which the step's timeout error leaves alive.
            self._watchdog.disarm()
            if self._watchdog.fired(watched):
                deadline += _DRAIN_GRACE_S  # ranks freed by the watchdog still owe their error reply
        for w in sent:
            try:
                replies.append(w.expect(seq, deadline))
            except WorkerError as exc:
                errors.append(exc)
        lost = [e for e in errors if e.kind in ("timeout", "worker_exited")]
        if lost:  # a rank gone or stuck is the cause; rank 0's collective error is its echo
            raise min(lost, key=lambda e: e.rank)
        if local_error is not None:
            raise local_error
        if errors:
            raise min(errors, key=lambda e: e.rank)
        return result, replies

    def _kill_owing(self) -> None:
        """Past a step's deadline (the watchdog's call), kill the workers that still owe a reply. A
        rank stopped inside a collective would otherwise hold rank 0 in the all-reduce until the
        collective timeout; killed, its connections close and every backend reports that at once."""
        owing = [w for w in self.workers if w.alive() and w.replies.empty()]
        # A frozen rank holds the live ones inside the collective with it: kill it alone, and the
        # others' collectives fail and they answer. Only if none is frozen are all owing ones killed.
        culprits = [w for w in owing if w.proc.pid is not None and procfs.stopped(w.proc.pid)] or owing
        for w in culprits:
            self._condemn(w, "missed the step deadline")

