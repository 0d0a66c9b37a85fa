"""A rank's model runner: the model, its KV cache, and turning a step into a forward on this rank.

The worker owns one per loaded model. Loading builds the model and reads this rank's slices, sizes
the KV pool from what the device has left, allocates it and captures the decode graphs. The runner
keeps each slot's block table (`BlockTables`): a step is checked against them and against the
model's own per-slot state (every rank refuses a bad one alike, before any collective), turned
into the batch's tensors, run and committed. Rank 0's runner keeps the logits the leader samples
from.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

import torch

from neuron.config import settings
from neuron.distributed.comm import Communicator
from neuron.errors import ConfigError, UnsupportedModel
from neuron.layers import cpu_attention, cpu_ops
from neuron.models import build_model
from neuron.models.inputs import StepResult
from neuron.models.kv_cache import plan_num_blocks
from neuron.models.loader import open_checkpoint
from neuron.models.step_input import BlockTables, StepRejected
from neuron.multimodal.image import VisionSpec
from neuron.rpc import protocol as p
from neuron.step import SeqStep
from neuron.worker.failure import WorkerFailure, resolve_dtype

log = logging.getLogger("neuron.worker")


class ModelRunner:
    def __init__(self, model, num_blocks: int, tables: BlockTables):
        self.model = model
        self.num_blocks = num_blocks
        self.tables = tables

    @classmethod
    def load(cls, shard: p.ShardSpec, comm: Communicator, device: torch.device,
             on_layer_loaded: Callable[[int, int], None] | None = None) -> ModelRunner:
        """Build the model, read this rank's slices, size and allocate the KV pool, capture graphs."""
        try:
            dtype = resolve_dtype(shard.dtype, str(device))
            config = json.loads(shard.config_json)
            vision = VisionSpec.from_wire(shard.vision) if shard.vision is not None else None
            model = build_model(config, comm, dtype, device, vision)
            with open_checkpoint(shard.weight_paths, config, shard.quantization, shard.stored_format) as reader:
                model.load(reader, on_layer_loaded)
            if device.type == "cpu":
                _load_cpu_kernels()
            num_blocks = _plan_kv(model, shard, device)
            paged = settings().attention == "paged"
            model.allocate(num_blocks, shard.block_size, shard.max_slots, shard.max_model_len, paged=paged)
            tables = BlockTables(shard.max_slots, num_blocks, shard.block_size, shard.max_model_len, device, paged)
            if _graphs_wanted(model, device, comm):
                model.capture_decode_graphs(shard.max_slots, shard.verify)
        except UnsupportedModel as exc:
            raise WorkerFailure(p.ErrorKind.UNSUPPORTED_ARCH, str(exc)) from exc
        except (ConfigError, ValueError, OSError) as exc:
            raise WorkerFailure(p.ErrorKind.LOAD_FAILED, str(exc)) from exc
        return cls(model, num_blocks, tables)

    def step(self, seqs: list[SeqStep]) -> StepResult:
        """One batched forward; what this rank keeps of it (rank 0: logits and prompt logprobs)."""
        model, tables = self.model, self.tables
        try:
            tables.check(seqs, model.config.vocab_size)
            model.cache.check(seqs, model.config.vocab_size)
        except StepRejected as exc:
            raise WorkerFailure(p.ErrorKind.BAD_REQUEST, str(exc)) from exc
        batch = tables.prepare(seqs)
        model.cache.begin(seqs)
        if any(s.prompt_logprobs is not None for s in seqs):
            batch.prompt_topk = [s.prompt_logprobs for s in seqs]
        try:
            logits = model.forward(batch)
        except Exception as exc:
            raise WorkerFailure(p.ErrorKind.FORWARD_FAILED, f"{type(exc).__name__}: {exc}") from exc
        tables.commit(batch)
        model.cache.commit(batch)
        return StepResult(logits, batch.prompt_out or {})

    def step_with_images(self, req: p.ForwardStepWithImages) -> torch.Tensor | None:
        """Prefill sequences whose prompts hold images, walking the same chunks as every rank."""
        if getattr(self.model, "vision", None) is None:
            raise WorkerFailure(p.ErrorKind.UNSUPPORTED_ARCH, f"model {req.model_id!r} has no vision tower")
        try:
            return self.model.prefill_with_images(self.tables, req.seqs, req.image_token_id, req.image_data_uris,
                                                  req.chunk_size)
        except StepRejected as exc:
            raise WorkerFailure(p.ErrorKind.BAD_REQUEST, str(exc)) from exc
        except Exception as exc:
            raise WorkerFailure(p.ErrorKind.FORWARD_FAILED, f"{type(exc).__name__}: {exc}") from exc

    def clear(self, slots: list[int] | None) -> None:
        try:
            self.tables.clear(slots)
            self.model.cache.clear(slots)
        except StepRejected as exc:
            raise WorkerFailure(p.ErrorKind.BAD_REQUEST, str(exc)) from exc

    def release(self) -> None:
        """Free the captured graphs (and their memory pool) now."""
        self.model.release_graphs()


def _load_cpu_kernels() -> None:
    """Build (on a machine's first run, or with a fresh NEURON_CACHE_DIR: seconds) and load the CPU
    kernels now, while the shard loads, rather than inside the first step, which the step deadline
    bounds."""
    cpu_attention.library()
    cpu_ops.library()


def _graphs_wanted(model, device: torch.device, comm: Communicator) -> bool:
    """Decode from CUDA graphs: on CUDA, over the paged cache, with collectives the GPU stream
    runs (one rank, or NCCL), for a model that allows it, unless NEURON_NO_CUDA_GRAPHS."""
    return (device.type == "cuda" and not settings().no_cuda_graphs and model.supports_cuda_graphs
            and model.cache.paged and comm.backend in ("single", "nccl"))


def _plan_kv(model, req: p.ShardSpec, device: torch.device) -> int:
    if req.block_size < 1:
        raise ConfigError(f"KV block size must be >= 1, got {req.block_size}")
    block_bytes = model.kv_block_bytes(req.block_size)
    reserve = model.activation_bytes(req.max_num_batched_tokens, req.max_slots, req.max_model_len,
                                     paged=settings().attention == "paged")
    num_blocks = plan_num_blocks(block_bytes, req.block_size, max_slots=req.max_slots,
                                 max_model_len=req.max_model_len, kv_cache_bytes=req.kv_cache_bytes,
                                 gpu_memory_utilization=req.gpu_memory_utilization,
                                 activation_reserve=reserve, device=device)
    log.info("KV cache: %d blocks of %d tokens, %.1f MiB", num_blocks, req.block_size,
             num_blocks * block_bytes / 2**20)
    return num_blocks
