"""Bring a model up across all ranks and run its batched steps.

Every operation is one protocol message: the executor sends it to the workers and hands the same
message to rank 0's Worker in-process, then drains one reply per worker. Start-up: spawn workers
and wait for each `pong` (speaking our protocol version), initialise the communicator, check it
with a sanity all-reduce, then load every rank's shard; each step has a deadline, the
rendezvous included, and a worker that exits during any of them ends the attempt at once. After a
failure that may have left the ranks out of step (a worker gone, a deadline missed, a forward that
raised) the executor refuses further steps until it is rebuilt.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import msgspec
import torch

from neuron.config import from_settings, settings
from neuron.distributed.comm import choose_backend, nccl_unique_id_hex
from neuron.errors import ConfigError, NeuronError, PoolBroken, WorkerError
from neuron.executor import cpu_bind
from neuron.executor.placement import DIAL_IN, Placement, cluster_address, launcher_argv, parse_hosts
from neuron.executor.pool import WorkerPool, default_worker_cmd
from neuron.executor.progress import LoadProgress
from neuron.layers import cpu_attention
from neuron.layers.kernels import Kernels
from neuron.models import text_config
from neuron.models.inputs import StepResult
from neuron.models.memory_plan import HEADROOM, MemoryPlan, available_bytes, check_fits, kv_bytes_per_token, plan
from neuron.rpc import codec
from neuron.rpc import protocol as p
from neuron.rpc.dial_in import Listener, cluster_token
from neuron.step import SeqStep
from neuron.utils import procfs
from neuron.utils.openmp import usable_cpus
from neuron.worker.failure import resolve_dtype, resolve_kv_dtype
from neuron.worker.step_input import blocks_for
from neuron.worker.worker import Worker

log = logging.getLogger("neuron.executor")

# Failures after which ranks may disagree about where they are: the pool must be rebuilt.
_DESYNC_KINDS = {"timeout", "worker_exited", p.ErrorKind.FORWARD_FAILED, p.ErrorKind.INTERNAL}
_STEP_LINE_MARGIN = 1 << 20  # room in a step's protocol line for its tokens beside its images
_JOIN_MARGIN_S = 10.0  # beyond the rendezvous deadline, for gloo to connect its pairs (5 x 1 s at most)
# Errors that say the machine lacks something a start needs for now, not that the start is wrong.
_SHORTAGES = (errno.EMFILE, errno.ENFILE, errno.ENOMEM)


class StartAborted(NeuronError):
    """Bringing the ranks up was given up because the executor is being stopped."""


def resource_shortage(exc: BaseException) -> str | None:
    """What the machine ran out of (descriptors, memory) if that is why `exc`, or an error behind it,
    happened; else None. Such a failure is worth retrying once the resource is back; others are not."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, MemoryError):
            return "memory"
        if isinstance(exc, OSError) and exc.errno in _SHORTAGES:
            return os.strerror(exc.errno)
        text = str(exc)  # errors that crossed the wire or came out of C++ keep only the text
        for name in sorted(map(os.strerror, _SHORTAGES), key=len, reverse=True):  # "... in system" first
            if name in text:
                return name
        exc = exc.__cause__ or exc.__context__
    return None


@dataclass(slots=True)
class ExecutorConfig:
    """What the executor brings up: `shard`, what every rank loads, on `tp` ranks placed as the
    rest says. Derived from the engine's ModelConfig (engine/model_config.py); a field left out
    takes its setting (neuron.config) when the config is built."""

    model_dir: Path
    shard: p.ShardSpec
    tp: int = from_settings("tp")
    hosts: str | None = from_settings("hosts")  # placement.parse_hosts
    worker_launcher: str = from_settings("worker_launcher")
    cluster_address: str | None = from_settings("cluster_address")
    cluster_interface: str | None = from_settings("cluster_interface")
    cluster_port: int = from_settings("cluster_port")
    cpu_all_reduce: str = from_settings("cpu_all_reduce")
    cpu_bind: str = from_settings("cpu_bind")
    device: str = "cpu"  # one device string: the engine resolves the `device` setting's "cuda when present"
    devices: tuple[str, ...] | None = None  # each rank's device, placed by a model host (else from `device`)
    model_id: str = "model"  # the key the ranks hold the model under
    name: str = ""  # what the logs call the model (the engine's served name); the model id where empty
    start_timeout_s: float = from_settings("worker_start_timeout_s")
    collective_timeout_s: float = from_settings("collective_timeout_s")
    load_timeout_s: float = from_settings("load_timeout_s")
    step_timeout_s: float = from_settings("tp_step_timeout_s")


def rank_devices(device: str, tp: int, placement: Placement | None = None) -> list[str]:
    """`cuda` spreads ranks over the visible GPUs (sharing when there are fewer than ranks); a rank
    on another host takes the GPU of its index among that host's ranks."""
    placement = placement or Placement.local(tp)
    if device == "cuda":
        n = max(1, torch.cuda.device_count())
        return [f"cuda:{r % n}" if placement.is_local(r) else f"cuda:{placement.local_index(r)}" for r in range(tp)]
    return [device] * tp


class Executor:
    def __init__(self, cfg: ExecutorConfig, worker_cmd=default_worker_cmd, env: dict | None = None):
        self.cfg = cfg
        self.config = json.loads(cfg.shard.config_json)
        self.placement = parse_hosts(cfg.hosts, cfg.tp)
        self.cluster_address = cluster_address(cfg.cluster_address, cfg.cluster_interface, self.placement)
        self.devices = list(cfg.devices) if cfg.devices else rank_devices(cfg.device, cfg.tp, self.placement)
        self.backend = choose_backend(self.devices, self.placement.hosts, cfg.cpu_all_reduce)
        one_host_cpus = all(d == "cpu" for d in self.devices) and not self.placement.remote
        usable = usable_cpus()  # this process's cores: the binding's, and the count the ranks may share
        self.cpu_bind = cpu_bind.plan(cfg.cpu_bind, cfg.tp, usable) if one_host_cpus and cfg.tp > 1 else []
        self.shard = msgspec.structs.replace(cfg.shard, kv_cache_bytes=self._plan_host_memory())  # before any worker
        self.weight_bytes: list[int] = []  # per rank, as each reported at load; kv_bytes, resident_bytes alike
        self.kv_bytes: list[int] = []
        self.resident_bytes: list[int] = []
        self.failed_kernels: dict[str, str] = {}  # fused kernels on their references, on every rank
        self.num_kv_blocks = 0
        self._worker_cmd, self._env = self._launched(worker_cmd), dict(env or {})
        waits = cpu_bind.worker_env(cfg.tp, usable) if one_host_cpus and cfg.tp > 1 else {}
        # the cores the ranks share where they outnumber them (0: they do not)
        self._env, self._shared_cores = {**waits, **self._env}, len(usable) if waits else 0
        self._listener = None  # ranks that dial in (rpc/dial_in.py): listening while a start awaits them
        if self.placement.remote and cfg.worker_launcher == DIAL_IN:
            s = settings()
            self._listener = Listener(self.cluster_address, cfg.cluster_port,
                                      cluster_token(s.cluster_token, s.cluster_token_file))
        if cfg.cluster_interface:  # NCCL's bootstrap and sockets on the cluster's network
            self._env.setdefault("NCCL_SOCKET_IFNAME", cfg.cluster_interface)
            os.environ.setdefault("NCCL_SOCKET_IFNAME", cfg.cluster_interface)  # rank 0, in this process
        self.on_failure: Callable[[str], None] | None = None
        self._stopping: str | None = None
        self._fresh_ranks()

    def _plan_host_memory(self) -> int:
        """Refuse a model that the CPU ranks on this host cannot hold together (weights, KV cache,
        rotary tables: memory_plan), with the sizes. Returns each rank's KV budget: the one set,
        else room for max_slots full-length sequences, lowered to what the host's memory holds
        when that is less (as a GPU's pool is sized from its free memory), never below one."""
        c, tp = self.cfg.shard, self.cfg.tp
        ranks = sum(1 for r, d in enumerate(self.devices) if d == "cpu" and self.placement.is_local(r))
        if not ranks:
            return c.kv_cache_bytes
        dtype_bytes = torch.finfo(resolve_dtype(c.dtype, "cpu")).bits // 8
        kv_dtype_bytes = torch.finfo(resolve_kv_dtype(c.kv_cache_dtype, c.dtype, "cpu")).bits // 8
        one = blocks_for(c.max_model_len, c.block_size) * c.block_size  # one full-length sequence
        per_token = kv_bytes_per_token(self.config, tp, kv_dtype_bytes)
        wanted = plan(self.config, [Path(f) for f in c.weight_paths], tp=tp, dtype_bytes=dtype_bytes,
                      quantization=c.quantization, max_model_len=c.max_model_len,
                      kv_tokens=c.max_slots * one, kv_cache_bytes=c.kv_cache_bytes,
                      lora=(c.max_loras, c.max_lora_rank), kv_dtype_bytes=kv_dtype_bytes)
        available = available_bytes()
        fix = ("lower --max-model-len or --kv-cache-memory, use fewer ranks on this host, or a smaller (or "
               "quantized) model")
        if c.kv_cache_bytes or available is None or wanted.total * ranks <= available * HEADROOM:
            check_fits(wanted, ranks, available, fix)
            return c.kv_cache_bytes
        least = MemoryPlan(wanted.weights, one * per_token, wanted.tables)
        check_fits(least, ranks, available, fix)
        room = int(available * HEADROOM) // ranks - wanted.weights - wanted.tables
        sequences = room // (one * per_token)
        log.warning("KV cache: this host's memory holds %d sequences of max_model_len %d per rank, not the %d of "
                    "--max-num-seqs; set --kv-cache-memory or lower --max-model-len to choose", sequences,
                    c.max_model_len, c.max_slots)
        return room // (per_token * c.block_size) * per_token * c.block_size

    def _launched(self, worker_cmd: Callable[[int, int, str], list[str]]) -> Callable[[int, int, str], list[str]]:
        """`worker_cmd`, behind the launcher for ranks on other hosts."""
        placement, template = self.placement, self.cfg.worker_launcher
        if not placement.remote:
            return worker_cmd

        def command(rank: int, world_size: int, device: str) -> list[str] | None:
            cmd = worker_cmd(rank, world_size, device)
            if placement.is_local(rank):
                return cmd
            return None if template == DIAL_IN else launcher_argv(template, placement.hosts[rank]) + cmd

        return command

    def _fresh_ranks(self) -> None:
        self.rank0 = Worker(0, self.cfg.tp, self.devices[0])
        self.pool = WorkerPool(self.cfg.tp, self.devices, self._worker_cmd, self._env, self._listener,
                               self.placement.elsewhere)
        self.pool.on_worker_exit(self._worker_lost)

    @property
    def failure(self) -> str | None:
        """Why the ranks can no longer run steps, or None while they can."""
        return self.pool.broken

    @property
    def max_image_bytes(self) -> int:
        """Encoded image bytes one step can carry: images travel to every worker in its line."""
        return codec.max_line_bytes() - _STEP_LINE_MARGIN

    def _worker_lost(self, worker) -> None:
        """From the worker's reader thread, the moment it exits: free rank 0 from joining the group or
        from any collective, and tell whoever listens, without waiting for the next step or its deadline."""
        reason = self.pool.broken or f"rank {worker.rank} exited"
        self.rank0.abort(reason)
        if self.on_failure is not None:
            self.on_failure(reason)

    def abort(self, reason: str) -> None:
        """From any thread, for good (the server stops): end whatever the ranks are doing (a start, a
        rebuild, a step) at once. Workers are killed, not asked to exit; `shutdown` still reaps them."""
        self._stopping = reason
        self.pool.interrupt(reason)
        self.rank0.abort(reason)
        if self._listener is not None:  # a start waiting for ranks to dial in gives up at once
            self._listener.close()

    def _check_stopping(self) -> None:
        if self._stopping is not None:
            raise StartAborted(f"start-up abandoned: {self._stopping}")

    def restart(self) -> None:
        """Kill and reap every worker, free rank 0's model, and bring the model up again."""
        self.pool.kill()
        self.rank0.close()
        self._fresh_ranks()
        self.start()

    def start(self, phases: Callable[[str], None] = lambda what: None) -> "Executor":
        """Spawn the workers, join the ranks' group and load every rank's shard; `phases(what)`
        hears which of these it is doing."""
        t0 = time.perf_counter()
        try:
            self._check_stopping()
            phases(f"starting {self.cfg.tp - 1} worker(s)" if self.cfg.tp > 1 else "starting rank 0")
            self._check_versions(self.pool.spawn(self.cfg.start_timeout_s))
            self._check_stopping()
            phases(f"joining the ranks' {self.backend} group")
            self._init_comm()
            self._check_stopping()
            phases("loading the weights")
            self._load()
        except BaseException:
            self.pool.kill()  # nothing of a failed attempt keeps running or listening
            self.rank0.close()
            raise
        log.info("model `%s` ready on tp=%d (%s) in %.0f ms", self.cfg.name or self.cfg.model_id, self.cfg.tp,
                 self.backend, (time.perf_counter() - t0) * 1000)
        return self

    def _largest_all_reduce(self) -> int:
        """Bytes of the largest tensor a step all-reduces: a step's tokens by the hidden size, in fp32."""
        hidden = int(text_config(self.config).get("hidden_size") or 0)
        tokens = max(self.cfg.shard.max_num_batched_tokens, self.cfg.shard.max_slots)
        return tokens * hidden * 4

    @staticmethod
    def _check_versions(pongs: list[p.Pong]) -> None:
        for pong in pongs:
            if pong.protocol != p.PROTOCOL_VERSION:
                raise ConfigError(
                    f"rank {pong.rank} speaks protocol version {pong.protocol} but this leader speaks "
                    f"{p.PROTOCOL_VERSION}: the worker runs another neuron installation; start both from the same one")

    def _init_comm(self) -> None:
        timeout = self.cfg.collective_timeout_s
        if self.backend in ("gloo", "shm"):
            comm_id = self.rank0.host_store(timeout, self.cluster_address)
        elif self.backend == "nccl":
            comm_id = nccl_unique_id_hex()
        else:
            comm_id = ""
        if self.cpu_bind:
            log.info("model `%s`: CPU ranks bound to cores: %s", self.cfg.name or self.cfg.model_id,
                     cpu_bind.describe(self.cpu_bind))
        if self._shared_cores:
            log.info("model `%s`: %d CPU ranks share %d cores: the worker ranks' threads wait asleep "
                     "(OMP_WAIT_POLICY=passive), a thread per core each", self.cfg.name or self.cfg.model_id,
                     self.cfg.tp, self._shared_cores)
        self._run(lambda seq: p.Init(seq=seq, backend=self.backend, comm_id=comm_id, timeout_s=timeout,
                                     cpu_bind=self.cpu_bind, shm_slot_bytes=self._largest_all_reduce()),
                  timeout + _JOIN_MARGIN_S)
        replies, _ = self._run(lambda seq: p.CommSanityCheck(seq=seq), timeout)
        sums = [r.observed_sum for r in replies]
        if any(abs(s - self.cfg.tp) > 1e-3 for s in sums):
            raise ConfigError(f"communicator sanity check failed: sums {sums}, expected {self.cfg.tp}")

    def _check_kernels(self, config_json: str) -> dict[str, str]:
        """Every rank checks its card's fused kernels; one that fails anywhere runs its reference
        everywhere, so the ranks run the same code."""
        replies, _ = self._run(lambda seq: p.CheckKernels(seq=seq, config_json=config_json, dtype=self.shard.dtype),
                               self.cfg.load_timeout_s)
        failed: dict[str, str] = {}
        for rank, reply in enumerate(replies):
            for piece, why in reply.failed.items():
                failed.setdefault(piece, f"rank {rank}: {why}")
        return failed

    def _load(self) -> None:
        c = self.shard
        # ranks on one GPU split its memory (several ranks share a device only in tests)
        shard = msgspec.structs.replace(c, gpu_memory_utilization=c.gpu_memory_utilization
                                        / max(self.devices.count(d) for d in self.devices))
        self.failed_kernels = self._check_kernels(c.config_json)

        def make(seq: int) -> p.LoadShard:
            return p.LoadShard(seq=seq, model_id=self.cfg.model_id, shard=shard, failed_kernels=self.failed_kernels)

        layers = int(text_config(self.config)["num_hidden_layers"])
        with LoadProgress(f"loading {self.cfg.model_dir.name}", layers) as bar:
            self.rank0.on_layer_loaded = bar.update
            try:
                replies, _ = self._run(make, self.cfg.load_timeout_s)
            finally:
                self.rank0.on_layer_loaded = None
        self.weight_bytes = [r.weight_bytes for r in replies]
        self.kv_bytes = [r.kv_bytes for r in replies]
        self.resident_bytes = [r.resident_bytes for r in replies]
        # Ranks size their pools alone (free memory differs per device); every block id the
        # leader hands out must exist on all of them.
        self.num_kv_blocks = min(r.num_kv_blocks for r in replies)
        log.info("weights per rank%s: %s MiB; KV cache: %d blocks of %d tokens (%d tokens), %s MiB per rank; "
                 "resident per rank: %s MiB", f" ({c.quantization})" if c.quantization else "",
                 _mib(self.weight_bytes), self.num_kv_blocks, c.block_size, self.num_kv_blocks * c.block_size,
                 _mib(self.kv_bytes), _mib(self.resident_bytes))
        if self.num_kv_blocks * c.block_size < c.max_model_len:
            raise ConfigError(
                f"the KV cache holds {self.num_kv_blocks * c.block_size} tokens, fewer than max_model_len "
                f"{c.max_model_len}: give it more memory (--kv-cache-memory, --gpu-memory-utilization) or "
                "lower --max-model-len")

    def memory(self) -> list[dict[str, int]]:
        """Each rank's weight, KV cache and resident bytes. Resident is its process's now (rank 0's is
        this process, with all it holds besides); a rank on another host reports it once loaded."""
        now = {0: procfs.resident_bytes()}
        for w in self.pool.workers:
            if w.rank not in self.pool.remote and w.proc.pid is not None:  # not dialled in
                now[w.rank] = procfs.resident_bytes(w.proc.pid)
        return [{"weight_bytes": weights, "kv_bytes": kv, "resident_bytes": now.get(rank) or at_load}
                for rank, (weights, kv, at_load) in enumerate(zip(self.weight_bytes, self.kv_bytes,
                                                                  self.resident_bytes))]

    def kernels(self) -> dict[str, str]:
        """What runs each fused piece: on CUDA `triton` or `reference: <why>` (the self-check's
        verdict, the same on every rank); on CPU whether the C++ attention kernel could be built."""
        if self.devices[0].startswith("cuda"):
            return Kernels.from_settings(self.failed_kernels).verdict()
        built = cpu_attention.library() is not None
        return {"paged_attention": "cpu" if built else "reference: the CPU kernel could not be built here"}

    def step(self, seqs: list[SeqStep]) -> torch.Tensor:
        """One batched forward on every rank; rank 0's logits of each sequence's last token."""
        return self.run_step(seqs).logits

    def run_step(self, seqs: list[SeqStep]) -> StepResult:
        """One batched forward on every rank; what rank 0 kept (logits and any prompt logprobs)."""
        model_id = self.cfg.model_id
        _, kept = self._run(lambda seq: p.ForwardStep(seq=seq, model_id=model_id, seqs=seqs),
                            self.cfg.step_timeout_s)
        return kept

    def load_lora(self, slot: int, lora_id: int, path: str) -> None:
        """Every rank puts its share of LoRA adapter `lora_id` (from `path`) in pool slot `slot`."""
        model_id = self.cfg.model_id
        self._run(lambda seq: p.LoadLora(seq=seq, model_id=model_id, slot=slot, lora_id=lora_id, path=path),
                  self.cfg.load_timeout_s)

    def forget_lora(self, lora_id: int) -> None:
        """Every rank drops adapter `lora_id` from its pool and its host memory."""
        model_id = self.cfg.model_id
        self._run(lambda seq: p.ForgetLora(seq=seq, model_id=model_id, lora_id=lora_id), self.cfg.step_timeout_s)

    def clear(self, slots: list[int] | None = None) -> None:
        model_id = self.cfg.model_id
        self._run(lambda seq: p.ClearKvCache(seq=seq, model_id=model_id, slots=slots), self.cfg.step_timeout_s)

    def shutdown(self, grace_s: float = 5.0) -> None:
        self.pool.shutdown(grace_s)
        self.rank0.close()
        if self._listener is not None:
            self._listener.close()

    def _run(self, make: Callable[[int], p.Message], deadline_s: float) -> tuple[list[p.Reply], Any]:
        """Fan `make(seq)` out to every rank, rank 0 included; every rank's reply in rank order and
        what rank 0 kept (its logits). Marks the pool broken on failures that desynchronise ranks."""
        try:
            (reply0, kept), replies = self.pool.fan_out(make, self._rank0, deadline_s)
        except WorkerError as exc:
            if exc.kind in _DESYNC_KINDS:
                self.pool.broken = str(exc)
                if self.rank0.comm is not None:
                    self.rank0.comm.abort()
            raise
        except PoolBroken:
            raise
        return [reply0] + replies, kept

    def _rank0(self, msg: p.Message) -> tuple[p.Reply, Any]:
        reply, kept = self.rank0.execute(msg)
        if isinstance(reply, p.Error):
            raise WorkerError(0, reply.kind, reply.message)
        return reply, kept


def _mib(sizes: list[int]) -> str:
    return ", ".join(f"{b / 2**20:.1f}" for b in sizes)
