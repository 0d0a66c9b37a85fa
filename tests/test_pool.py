"""WorkerPool against scripted mock workers: every fan-out drains, failures name their rank, and
deadlines hold."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import pytest

from neuron.errors import PoolBroken, WorkerError
from neuron.executor.pool import WorkerPool
from neuron.rpc import protocol as p

MOCK = Path(__file__).resolve().with_name("mock_worker.py")
SPAWN_S = 20.0  # generous: interpreter start-up on a loaded machine

pytestmark = pytest.mark.timeout(60)


def mock_cmd(scripts: dict[int, list[dict]]):
    def cmd(rank: int, world_size: int, device: str) -> list[str]:
        return [sys.executable, str(MOCK), "--rank", str(rank), "--tp-size", str(world_size),
                "--script", json.dumps(scripts.get(rank, []))]

    return cmd


@pytest.fixture
def make_pool():
    pools: list[WorkerPool] = []

    def make(world_size: int, scripts: dict[int, list[dict]] | None = None) -> WorkerPool:
        pool = WorkerPool(world_size, worker_cmd=mock_cmd(scripts or {}))
        pools.append(pool)
        pool.spawn(SPAWN_S)
        return pool

    yield make
    for pool in pools:
        pool.kill()


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def count(self, text: str) -> int:
        return sum(text in m for m in self.messages)


@pytest.fixture
def pool_log():
    """The pool's log lines, captured even when the `neuron` logger does not propagate."""
    logger = logging.getLogger("neuron.pool")
    handler = Records()
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.DEBUG)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(old_level)


def step(seq: int) -> p.ForwardStep:
    return p.ForwardStep(seq=seq, model_id="m", seqs=[p.SeqStep(slot=0, token_ids=[1], offset=0)])


def clear(seq: int) -> p.ClearKvCache:
    return p.ClearKvCache(seq=seq, model_id="m")


def assert_drained(pool: WorkerPool) -> None:
    """No worker has a reply waiting (a dead worker's end-of-output marker is not a reply)."""
    for w in pool.workers:
        unread = [r for r in list(w.replies.queue) if isinstance(r, p.Message)]
        assert unread == [], f"rank {w.rank} has unread replies"


def assert_step_replies(replies: list, world_size: int) -> None:
    """Each worker's own reply, in rank order (the mock puts its rank in elapsed_ms)."""
    assert [type(r) for r in replies] == [p.ForwardStepOk] * (world_size - 1)
    assert [r.elapsed_ms for r in replies] == [float(rank) for rank in range(1, world_size)]


def raise_boom(msg):
    raise RuntimeError("rank 0 failed")


# ---- the happy path ----


@pytest.mark.parametrize("world_size", [2, 3])
def test_spawn_and_ping(make_pool, world_size):
    pool = make_pool(world_size)
    pongs = pool.broadcast(lambda seq: p.Ping(seq=seq), 3.0)
    assert [(x.rank, x.world_size, x.device) for x in pongs] == [(r, world_size, "mock") for r in range(1, world_size)]
    result, replies = pool.fan_out(step, lambda msg: "logits", 3.0)
    assert result == "logits"
    assert_step_replies(replies, world_size)
    assert len({r.seq for r in replies}) == 1
    assert_drained(pool)


def test_every_op_round_trip(make_pool):
    pool = make_pool(3)
    init = pool.broadcast(lambda seq: p.Init(seq=seq, backend="gloo", comm_id="127.0.0.1:1", timeout_s=1.0), 3.0)
    assert [r.backend for r in init] == ["gloo", "gloo"]
    assert [r.observed_sum for r in pool.broadcast(lambda seq: p.CommSanityCheck(seq=seq), 3.0)] == [3.0, 3.0]
    assert {type(r) for r in pool.broadcast(clear, 3.0)} == {p.KvCacheCleared}
    assert {type(r) for r in pool.broadcast(lambda seq: p.UnloadModel(seq=seq, model_id="m"), 3.0)} == {p.Unloaded}


# ---- drain on every path ----


def test_drain_after_rank0_error(make_pool, pool_log):
    pool = make_pool(3, {1: [{"op": "forward_step", "action": "delay", "s": 0.3}],
                         2: [{"op": "forward_step", "action": "delay", "s": 0.5}]})
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 0 failed"):
        pool.fan_out(step, raise_boom, 3.0)
    assert time.monotonic() - t0 >= 0.5  # it waited for both workers' replies
    assert_drained(pool)
    # The next request reads its own replies; nothing stale was left in the pipes.
    result, replies = pool.fan_out(step, lambda msg: "ok", 3.0)
    assert result == "ok"
    assert_step_replies(replies, 3)
    assert pool_log.count("stale") == 0


def test_rank0_error_wins_over_worker_error(make_pool):
    pool = make_pool(2, {1: [{"op": "forward_step", "nth": 1, "action": "error", "kind": "forward_failed"}]})
    with pytest.raises(RuntimeError, match="rank 0 failed"):
        pool.fan_out(step, raise_boom, 3.0)
    assert_drained(pool)
    assert_step_replies(pool.fan_out(step, None, 3.0)[1], 2)


def test_one_worker_fails_and_the_other_is_still_drained(make_pool, pool_log):
    pool = make_pool(3, {1: [{"op": "forward_step", "nth": 1, "action": "error", "kind": "forward_failed"}],
                         2: [{"op": "forward_step", "nth": 1, "action": "delay", "s": 0.4}]})
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as info:
        pool.fan_out(step, lambda msg: None, 3.0)
    assert time.monotonic() - t0 >= 0.4
    assert (info.value.rank, info.value.kind) == (1, "forward_failed")
    assert_drained(pool)
    assert_step_replies(pool.fan_out(step, None, 3.0)[1], 3)
    assert pool_log.count("stale") == 0


# ---- misbehaving output ----


def test_stale_reply_is_discarded(make_pool, pool_log):
    pool = make_pool(2, {1: [{"op": "forward_step", "action": "stale"}]})
    _, replies = pool.fan_out(step, None, 3.0)
    assert_step_replies(replies, 2)
    assert pool_log.count("stale") == 1
    assert_drained(pool)


def test_duplicate_reply_does_not_poison_the_next_request(make_pool, pool_log):
    pool = make_pool(3, {2: [{"op": "forward_step", "nth": 1, "action": "duplicate"}]})
    assert_step_replies(pool.fan_out(step, None, 3.0)[1], 3)
    replies = pool.broadcast(clear, 3.0)
    assert [type(r) for r in replies] == [p.KvCacheCleared, p.KvCacheCleared]
    assert pool_log.count("stale ForwardStepOk") == 1
    assert_drained(pool)


@pytest.mark.parametrize("action, logged", [("garbage", "non-protocol line"), ("oversized", "over 4096 bytes")])
def test_bad_lines_are_skipped(make_pool, pool_log, monkeypatch, action, logged):
    monkeypatch.setenv("NEURON_MAX_LINE_BYTES", "4096")
    pool = make_pool(2, {1: [{"op": "forward_step", "action": action}]})
    assert_step_replies(pool.fan_out(step, None, 3.0)[1], 2)
    assert pool_log.count(logged) == 1
    assert_step_replies(pool.fan_out(step, None, 3.0)[1], 2)
    assert pool_log.count(logged) == 2


# ---- failures ----


def test_worker_error_names_rank_and_kind(make_pool):
    pool = make_pool(3, {2: [{"op": "forward_step", "nth": 1, "action": "error", "kind": "forward_failed",
                              "message": "out of memory"}]})
    with pytest.raises(WorkerError) as info:
        pool.fan_out(step, lambda msg: None, 3.0)
    assert (info.value.rank, info.value.kind) == (2, "forward_failed")
    assert "out of memory" in info.value.message
    assert_drained(pool)
    assert_step_replies(pool.fan_out(step, None, 3.0)[1], 3)  # an error reply does not desynchronise


def test_lowest_failing_rank_is_raised(make_pool):
    pool = make_pool(3, {1: [{"op": "forward_step", "action": "error", "kind": "load_failed"}],
                         2: [{"op": "forward_step", "action": "error", "kind": "forward_failed"}]})
    with pytest.raises(WorkerError) as info:
        pool.fan_out(step, None, 3.0)
    assert (info.value.rank, info.value.kind) == (1, "load_failed")
    assert_drained(pool)


def test_crash_mid_operation_is_noticed_at_once(make_pool):
    pool = make_pool(3, {2: [{"op": "forward_step", "action": "crash", "s": 0.1, "code": 7}]})
    exited: list[int] = []
    pool.on_worker_exit(lambda w: exited.append(w.rank))
    deadline = 3.0
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as info:
        pool.fan_out(step, lambda msg: None, deadline)
    assert time.monotonic() - t0 < deadline / 2
    assert (info.value.rank, info.value.kind) == (2, "worker_exited")
    assert "code 7" in info.value.message
    assert exited == [2]
    assert_drained(pool)
    # The exit marked the pool broken: later requests fail at once, naming the rank.
    t0 = time.monotonic()
    with pytest.raises(PoolBroken, match="rank 2 exited"):
        pool.fan_out(step, None, deadline)
    assert time.monotonic() - t0 < 0.1


def test_crash_at_spawn(make_pool):
    with pytest.raises(WorkerError) as info:
        make_pool(3, {1: [{"op": "ping", "action": "crash", "code": 5}]})
    assert (info.value.rank, info.value.kind) == (1, "worker_exited")


@pytest.mark.parametrize("action", ["hang", pytest.param("silence", marks=pytest.mark.slow)])
def test_unanswered_request_times_out(make_pool, pool_log, action):
    pool = make_pool(3, {1: [{"op": "forward_step", "nth": 1, "action": action}]})
    deadline = 1.0
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as info:
        pool.fan_out(step, lambda msg: None, deadline)
    elapsed = time.monotonic() - t0
    assert deadline <= elapsed < deadline + 1.0
    assert (info.value.rank, info.value.kind) == (1, "timeout")
    assert_drained(pool)  # rank 2's reply was consumed although rank 1 used up the deadline
    if action == "silence":  # the worker still serves; nothing stale is left behind
        assert_step_replies(pool.fan_out(step, None, 3.0)[1], 3)
        assert pool_log.count("stale") == 0


@pytest.mark.slow
def test_hang_at_spawn_times_out():
    pool = WorkerPool(2, worker_cmd=mock_cmd({1: [{"op": "ping", "action": "hang"}]}))
    try:
        t0 = time.monotonic()
        with pytest.raises(WorkerError) as info:
            pool.spawn(2.0)
        assert 2.0 <= time.monotonic() - t0 < 3.5
        assert (info.value.rank, info.value.kind) == (1, "timeout")
    finally:
        pool.kill()
    assert pool.broken


# ---- lifecycle ----


@pytest.mark.parametrize("world_size", [2, 3])
def test_shutdown_reaps_every_worker(make_pool, world_size):
    pool = make_pool(world_size)
    procs = [w.proc for w in pool.workers]
    pool.shutdown(grace_s=3.0)
    assert [proc.poll() for proc in procs] == [0] * (world_size - 1)
    assert pool.workers == []
    with pytest.raises(PoolBroken):
        pool.fan_out(step, None, 1.0)


@pytest.mark.slow
def test_shutdown_kills_a_hung_worker_after_grace(make_pool):
    pool = make_pool(3, {2: [{"op": "forward_step", "action": "hang"}]})
    with pytest.raises(WorkerError):
        pool.fan_out(step, None, 0.5)
    procs = [w.proc for w in pool.workers]
    grace = 0.5
    t0 = time.monotonic()
    pool.shutdown(grace_s=grace)
    assert grace <= time.monotonic() - t0 < grace + 2.0
    assert procs[0].poll() == 0
    assert procs[1].poll() is not None and procs[1].poll() < 0  # killed by a signal


def test_kill_reaps_every_worker(make_pool):
    pool = make_pool(3)
    procs = [w.proc for w in pool.workers]
    pool.kill()
    assert all(proc.poll() is not None for proc in procs)
    assert pool.broken


def test_broken_pool_raises_at_once(make_pool, pool_log):
    pool = make_pool(2)
    pool.broken = "rank 1 left a collective"
    called = []
    t0 = time.monotonic()
    with pytest.raises(PoolBroken, match="rank 1 left a collective"):
        pool.fan_out(step, lambda msg: called.append(1), 3.0)
    assert time.monotonic() - t0 < 0.5
    assert called == []
    pool.broken = None  # nothing was sent while broken: the next request meets no stale reply
    assert_step_replies(pool.fan_out(step, None, 3.0)[1], 2)
    assert pool_log.count("stale") == 0


@pytest.mark.slow
def test_watchdog_frees_rank0_stuck_on_a_hung_worker(make_pool):
    """Rank 0 blocked in a collective with a silent peer: at the deadline the peer is killed, which is
    what frees a real all-reduce, and the step fails as a timeout naming that rank."""
    pool = make_pool(3, {2: [{"op": "forward_step", "action": "hang"}]})
    hung = pool.workers[1]

    def stuck_in_collective(msg):
        t_end = time.monotonic() + 20
        while hung.alive() and time.monotonic() < t_end:
            time.sleep(0.01)
        raise RuntimeError("Connection closed by peer")

    deadline = 1.0
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as info:
        pool.fan_out(step, stuck_in_collective, deadline)
    elapsed = time.monotonic() - t0
    assert deadline <= elapsed < deadline + 2.0
    assert (info.value.rank, info.value.kind) == (2, "timeout")
    assert not hung.alive()
    assert pool.workers[0].alive()  # the rank that answered is left for the teardown
    assert pool.broken
