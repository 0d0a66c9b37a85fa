"""One rank's state and the handling of every protocol request. The leader runs rank 0 of this
in-process and hands it the same messages it sends the workers; each worker process runs one of
the other ranks behind its stdin/stdout. The rank's communicator lives here; each loaded model
lives in its `ModelRunner`."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any, Callable

import torch

from neuron.config import settings
from neuron.distributed.comm import (
    LOOPBACK,
    Communicator,
    GlooCommunicator,
    NcclCommunicator,
    Rendezvous,
    SingleRank,
    host_store,
    make_store,
)
from neuron.distributed.nccl_join import NcclJoin
from neuron.distributed.net import address_towards, interface_of
from neuron.distributed.shm import ShmCommunicator
from neuron.layers import cpu_ops
from neuron.layers.kernel_check import Widths, self_check
from neuron.layers.paged_attention import HAS_TRITON
from neuron.rpc import protocol as p
from neuron.utils import procfs
from neuron.utils.openmp import WAIT_POLICY, usable_cpus
from neuron.worker.failure import WorkerFailure, resolve_dtype
from neuron.worker.model_runner import ModelRunner

log = logging.getLogger("neuron.worker")


def cpu_threads(world_size: int, cores: int, wait_policy: str | None) -> int:
    """A CPU rank's threads where NEURON_NUM_THREADS does not say: its part of the cores the ranks
    share; where the ranks outnumber the cores, one, or a thread per core if its OpenMP threads wait
    asleep (executor/cpu_bind.py, worker_env): spinning threads of several ranks on each core would
    take the cores from each other."""
    if cores >= world_size:
        return cores // world_size
    return cores if (wait_policy or "").strip().lower() == "passive" else 1


# Where a rank's threads wait asleep beside other ranks', its steps of at most this many rows run on
# one thread (cpu_ops.few_rows_alone): SmolLM2 at tp 3 on two cores gained 3-13 % at one to four
# sequences, was level at eight and sixteen, and lost 4-12 % at 64 (docs/benchmarks.md).
ALONE_ROWS = 8


def set_cpu_threads(world_size: int) -> None:
    """Ranks on one machine share its cores: give each its part (`cpu_threads`)."""
    threads = settings().num_threads
    if threads is None:
        cores = len(usable_cpus())
        threads = cpu_threads(world_size, cores, os.environ.get(WAIT_POLICY))
        if threads > 1 and cores < world_size:  # more ranks than cores, each a thread per core: asleep
            cpu_ops.few_rows_alone(ALONE_ROWS)
    torch.set_num_threads(threads)


class Worker:
    """Rank `rank` of `world_size`. `execute` answers one request and never raises."""

    def __init__(self, rank: int, world_size: int, device: str = "cpu"):
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        elif world_size > 1:
            set_cpu_threads(world_size)
        self.comm: Communicator | None = SingleRank() if world_size == 1 else None
        self.models: dict[str, ModelRunner] = {}  # by model id
        self.on_layer_loaded: Callable[[int, int], None] | None = None  # the leader's progress bar
        # rank 0: the rendezvous it hosts, until the group is built; any rank: the NCCL join under way
        self._joining: Rendezvous | NcclJoin | None = None
        self._cores: list[int] = []  # this CPU rank's cores (executor/cpu_bind.py); empty: not bound
        self._bound_thread: int | None = None
        self._unbound: dict[int, set[int]] = {}  # each thread bound here: its cores before (given back on close)

    def host_store(self, timeout_s: float, address: str = LOOPBACK) -> str:
        """Rank 0 only: listen for the gloo rendezvous on a free port of `address` (loopback on one
        host); returns its address. Joining through it may take `timeout_s` and can be cut short by
        `abort` from then on."""
        store = host_store(self.world_size, timeout_s, address)
        self._joining = Rendezvous(store, timeout_s)
        return f"{store.host}:{store.port}"

    def abort(self, reason: str) -> None:
        """From another thread (a rank died, the server stops): free this rank from joining the group
        or from a collective, whichever it is in. Called on rank 0, which shares the leader's process."""
        joining, comm = self._joining, self.comm
        if joining is not None:
            joining.abort(reason)
        if comm is not None:
            comm.abort()

    # ---- the one entry point ----

    def execute(self, req: p.Request) -> tuple[p.Reply, Any]:
        """The reply to `req` and what stays on this rank (rank 0's logits of a step, else None)."""
        try:
            return self._dispatch(req)
        except WorkerFailure as exc:
            return p.Error(seq=req.seq, kind=exc.kind, message=str(exc)), None
        except Exception as exc:
            log.exception("request %s failed", type(req).__name__)
            return p.Error(seq=req.seq, kind=p.ErrorKind.INTERNAL, message=f"{type(exc).__name__}: {exc}"), None

    def _dispatch(self, req: p.Request) -> tuple[p.Reply, Any]:
        seq = req.seq
        match req:
            case p.Ping():
                return p.Pong(seq=seq, rank=self.rank, world_size=self.world_size, device=str(self.device)), None
            case p.Init():
                self._init(req)
                return p.InitOk(seq=seq, backend=self.comm.backend), None
            case p.CommSanityCheck():
                return p.SanityResult(seq=seq, observed_sum=self._sanity()), None
            case p.CheckKernels():
                return p.KernelsChecked(seq=seq, failed=self._check_kernels(req)), None
            case p.LoadShard():
                return self._load(req), None
            case p.ForwardStep():
                if self._cores and self._bound_thread != threading.get_ident():
                    self._bind()
                t0 = time.perf_counter()
                logits = self._model(req.model_id).step(req.seqs)
                return p.ForwardStepOk(seq=seq, elapsed_ms=_ms(t0)), logits
            case p.LoadLora():
                self._model(req.model_id).load_lora(req.slot, req.lora_id, req.path)
                return p.LoraLoaded(seq=seq), None
            case p.ForgetLora():
                self._model(req.model_id).forget_lora(req.lora_id)
                return p.LoraLoaded(seq=seq), None
            case p.ClearKvCache():
                self._model(req.model_id).clear(req.slots)
                return p.KvCacheCleared(seq=seq), None
            case p.UnloadModel():
                self._model(req.model_id).release()
                del self.models[req.model_id]
                release_device_memory(self.device)
                return p.Unloaded(seq=seq, model_id=req.model_id), None
            case p.Shutdown():
                return p.Bye(seq=seq), None
        raise WorkerFailure(p.ErrorKind.UNKNOWN_OP, f"unhandled op {type(req).__name__}")

    # ---- operations ----

    def _init(self, req: p.Init) -> None:
        if self.comm is not None and self.world_size > 1:
            self.comm.close()
        if self.device.type == "cpu" and len(req.cpu_bind) == self.world_size:
            self._cores, self._bound_thread = req.cpu_bind[self.rank], None
        backend = req.backend
        try:
            if backend == "single" or self.world_size == 1:
                self.comm = SingleRank()
            elif backend in ("gloo", "shm"):
                joining = self._joining or Rendezvous(make_store(req.comm_id, self.world_size, req.timeout_s),
                                                      req.timeout_s)
                address = address_towards(req.comm_id.rpartition(":")[0])
                if address != LOOPBACK:
                    log.info("rank %d: collectives over %s (interface %s)", self.rank, address,
                             interface_of(address) or "unknown")
                self.comm = GlooCommunicator(self.rank, self.world_size, joining, req.timeout_s, address)
                if backend == "shm":  # ranks on one host: all-reduce through a shared segment
                    self.comm = ShmCommunicator.join(self.comm, joining, req.timeout_s, req.shm_slot_bytes)
            elif backend == "nccl":
                self._joining = NcclJoin(
                    lambda: NcclCommunicator(self.rank, self.world_size, req.comm_id, self.device), req.timeout_s)
                self.comm = self._joining.run()
            else:
                raise WorkerFailure(p.ErrorKind.COMM_INIT_FAILED, f"unknown backend {backend!r}")
        except WorkerFailure:
            raise
        except Exception as exc:
            raise WorkerFailure(p.ErrorKind.COMM_INIT_FAILED, f"{backend} init failed: {exc}") from exc
        finally:
            self._joining = None  # the communicator keeps the store alive from here; a failed join drops it

    def _bind(self) -> None:
        """Bind the thread that runs this rank's steps, and the OpenMP threads it starts from now on, to
        the rank's cores; one thread per core unless NEURON_NUM_THREADS says otherwise. Rank 0 runs its
        steps on the leader's engine thread: only that thread is bound, not the HTTP server's."""
        try:
            self._unbound.setdefault(threading.get_ident(), os.sched_getaffinity(0))  # once: not after a rebuild
            os.sched_setaffinity(0, self._cores)  # 0: the calling thread
        except OSError as exc:
            log.warning("rank %d: cannot bind to cores %s (%s); running unbound", self.rank, self._cores, exc)
            self._cores = []
            return
        if settings().num_threads is None:
            torch.set_num_threads(len(self._cores))
        self._bound_thread = threading.get_ident()

    def _sanity(self) -> float:
        """All-reduce a 1 on the rank's device. It is the communicator's first collective, so NCCL
        allocates its buffers here, before the KV pool is sized from what is free."""
        t = torch.ones(1, device=self.device)
        self._need_comm().all_reduce(t)
        return float(t.item())

    def _check_kernels(self, req: p.CheckKernels) -> dict[str, str]:
        """The fused kernels that fail on this rank's card (cached per card; a subprocess checks)."""
        if self.device.type != "cuda" or not HAS_TRITON:
            return {}
        widths = Widths.of(json.loads(req.config_json), self.world_size)
        return self_check(str(self.device), str(resolve_dtype(req.dtype, str(self.device))).removeprefix("torch."),
                          widths)

    def _load(self, req: p.LoadShard) -> p.LoadShardOk:
        """Load the shard into a model runner, with the kernels every rank can trust."""
        t0 = time.perf_counter()
        runner = ModelRunner.load(req.shard, req.failed_kernels, self._need_comm(), self.device,
                                  self.on_layer_loaded)
        self.models[req.model_id] = runner
        nbytes, resident = runner.model.weight_bytes(), procfs.resident_bytes() or 0
        log.info("loaded %s shard: %.1f MiB of weights, %.1f MiB of KV cache, this process %.1f MiB resident, "
                 "in %.0f ms", req.model_id, nbytes / 2**20, runner.kv_bytes / 2**20, resident / 2**20, _ms(t0))
        return p.LoadShardOk(seq=req.seq, model_id=req.model_id, weight_bytes=nbytes, kv_bytes=runner.kv_bytes,
                             resident_bytes=resident, num_kv_blocks=runner.num_blocks)

    def close(self) -> None:
        """Drop the models and the communicator, and give their device memory back."""
        self._drop_models()  # its own frame: no loop variable here keeps a model alive past the release
        self._joining = None  # a store hosted for a join that never happened stops listening
        if self.comm is not None:
            self.comm.close()
        before = self._unbound.pop(threading.get_ident(), None)
        if before is not None:
            os.sched_setaffinity(0, before)  # the offline API's caller gets its thread back as it was
        self._bound_thread = None
        release_device_memory(self.device)

    def _drop_models(self) -> None:
        models, self.models = self.models, {}
        for runner in models.values():
            runner.release()

    def _need_comm(self) -> Communicator:
        if self.comm is None:
            raise WorkerFailure(p.ErrorKind.NOT_INITIALISED, "communicator not initialised: send init first")
        return self.comm

    def _model(self, model_id: str) -> ModelRunner:
        model = self.models.get(model_id)
        if model is None:
            raise WorkerFailure(p.ErrorKind.MODEL_NOT_LOADED, f"model {model_id!r} is not loaded on rank {self.rank}")
        return model


def release_device_memory(device: torch.device) -> None:
    """Return what the caching allocator keeps of freed tensors to the device, so the next model
    in this process (a rebuild, or another `LLM`) and other processes can have it."""
    if device.type != "cuda":
        return
    import gc

    from neuron.worker.cuda_graphs import clear_cublas_workspaces

    gc.collect()  # layers that reference each other free their tensors only when collected
    torch.cuda.synchronize(device)
    clear_cublas_workspaces()  # one per stream the model's steps and captures ran on
    torch.cuda.empty_cache()  # the rank's own device: it was made current when the rank started


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000.0
