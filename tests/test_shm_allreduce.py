"""The shared-memory all-reduce of CPU ranks on one host (neuron/distributed/shm.py), in real
processes joined as neuron's ranks are: sums equal to the sum in rank order, bit for bit, on every
rank; tensors larger than a slot; dtypes it leaves to gloo; a rank that never arrives and an abort
from another rank end the wait; no segment is left under /dev/shm."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time

import pytest
import torch

from neuron.distributed import shm
from neuron.distributed.comm import choose_backend

pytestmark = pytest.mark.skipif(shm.library() is None, reason="the all-reduce kernel cannot be built here")


def _rank(rank: int, world: int, job: str, timeout_s: float, largest: int, queue, results) -> None:
    from neuron.distributed.comm import GlooCommunicator, Rendezvous, host_store, make_store

    torch.set_num_threads(1)
    if rank == 0:
        store = host_store(world, 30.0)
        for _ in range(world - 1):
            queue.put(f"{store.host}:{store.port}")
    else:
        store = make_store(queue.get(timeout=30), world, 30.0)
    rendezvous = Rendezvous(store, 30.0)
    comm = shm.ShmCommunicator.join(GlooCommunicator(rank, world, rendezvous, 30.0), rendezvous, timeout_s, largest)
    try:
        results.put((rank, JOBS[job](comm)))
    except Exception as exc:  # the parent asserts on what each rank saw
        results.put((rank, exc))


def run(world: int, job: str, timeout_s: float = 30.0, largest: int = 0) -> dict:
    ctx = mp.get_context("spawn")
    queue, results = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, job, timeout_s, largest, queue, results)) for r in range(world)]
    for proc in procs:
        proc.start()
    try:
        return dict(results.get(timeout=120) for _ in procs)
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()


SIZES = (1, 7, 1024, 4097, 2 * shm.SLOT_BYTES // 4 + 5)  # the last one goes through in three pieces


def _parts(rank: int, dtype: torch.dtype, n: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(1000 * n + rank)).to(dtype)


def _tensor(data: bytes, dtype: torch.dtype) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype)


def _sums(comm) -> dict:
    out = {"backend": comm.backend}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for n in SIZES if dtype is not torch.float16 else (1024,):
            x = _parts(comm.rank, dtype, n)
            comm.all_reduce(x)
            out[str(dtype), n] = x.view(torch.uint8).numpy().tobytes()  # a tensor would cross as a shared fd
    # rank 0 unlinked the name before its first sum, which every rank has waited for by now; its name
    # carries rank 0's pid (other test processes may hold segments of their own meanwhile)
    pids = torch.zeros(comm.world_size, dtype=torch.int64)
    pids[comm.rank] = os.getpid()
    comm.all_reduce(pids)
    out["segments"] = sorted(p.name for p in shm.SHM_DIR.glob(f"{shm.PREFIX}{int(pids[0])}-*"))
    return out


def _how_rank0s_wait_ends(comm) -> object:
    """Rank 0 waits in an all-reduce that rank 1 does not join; what ended the wait, and after how long."""
    t0 = time.monotonic()
    try:
        comm.all_reduce(torch.ones(16))
    except shm.CommFailure as exc:
        return str(exc), time.monotonic() - t0
    return "summed"


def _late(comm) -> object:
    if comm.rank == 1:
        time.sleep(3.0)  # never joins rank 0's call in time
        return "slept"
    return _how_rank0s_wait_ends(comm)


def _aborted_by_another_rank(comm) -> object:
    if comm.rank == 1:
        time.sleep(0.5)
        comm.abort()  # as a rank does when it is torn down: frees every rank's wait
        return "aborted"
    return _how_rank0s_wait_ends(comm)


def _aborted_by_another_thread(comm) -> object:
    if comm.rank == 1:
        time.sleep(2.0)
        return "idle"
    threading.Timer(0.3, comm.abort).start()  # the leader's reader thread, when a worker exits
    return _how_rank0s_wait_ends(comm)


GATHERS = [(torch.float32, (1, 4000)), (torch.float32, (3, 1000)), (torch.int64, (5,)),
           (torch.bfloat16, (2, 3 * 2**15 + 7)), (torch.float32, (shm.SLOT_BYTES // 4 + 9,))]


def _gathers(comm) -> dict:
    """Gathers back to back (the other ranks do not wait in a gather, so they run ahead of a slow
    rank 0, which must still read every part whole) and between all-reduces."""
    out = {"backend": comm.backend}
    for i, (dtype, shape) in enumerate(GATHERS * 2):
        if comm.rank == 0 and i % 3 == 0:
            time.sleep(0.05)
        if i == len(GATHERS):
            summed = torch.ones(100)
            comm.all_reduce(summed)
            out["sum"] = summed[0].item()
        part = _parts(comm.rank, torch.float32, int(torch.Size(shape).numel())).mul(1000).to(dtype).view(shape)
        parts = comm.gather_to_rank0(part)
        out[i] = None if parts is None else [t.contiguous().view(torch.uint8).numpy().tobytes() for t in parts]
    return out


JOBS = {"sums": _sums, "gathers": _gathers, "late": _late, "aborted_by_another_rank": _aborted_by_another_rank,
        "aborted_by_another_thread": _aborted_by_another_thread}


@pytest.mark.parametrize("world, largest", [(2, 0), (3, 0), (2, 100)], ids=["2", "3", "2-small-slots"])
def test_every_rank_gets_the_sum_in_rank_order_bit_for_bit(world, largest):
    got = run(world, "sums", largest=largest)  # small slots: the larger sizes go through in many pieces
    assert all(got[r]["backend"] == "shm" for r in range(world))
    for r in range(world):
        assert got[r]["segments"] == [], "rank 0 unlinks the segment once every rank has mapped it"
    for n in SIZES:
        parts = [_parts(r, torch.float32, n) for r in range(world)]
        expected = parts[0] + parts[1]
        for part in parts[2:]:
            expected = expected + part
        wide = [_parts(r, torch.bfloat16, n).float() for r in range(world)]
        expected_bf16 = sum(wide[1:], wide[0]).to(torch.bfloat16)  # summed in fp32, rounded once
        for r in range(world):
            assert torch.equal(_tensor(got[r][str(torch.float32), n], torch.float32), expected), (r, n)
            assert torch.equal(_tensor(got[r][str(torch.bfloat16), n], torch.bfloat16), expected_bf16), (r, n)
    half = sum(_parts(r, torch.float16, 1024).float() for r in range(world))
    for r in range(world):  # what the segment does not take goes through gloo
        summed = _tensor(got[r][str(torch.float16), 1024], torch.float16).float()
        torch.testing.assert_close(summed, half, atol=5e-3, rtol=5e-3)


@pytest.mark.parametrize("world, largest", [(2, 0), (3, 100)], ids=["2", "3-small-slots"])
def test_rank_0_gathers_every_rank_s_part_through_the_segment(world, largest):
    got = run(world, "gathers", largest=largest)
    assert all(got[r]["backend"] == "shm" for r in range(world))
    assert all(got[r]["sum"] == world for r in range(world))
    for i, (dtype, shape) in enumerate(GATHERS * 2):
        expected = [_parts(r, torch.float32, int(torch.Size(shape).numel())).mul(1000).to(dtype).view(shape)
                    for r in range(world)]
        assert all(got[r][i] is None for r in range(1, world))
        parts = [_tensor(b, dtype).view(shape) for b in got[0][i]]
        assert len(parts) == world
        for r in range(world):
            assert torch.equal(parts[r], expected[r]), (i, r)


def test_a_rank_that_does_not_arrive_ends_the_wait_at_the_deadline():
    got = run(2, "late", timeout_s=1.0)
    message, waited = got[0]
    assert "timed out after 1 s" in message
    assert 0.9 < waited < 2.5


@pytest.mark.parametrize("job", ["aborted_by_another_rank", "aborted_by_another_thread"])
def test_an_abort_ends_the_wait_at_once(job):
    got = run(2, job)
    message, waited = got[0]
    assert "aborted" in message
    assert waited < 1.5


def test_a_slot_holds_a_step_s_largest_all_reduce_within_bounds():
    assert shm.slot_bytes(2048 * 1024 * 4) == shm.SLOT_BYTES
    assert shm.slot_bytes(10**9) == shm.SLOT_BYTES  # larger tensors go in pieces
    assert shm.slot_bytes(512 * 64 * 4 + 1) == 512 * 64 * 4 + 4096
    assert shm.slot_bytes(100) == shm.MIN_SLOT_BYTES
    assert shm.slot_bytes(0) == shm.SLOT_BYTES


def test_segments_of_leaders_that_are_gone_are_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(shm, "SHM_DIR", tmp_path)
    dead = 2**22 + 17  # above the default pid_max of 4194304: no such process
    (tmp_path / f"{shm.PREFIX}{dead}-00ff").write_bytes(b"")
    (tmp_path / f"{shm.PREFIX}{os.getpid()}-00ff").write_bytes(b"")
    (tmp_path / "someone-else").write_bytes(b"")
    assert shm.remove_stale_segments() == [f"{shm.PREFIX}{dead}-00ff"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{shm.PREFIX}{os.getpid()}-00ff", "someone-else"]


def test_ranks_on_one_hosts_cpus_use_the_segment_unless_told_otherwise():
    assert choose_backend(["cpu", "cpu"]) == "shm"
    assert choose_backend(["cpu"] * 4, ("a", "a", "a", "a")) == "shm"
    assert choose_backend(["cpu", "cpu"], cpu_all_reduce="gloo") == "gloo"
    assert choose_backend(["cpu", "cpu"], ("a", "b")) == "gloo"  # other hosts: their own /dev/shm

