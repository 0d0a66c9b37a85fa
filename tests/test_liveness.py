"""What keeps the server alive: rebuilds that wait out a shortage of descriptors instead
of giving up, a rendezvous that ends at once when a rank dies while joining and leaves nothing
behind, sockets between ranks on loopback only, frozen ranks found within seconds whatever the
step deadline, and a SIGTERM that ends the process within the grace period at any moment."""

from __future__ import annotations

import errno
import os
import signal
import threading
import time

import httpx
import openai
import pytest
from caches import fresh_cache
from checkpoints import executor_config
from server_harness import (
    LiveServer,
    ScriptedEngine,
    ServeProcess,
    client,
    gone,
    health,
    listening,
    metric,
    real_engine,
    scripted_engine,
    wait_until,
)
from test_pool import mock_cmd

from neuron.engine.async_engine import AsyncEngine
from neuron.errors import PoolBroken, WorkerError
from neuron.executor.executor import Executor, resource_shortage
from neuron.executor.pool import WorkerPool
from neuron.rpc import protocol as p
from neuron.worker.worker import Worker

LOOPBACK_HEX = "0100007F"  # 127.0.0.1 as /proc/net/tcp writes it
MODEL = "neuron-default"


# ---- recovery short of descriptors, and stopping (scripted engines) ----


class FailingRanks(ScriptedEngine):
    """A scripted engine whose ranks fail, and whose rebuilds raise what `errors` lists, in turn."""

    def __init__(self, tokenizer, errors: list[BaseException]):
        super().__init__(tokenizer, {})
        self.errors = errors
        self.failure: str | None = None
        self.restarts = 0

    def restart(self) -> None:
        self.restarts += 1
        if self.errors:
            raise self.errors.pop(0)
        self.failure = None


def emfile() -> OSError:
    return OSError(errno.EMFILE, os.strerror(errno.EMFILE))


def test_a_rebuild_short_of_descriptors_is_retried_until_it_works(default_tokenizer, monkeypatch):
    """Five rebuilds fail for lack of descriptors, more than NEURON_RECOVERY_ATTEMPTS: they do not
    count, /health says why the server is not ready, and the sixth rebuild brings it back."""
    monkeypatch.setenv("NEURON_RECOVERY_ATTEMPTS", "2")
    monkeypatch.setenv("NEURON_RECOVERY_BACKOFF_S", "0.05")
    stub = FailingRanks(default_tokenizer, [emfile() for _ in range(4)]
                        + [RuntimeError("gloo: Too many open files")])
    with LiveServer(scripted_engine(stub)) as s:
        s.wait_ready(10)
        stub.failure = "rank 1 exited (code -9)"
        wait_until(lambda: health(s)["status"] != "ready", 5, "the failure was not noticed")
        reasons = []
        wait_until(lambda: reasons.append(health(s)) or reasons[-1]["status"] == "ready", 30,
                   "the server did not recover")
        recovering = [r for r in reasons if r["status"] == "recovering"]
        assert recovering and all(r["error"] == "rank 1 exited (code -9)" for r in recovering)
        waits = [r["reason"] for r in recovering if "retrying in" in r["reason"]]
        assert any("short of a resource (Too many open files)" in w for w in waits), waits
        assert stub.restarts == 6


def test_other_rebuild_failures_still_end_in_failed(default_tokenizer, monkeypatch):
    monkeypatch.setenv("NEURON_RECOVERY_ATTEMPTS", "2")
    monkeypatch.setenv("NEURON_RECOVERY_BACKOFF_S", "0.05")
    stub = FailingRanks(default_tokenizer, [emfile(), RuntimeError("no such device"), RuntimeError("no such device")])
    with LiveServer(scripted_engine(stub)) as s:
        s.wait_ready(10)
        stub.failure = "rank 1 exited (code -9)"
        wait_until(lambda: health(s)["status"] == "failed", 30)
        body = health(s)
        assert "recovery failed after 2 attempts" in body["error"] and "reason" not in body
        assert stub.restarts == 3


def test_resource_shortages_are_told_apart():
    assert resource_shortage(emfile()) == "Too many open files"
    wrapped = WorkerError(1, "comm_init_failed", "gloo init failed: Too many open files in system")
    assert resource_shortage(wrapped) == "Too many open files in system"
    try:
        try:
            raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))
        except OSError as exc:
            raise RuntimeError("spawn failed") from exc
    except RuntimeError as chained:
        assert resource_shortage(chained) == "Cannot allocate memory"
    assert resource_shortage(MemoryError()) == "memory"
    assert resource_shortage(WorkerError(1, "timeout", "missed the step deadline")) is None


def test_the_engine_is_stopped_once(default_tokenizer):
    stub = ScriptedEngine(default_tokenizer, {})
    shutdowns = []
    stub.shutdown = lambda: shutdowns.append(time.monotonic())
    with LiveServer(scripted_engine(stub)) as s:
        s.wait_ready(10)
        engine = s.engine
    t0 = time.monotonic()
    engine.stop()  # what `neuron serve` does after the lifespan has stopped it
    assert time.monotonic() - t0 < 0.5 and len(shutdowns) == 1


def test_stop_interrupts_a_load_that_would_not_end(default_tokenizer):
    interrupted = threading.Event()

    def endless_load():
        if not interrupted.wait(60):
            raise AssertionError("never interrupted")
        raise RuntimeError("start-up abandoned")

    engine = AsyncEngine(endless_load, model_name="stub", max_running=1, max_waiting=1,
                         interrupt=lambda reason: interrupted.set())
    with LiveServer(engine):
        time.sleep(0.2)
        assert engine.state.value == "loading"
        t0 = time.monotonic()
        engine.stop()
        assert time.monotonic() - t0 < 1.0 and interrupted.is_set()


# ---- liveness of mock workers ----


@pytest.fixture
def watched_pool(monkeypatch):
    """Two ranks, rank 1 a mock worker following `script`, looked at every 0.2 s."""
    monkeypatch.setenv("NEURON_LIVENESS_INTERVAL_S", "0.2")
    pools: list[WorkerPool] = []

    def make(script: list[dict] | None = None) -> WorkerPool:
        pools.append(WorkerPool(2, worker_cmd=mock_cmd({1: script or []})))
        pools[-1].spawn(20.0)
        return pools[-1]

    yield make
    for pool in pools:
        pool.kill()


def test_a_frozen_worker_is_killed_between_steps(watched_pool):
    pool = watched_pool()
    lost = threading.Event()
    pool.on_worker_exit(lambda w: lost.set())
    proc = pool.workers[0].proc
    os.kill(proc.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    assert lost.wait(5), "the frozen rank was not found"
    assert time.monotonic() - t0 < 1.5 and pool.broken == "rank 1 was frozen (process state T)"
    wait_until(lambda: proc.poll() == -signal.SIGKILL, 5)
    with pytest.raises(PoolBroken):
        pool.broadcast(lambda seq: p.ClearKvCache(seq=seq, model_id="m"), 5.0)


def test_a_worker_frozen_during_a_step_fails_it_long_before_the_deadline(watched_pool):
    pool = watched_pool([{"op": "clear_kv_cache", "action": "delay", "s": 30}])
    threading.Timer(0.3, lambda: os.kill(pool.workers[0].proc.pid, signal.SIGSTOP)).start()
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as e:
        pool.broadcast(lambda seq: p.ClearKvCache(seq=seq, model_id="m"), 60.0)
    assert time.monotonic() - t0 < 3.0
    assert (e.value.rank, e.value.kind) == (1, "timeout") and "frozen" in e.value.message


def test_a_worker_gone_without_eof_is_reported(watched_pool):
    """A worker whose child still holds its stdout: no EOF ever comes, the monitor reports the exit."""
    pool = watched_pool([{"op": "clear_kv_cache", "action": "orphan", "s": 4, "code": 7}])
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as e:
        pool.broadcast(lambda seq: p.ClearKvCache(seq=seq, model_id="m"), 60.0)
    assert time.monotonic() - t0 < 2.0
    assert e.value.kind == "worker_exited" and "code 7" in e.value.message
    assert pool.broken == "rank 1 exited (code 7)"


# ---- the rendezvous (real workers) ----


@pytest.fixture
def tp2_executor(monkeypatch, tmp_path):
    monkeypatch.setenv("NEURON_CACHE_DIR", str(fresh_cache(tmp_path)))
    executors: list[Executor] = []

    def make() -> Executor:
        ex = Executor(executor_config(max_model_len=128, tp=2))
        executors.append(ex)
        return ex

    yield make
    for ex in executors:
        ex.shutdown()


@pytest.mark.slow
def test_rendezvous_and_gloo_listen_on_loopback_only(tp2_executor):
    ex = tp2_executor().start()
    worker = ex.pool.workers[0].proc.pid
    for pid in (os.getpid(), worker):
        addresses = listening(pid)
        assert addresses, f"no listener in process {pid}"
        assert {a.split(":")[0] for a in addresses} == {LOOPBACK_HEX}, addresses


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
def test_a_rank_lost_while_joining_ends_the_attempt_and_leaves_nothing(tp2_executor, monkeypatch, sig):
    """The worker dies (or freezes) just as rank 0 starts joining the gloo group: the start fails
    within seconds, not at the 60 s collective timeout nor gloo's 300 s connect timeout, and no
    thread, listener or worker of it is left."""
    ex = tp2_executor()
    threads, listeners = set(threading.enumerate()), listening()
    real_init = Worker._init

    def init_losing_rank1(self, req):
        os.kill(ex.pool.workers[0].proc.pid, sig)
        return real_init(self, req)

    monkeypatch.setattr(Worker, "_init", init_losing_rank1)
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as e:
        ex.start()
    took = time.monotonic() - t0
    assert took < 8, f"the failed start took {took:.1f} s"
    assert e.value.rank == 1 and ("exited" if sig == signal.SIGKILL else "frozen") in str(e.value)
    assert ex.pool.workers == []
    wait_until(lambda: set(threading.enumerate()) <= threads, 5,
               f"threads left: {set(threading.enumerate()) - threads}")
    assert listening() == listeners
    monkeypatch.setattr(Worker, "_init", real_init)
    ex.restart()  # the next attempt works
    assert ex.failure is None


# ---- frozen ranks through HTTP (a real tp=2 engine, the default step deadline) ----


@pytest.fixture(scope="module")
def tp2_server(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("NEURON_CACHE_DIR", str(fresh_cache(tmp_path_factory.mktemp("neuron-cache"))))
    mp.delenv("NEURON_TP_STEP_TIMEOUT_S", raising=False)  # 120 s: the liveness monitor must find it first
    mp.setenv("NEURON_RECOVERY_BACKOFF_S", "0.05")
    with LiveServer(real_engine(None, 2, max_model_len=4096, max_num_seqs=4)) as s:
        s.wait_ready()
        yield s
    mp.undo()


def statuses_until_ready(server, timeout_s: float = 60) -> list[str]:
    seen, deadline = [], time.monotonic() + timeout_s
    while not seen or seen[-1] != "ready":
        status = health(server)["status"]
        if not seen or seen[-1] != status:
            seen.append(status)
        assert time.monotonic() < deadline, f"not ready after {timeout_s} s: {seen}"
        time.sleep(0.02)
    return seen


@pytest.mark.slow
def test_a_rank_frozen_between_steps_is_found_and_replaced(tp2_server):
    proc = tp2_server.engine.engine.executor.pool.workers[0].proc
    os.kill(proc.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    seen = []
    wait_until(lambda: seen.append(health(tp2_server)) or seen[-1]["status"] != "ready", 10,
               "/health stayed ready with a frozen rank")
    found = time.monotonic() - t0
    assert seen[-1]["status"] == "recovering" and "rank 1 was frozen" in seen[-1]["error"], seen[-1]
    assert statuses_until_ready(tp2_server)[-1] == "ready"
    assert found < 5, f"found after {found:.1f} s"
    assert proc.poll() == -signal.SIGKILL
    out = client(tp2_server).completions.create(model=MODEL, prompt="hi", max_tokens=3,
                                                extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3


@pytest.mark.slow
def test_a_rank_frozen_during_a_step_fails_the_stream_within_seconds(tp2_server):
    proc = tp2_server.engine.engine.executor.pool.workers[0].proc
    stream = client(tp2_server).completions.create(model=MODEL, prompt="Once", max_tokens=3000, stream=True,
                                                   extra_body={"ignore_eos": True})
    chunks, frozen_at = 0, None
    with pytest.raises(openai.APIError) as e:
        for _ in stream:
            chunks += 1
            if chunks == 5:
                os.kill(proc.pid, signal.SIGSTOP)
                frozen_at = time.monotonic()
    noticed = time.monotonic() - frozen_at
    assert noticed < 10, f"the stream hung for {noticed:.1f} s"
    assert "rank 1" in e.value.message and "frozen" in e.value.message
    seen = statuses_until_ready(tp2_server)
    assert seen[-1] == "ready" and set(seen) <= {"recovering", "ready"}


# ---- SIGTERM at any moment (`neuron serve`) ----


def _freeze_when_respawned(served: ServeProcess, old: int) -> int:
    """SIGSTOP the worker a rebuild spawns, before it answers its ping."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        fresh = [pid for pid in served.workers() if pid != old]
        if fresh:
            os.kill(fresh[0], signal.SIGSTOP)
            return fresh[0]
        time.sleep(0.005)
    raise AssertionError("no worker was respawned")


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["frozen_step", "frozen_rebuild"])
def test_sigterm_exits_within_the_grace_period_at_any_moment(tmp_path, moment):
    """With the liveness monitor slowed down so the frozen rank stays frozen: a SIGTERM while a
    step waits on it, or while a rebuild waits for its ping, ends the process within the grace
    period and a few seconds, exit 0, no worker left, the engine stopped once."""
    grace = 2.0
    env = {"NEURON_CACHE_DIR": str(fresh_cache(tmp_path)), "NEURON_SHUTDOWN_GRACE_S": str(grace),
           "NEURON_LIVENESS_INTERVAL_S": "1000"}
    with ServeProcess("--tp", "2", "--max-model-len", "4096", env=env) as served:
        [worker] = served.workers()
        if moment == "frozen_step":
            body = {"model": MODEL, "prompt": "Once", "max_tokens": 3000, "ignore_eos": True}
            threading.Thread(target=lambda: httpx.post(f"{served.base_url}/completions", json=body, timeout=60),
                             daemon=True).start()
            wait_until(lambda: metric(served, "neuron_num_requests_running") == 1, 30)
            time.sleep(0.5)
            os.kill(worker, signal.SIGSTOP)
            frozen = [worker]
        else:
            os.kill(worker, signal.SIGKILL)
            frozen = [worker, _freeze_when_respawned(served, worker)]
        time.sleep(0.5)
        t0 = time.monotonic()
        served.proc.send_signal(signal.SIGTERM)
        code = served.proc.wait(grace + 15)
        took = time.monotonic() - t0
        log = "".join(served.lines)
        assert code == 0 and took < grace + 8, f"SIGTERM: exit {code} after {took:.1f} s; the log ends:\n{log[-3000:]}"
        wait_until(lambda: all(gone(pid) for pid in frozen), 5, "a worker outlived the leader")
        assert log.count("interrupting the ranks") <= 1 and "stopped" in log, log[-3000:]


def test_a_worker_stopped_at_birth_does_not_outlive_its_leader(tmp_path):
    """A worker frozen before its interpreter ties its life to the leader's (a rebuild's new worker
    stopped at once) is killed when the leader exits, however the pool was left."""
    import subprocess
    import sys

    leader = (
        "import os, signal, sys\n"
        "from neuron.executor.pool import WorkerPool\n"
        "stopper = [sys.executable, '-c', 'import os, signal; os.kill(os.getpid(), signal.SIGSTOP)']\n"
        "pool = WorkerPool(2, worker_cmd=lambda rank, world, device: stopper)\n"
        "try:\n"
        "    pool.spawn(0.5)\n"
        "except Exception:\n"
        "    pass\n"
        "print(pool.workers[0].proc.pid, flush=True)\n"
    )
    out = subprocess.run([sys.executable, "-c", leader], capture_output=True, text=True, timeout=60)
    pid = int(out.stdout.split()[-1])
    try:
        wait_until(lambda: gone(pid), 5, "a worker outlived the leader")
    finally:
        if not gone(pid):
            os.kill(pid, signal.SIGKILL)
