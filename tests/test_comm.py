"""Backend choice and the NCCL unique id's trip from the leader to every rank, without a GPU:
CuPy is faked."""

from __future__ import annotations

import logging
import re
import sys
import types

import pytest
import torch

from neuron.distributed import comm
from neuron.distributed.comm import CommError, NcclCommunicator, choose_backend, encode_unique_id

# Both halves of the byte range and NULs, so sign handling and truncation would both show.
ORIGINAL_ID = bytes((37 * i + 56) % 256 for i in range(128))
SIGNED_ID = tuple(b - 256 if b > 127 else b for b in ORIGINAL_ID)
UNSIGNED_ID = tuple(ORIGINAL_ID)

# What get_unique_id returns and what NcclCommunicator takes, per CuPy generation (and C char).
GENERATIONS = {
    "cupy14": ("14.2.0", ORIGINAL_ID),
    "cupy13-x86": ("13.6.0", SIGNED_ID),
    "cupy13-arm": ("13.6.0", UNSIGNED_ID),
}


def fake_nccl_communicator(expected):
    """A NcclCommunicator that converts its id argument as that CuPy's Cython signature does."""

    class FakeNcclCommunicator:
        made: list = []

        def __init__(self, ndev: int, comm_id, rank: int):
            if type(comm_id) is not type(expected):
                raise TypeError(f"Argument 'commId' has incorrect type (expected "
                                f"{type(expected).__name__}, got {type(comm_id).__name__})")
            low, high = (-128, 127) if expected == SIGNED_ID else (0, 255)
            if isinstance(comm_id, tuple) and not all(low <= v <= high for v in comm_id):
                raise OverflowError("value too large to convert to char")
            assert len(comm_id) == 128
            self.ndev, self.comm_id, self.rank = ndev, comm_id, rank
            self.calls: list[str] = []
            FakeNcclCommunicator.made.append(self)

        def destroy(self):  # as ncclCommDestroy does when a peer died: never returns
            self.calls.append("destroy")
            raise AssertionError("ncclCommDestroy waits for every peer")

        def abort(self):
            self.calls.append("abort")

    return FakeNcclCommunicator


def install_fake_cupy(monkeypatch, generation: str = "cupy14", *, cupy_cuda: int = 12, torch_cuda: str = "12.8",
                      nccl_available: bool = True, gpus: int = 4):
    version, raw_id = GENERATIONS[generation]
    nccl = types.ModuleType("cupy.cuda.nccl")
    nccl.available = nccl_available
    nccl.get_unique_id = lambda: raw_id
    nccl.NcclCommunicator = fake_nccl_communicator(raw_id)
    runtime = types.ModuleType("cupy.cuda.runtime")
    runtime.runtimeGetVersion = lambda: cupy_cuda * 1000 + 80
    cuda = types.ModuleType("cupy.cuda")
    cuda.nccl, cuda.runtime = nccl, runtime
    cuda.Device = lambda index: types.SimpleNamespace(use=lambda: None)
    cupy = types.ModuleType("cupy")
    cupy.cuda, cupy.__version__ = cuda, version
    for name, module in [("cupy", cupy), ("cupy.cuda", cuda), ("cupy.cuda.nccl", nccl),
                         ("cupy.cuda.runtime", runtime)]:
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(torch.version, "cuda", torch_cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    return nccl


@pytest.fixture
def comm_warnings() -> list[logging.LogRecord]:
    """Warnings from neuron.comm, whether or not the neuron logger propagates to the root."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("neuron.comm")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


# ---- the unique id ----


@pytest.mark.parametrize("generation", list(GENERATIONS))
def test_every_rank_gets_the_leaders_id_in_its_cupys_form(monkeypatch, generation):
    nccl = install_fake_cupy(monkeypatch, generation)
    leader_hex = comm.nccl_unique_id_hex()
    assert leader_hex == ORIGINAL_ID.hex()
    for rank in range(4):
        NcclCommunicator(rank, 4, leader_hex, torch.device(f"cuda:{rank}"))
    made = nccl.NcclCommunicator.made
    assert [(c.ndev, c.rank) for c in made] == [(4, 0), (4, 1), (4, 2), (4, 3)]
    assert all(c.comm_id == GENERATIONS[generation][1] for c in made)
    assert all(bytes(b & 0xFF for b in c.comm_id) == ORIGINAL_ID for c in made)


def test_signed_and_unsigned_chars_encode_to_the_same_hex():
    assert encode_unique_id(SIGNED_ID) == encode_unique_id(UNSIGNED_ID) == encode_unique_id(ORIGINAL_ID)
    assert encode_unique_id(bytearray(ORIGINAL_ID)) == ORIGINAL_ID.hex()


@pytest.mark.parametrize("raw, message", [
    (ORIGINAL_ID[:127], "127 bytes, not 128"),
    ((300,) * 128, "not bytes"),
    (("a",) * 128, "not bytes"),
])
def test_a_malformed_id_from_cupy_is_refused(raw, message):
    with pytest.raises(CommError, match=message):
        encode_unique_id(raw)


@pytest.mark.parametrize("bad_hex", [
    "",
    ORIGINAL_ID.hex()[:-2],
    ORIGINAL_ID.hex() + "00",
    "zz" * 128,
    " " + ORIGINAL_ID.hex()[1:],
    None,
])
def test_a_malformed_hex_id_is_refused_before_nccl_is_called(monkeypatch, bad_hex):
    nccl = install_fake_cupy(monkeypatch)
    with pytest.raises(CommError, match="must be 256 hex characters"):
        NcclCommunicator(1, 2, bad_hex, torch.device("cuda:1"))
    assert nccl.NcclCommunicator.made == []


def test_unknown_form_is_a_programming_error():
    with pytest.raises(ValueError, match="unknown unique id form 'int'"):
        comm.decode_unique_id(ORIGINAL_ID.hex(), "int")


# ---- NCCL init failures name their cause ----


def test_cupy_built_for_another_cuda_than_torch_is_refused(monkeypatch):
    nccl = install_fake_cupy(monkeypatch, cupy_cuda=12, torch_cuda="13.0")
    with pytest.raises(CommError, match=r"rank 1: CuPy 14.2.0 is built for CUDA 12 but torch .* for CUDA 13.0; "
                                        r"uninstall cupy-cuda12x and install the matching extra: "
                                        r'pip install -e "\.\[cuda13\]"'):
        NcclCommunicator(1, 2, ORIGINAL_ID.hex(), torch.device("cuda:1"))
    assert nccl.NcclCommunicator.made == []


def test_a_device_this_process_cannot_see_is_refused(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    install_fake_cupy(monkeypatch, gpus=2)
    with pytest.raises(CommError, match=r"cuda:2 is not one of the 2 GPUs .*CUDA_VISIBLE_DEVICES='0,1'"):
        NcclCommunicator(2, 3, ORIGINAL_ID.hex(), torch.device("cuda:2"))


def test_an_nccl_error_at_init_names_rank_and_devices(monkeypatch):
    nccl = install_fake_cupy(monkeypatch)

    def refuse(ndev, comm_id, rank):
        raise RuntimeError("NCCL_ERROR_INVALID_USAGE: invalid usage")

    nccl.NcclCommunicator = refuse
    with pytest.raises(CommError, match=r"ncclCommInitRank failed on rank 1 of 2 \(cuda:1, 4 GPUs visible\): "
                                        r"NCCL_ERROR_INVALID_USAGE"):
        NcclCommunicator(1, 2, ORIGINAL_ID.hex(), torch.device("cuda:1"))


# ---- choose_backend ----


@pytest.mark.parametrize("devices, backend", [
    (["cpu"], "single"),
    (["cuda:0"], "single"),
    (["cpu", "cpu"], "shm"),  # one host: the shared-memory all-reduce (distributed/shm.py)
    (["cuda:0", "cuda:0"], "gloo"),  # NCCL refuses two ranks on one GPU
    (["cuda:0", "cpu"], "gloo"),
    (["cuda:0", "cuda:1"], "nccl"),
])
def test_backend_follows_the_devices(monkeypatch, comm_warnings, devices, backend):
    install_fake_cupy(monkeypatch)
    assert choose_backend(devices) == backend
    assert comm_warnings == []


@pytest.mark.parametrize("setup, reason", [
    (dict(cupy_missing=True), r"CuPy is not importable .*install the matching extra: pip install -e \"\.\[cuda12\]\""),
    (dict(nccl_available=False), r"CuPy 14\.2\.0 found no NCCL library; install the matching extra"),
    (dict(cupy_cuda=13), r"CuPy 14\.2\.0 is built for CUDA 13 but torch .* for CUDA 12\.8; uninstall cupy-cuda13x"),
    (dict(torch_cuda=None), r"torch .* is a CPU build"),
])
def test_gpus_without_a_fitting_nccl_fall_back_to_gloo_and_say_why(monkeypatch, comm_warnings, setup, reason):
    setup = dict(setup)
    cupy_missing = setup.pop("cupy_missing", False)
    install_fake_cupy(monkeypatch, **setup)
    if cupy_missing:
        monkeypatch.setitem(sys.modules, "cupy", None)
    assert choose_backend(["cuda:0", "cuda:1"]) == "gloo"
    [record] = comm_warnings
    assert record.levelno == logging.WARNING
    assert record.getMessage().startswith("2 ranks on their own GPUs use gloo, slower than nccl, because ")
    assert re.search(reason, record.getMessage()), record.getMessage()


# ---- joining the NCCL group has a deadline and a way out ----


class BlockingNccl:
    """Stands in for NcclCommunicator: its construction blocks like ncclCommInitRank waiting for a
    rank that never comes, until `release` is set; then it records whether it was closed."""

    release = None
    made: list = []

    def __init__(self, rank, world_size, unique_id_hex, device):
        self.closed = False
        BlockingNccl.release.wait(10)
        BlockingNccl.made.append(self)

    def close(self):
        self.closed = True


@pytest.fixture
def stuck_nccl(monkeypatch):
    import threading

    from neuron.worker import worker as worker_mod

    BlockingNccl.release, BlockingNccl.made = threading.Event(), []
    monkeypatch.setattr(worker_mod, "NcclCommunicator", BlockingNccl)
    yield worker_mod.Worker(0, 2, "cpu")
    BlockingNccl.release.set()


def _init(timeout_s: float):
    from neuron.rpc import protocol as p

    return p.Init(seq=1, backend="nccl", comm_id="ab" * 128, timeout_s=timeout_s)


def test_an_nccl_join_that_never_completes_ends_at_its_deadline(stuck_nccl):
    import time

    t0 = time.monotonic()
    reply, _ = stuck_nccl.execute(_init(0.3))
    assert reply.kind == "comm_init_failed"
    assert "ranks did not all join the NCCL group within 0.3 s" in reply.message
    assert time.monotonic() - t0 < 2.0 and stuck_nccl.comm is None
    BlockingNccl.release.set()  # NCCL returns after all: the abandoned communicator is destroyed
    deadline = time.monotonic() + 5
    while not BlockingNccl.made and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    assert [c.closed for c in BlockingNccl.made] == [True]


def test_an_nccl_join_is_abandoned_as_soon_as_a_rank_dies(stuck_nccl):
    import threading
    import time

    threading.Timer(0.2, stuck_nccl.abort, args=("rank 1 exited (code -9)",)).start()
    t0 = time.monotonic()
    reply, _ = stuck_nccl.execute(_init(60.0))
    assert reply.kind == "comm_init_failed"
    assert "joining the NCCL group was aborted: rank 1 exited (code -9)" in reply.message
    assert time.monotonic() - t0 < 2.0


def test_closing_aborts_rather_than_destroying_so_a_dead_peer_cannot_block_it(monkeypatch):
    nccl = install_fake_cupy(monkeypatch)
    NcclCommunicator(1, 2, comm.nccl_unique_id_hex(), torch.device("cuda:1")).close()
    assert nccl.NcclCommunicator.made[-1].calls == ["abort"]
