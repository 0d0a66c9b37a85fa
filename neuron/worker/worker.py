"""One rank's state and the handling of every protocol request. The leader runs rank 0 of this
in-process and hands it the same messages it sends the workers; each worker process runs one of
the other ranks behind its stdin/stdout. The wire is translated into the model's own step input
here, once."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

import torch

from neuron.config import settings
from neuron.distributed.comm import (
    Communicator,
    GlooCommunicator,
    NcclCommunicator,
    Rendezvous,
    SingleRank,
    host_store,
    make_store,
)
from neuron.distributed.nccl_join import NcclJoin
from neuron.errors import ConfigError, UnsupportedModel
from neuron.layers import kernel_choice
from neuron.layers.kernel_check import Widths, self_check
from neuron.layers.paged_attention import HAS_TRITON
from neuron.models import build_model
from neuron.models.inputs import StepResult
from neuron.models.kv_cache import StepRejected, plan_num_blocks
from neuron.models.loader import CheckpointReader
from neuron.rpc import protocol as p
from neuron.step import SeqStep

log = logging.getLogger("neuron.worker")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class WorkerFailure(Exception):
    """A request this rank could not carry out; `kind` is the protocol's error tag."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if dtype not in DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not supported; choose auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def set_cpu_threads(world_size: int) -> None:
    """Ranks on one machine share its cores: give each its part instead of oversubscribing."""
    threads = settings().num_threads
    if threads is not None:
        torch.set_num_threads(threads)
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // world_size))


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
        self.models: dict[str, Any] = {}
        self.on_layer_loaded: Callable[[int, int], None] | None = None  # the leader's progress bar
        # rank 0: the rendezvous it hosts, until the group is built; any rank: the NCCL join under way
        self._joining: Rendezvous | NcclJoin | None = None

    def host_store(self, timeout_s: float) -> str:
        """Rank 0 only: listen for the gloo rendezvous on a free loopback port; returns its address.
        Joining through it may take `timeout_s` and can be cut short by `abort` from then on."""
        store = host_store(self.world_size, timeout_s)
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
                t0 = time.perf_counter()
                logits = self._step(req.model_id, req.seqs)
                return p.ForwardStepOk(seq=seq, elapsed_ms=_ms(t0)), logits
            case p.ForwardStepWithImages():
                t0 = time.perf_counter()
                logits = self._step_with_images(req)
                return p.ForwardStepOk(seq=seq, elapsed_ms=_ms(t0)), logits
            case p.ClearKvCache():
                self._clear(req.model_id, req.slots)
                return p.KvCacheCleared(seq=seq), None
            case p.UnloadModel():
                self._model(req.model_id).release_graphs()
                del self.models[req.model_id]
                return p.Unloaded(seq=seq, model_id=req.model_id), None
            case p.Shutdown():
                return p.Bye(seq=seq), None
        raise WorkerFailure(p.ErrorKind.UNKNOWN_OP, f"unhandled op {type(req).__name__}")

    # ---- operations ----

    def _init(self, req: p.Init) -> None:
        if self.comm is not None and self.world_size > 1:
            self.comm.close()
        backend = req.backend
        try:
            if backend == "single" or self.world_size == 1:
                self.comm = SingleRank()
            elif backend == "gloo":
                joining = self._joining or Rendezvous(make_store(req.comm_id, self.world_size, req.timeout_s),
                                                      req.timeout_s)
                self.comm = GlooCommunicator(self.rank, self.world_size, joining, req.timeout_s)
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
        """Load the shard and allocate the KV block pool, with the kernels every rank can trust."""
        t0 = time.perf_counter()
        comm = self._need_comm()
        kernel_choice.apply(req.failed_kernels)
        try:
            config = json.loads(req.config_json)
            dtype = resolve_dtype(req.dtype, str(self.device))
            model_dir = Path(req.safetensors_paths[0]).parent if req.safetensors_paths else None
            model = build_model(config, comm, dtype, self.device, model_dir)
            with CheckpointReader(req.safetensors_paths) as reader:
                model.load(reader, self.on_layer_loaded)
            num_blocks = self._plan_kv(model, req)
            model.allocate(num_blocks, req.block_size, req.max_slots, req.max_model_len,
                           paged=settings().attention == "paged")
            if self._graphs_wanted(model):
                model.capture_decode_graphs(req.max_slots)
        except UnsupportedModel as exc:
            raise WorkerFailure(p.ErrorKind.UNSUPPORTED_ARCH, str(exc)) from exc
        except (ConfigError, ValueError, OSError) as exc:
            raise WorkerFailure(p.ErrorKind.LOAD_FAILED, str(exc)) from exc
        self.models[req.model_id] = model
        nbytes = model.weight_bytes()
        log.info("loaded %s shard: %.1f MiB in %.0f ms", req.model_id, nbytes / 2**20, _ms(t0))
        return p.LoadShardOk(seq=req.seq, model_id=req.model_id, weight_bytes=nbytes, num_kv_blocks=num_blocks)

    def _graphs_wanted(self, model) -> bool:
        """Decode from CUDA graphs: on CUDA, over the paged cache, with collectives the GPU stream
        runs (one rank, or NCCL), for a model that allows it, unless NEURON_NO_CUDA_GRAPHS."""
        return (self.device.type == "cuda" and not settings().no_cuda_graphs and model.cache.paged
                and model.supports_cuda_graphs and self._need_comm().backend in ("single", "nccl"))

    def _plan_kv(self, model, req: p.LoadShard) -> int:
        if req.block_size < 1:
            raise ConfigError(f"KV block size must be >= 1, got {req.block_size}")
        block_bytes = model.kv_block_bytes(req.block_size)
        reserve = model.activation_bytes(req.max_num_batched_tokens, req.max_slots, req.max_model_len,
                                         paged=settings().attention == "paged")
        num_blocks = plan_num_blocks(block_bytes, req.block_size, max_slots=req.max_slots,
                                     max_model_len=req.max_model_len, kv_cache_bytes=req.kv_cache_bytes,
                                     gpu_memory_utilization=req.gpu_memory_utilization,
                                     activation_reserve=reserve, device=self.device)
        log.info("KV cache: %d blocks of %d tokens, %.1f MiB", num_blocks, req.block_size,
                 num_blocks * block_bytes / 2**20)
        return num_blocks

    def _step(self, model_id: str, seqs: list[SeqStep]) -> StepResult:
        model = self._model(model_id)
        try:
            model.cache.check(seqs, model.config.vocab_size)
        except StepRejected as exc:
            raise WorkerFailure(p.ErrorKind.BAD_REQUEST, str(exc)) from exc
        batch = model.cache.prepare(seqs)
        if any(s.prompt_logprobs is not None for s in seqs):
            batch.prompt_topk = [s.prompt_logprobs for s in seqs]
        try:
            logits = model.forward(batch)
        except Exception as exc:
            raise WorkerFailure(p.ErrorKind.FORWARD_FAILED, f"{type(exc).__name__}: {exc}") from exc
        model.cache.commit(batch)
        return StepResult(logits, batch.prompt_out or {})

    def _step_with_images(self, req: p.ForwardStepWithImages) -> torch.Tensor | None:
        """Prefill sequences whose prompts hold images, walking the same chunks as every rank."""
        model = self._model(req.model_id)
        if getattr(model, "vision", None) is None:
            raise WorkerFailure(p.ErrorKind.UNSUPPORTED_ARCH, f"model {req.model_id!r} has no vision tower")
        try:
            return model.prefill_with_images(req.seqs, req.image_token_id, req.image_data_uris,
                                             req.chunk_size)
        except StepRejected as exc:
            raise WorkerFailure(p.ErrorKind.BAD_REQUEST, str(exc)) from exc
        except Exception as exc:
            raise WorkerFailure(p.ErrorKind.FORWARD_FAILED, f"{type(exc).__name__}: {exc}") from exc

    def _clear(self, model_id: str, slots: list[int] | None) -> None:
        try:
            self._model(model_id).cache.clear(slots)
        except StepRejected as exc:
            raise WorkerFailure(p.ErrorKind.BAD_REQUEST, str(exc)) from exc

    def close(self) -> None:
        """Drop the models and the communicator, and give their device memory back."""
        for model in self.models.values():
            model.release_graphs()
        self.models.clear()
        self._joining = None  # a store hosted for a join that never happened stops listening
        if self.comm is not None:
            self.comm.close()
        release_device_memory(self.device)

    def _need_comm(self) -> Communicator:
        if self.comm is None:
            raise WorkerFailure(p.ErrorKind.NOT_INITIALISED, "communicator not initialised: send init first")
        return self.comm

    def _model(self, model_id: str):
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

    gc.collect()  # layers that reference each other free their tensors only when collected
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # the rank's own device: it was made current when the rank started


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000.0
