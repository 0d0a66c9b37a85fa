"""A rank's model runner: the model, its KV cache, and turning a step into a forward on this rank.

The worker owns one per loaded model. Loading builds the model and reads this rank's slices, sizes
the KV pool from what the device has left (kv_pool.py), allocates it and captures the decode
graphs (cuda_graphs.py). The runner keeps each slot's block table (`BlockTables`, step_input.py):
a step is checked against them and against the model's own per-slot state (every rank refuses a
bad one alike, before any collective), turned into the batch's tensors, run (replayed from a
graph where one fits, else the model's forward) and committed. Rank 0's runner keeps the logits
the leader samples from.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from neuron.config import settings
from neuron.distributed.comm import Communicator
from neuron.errors import ConfigError, UnsupportedModel
from neuron.layers import cpu_attention, cpu_decoder, cpu_ops
from neuron.layers.kernels import Kernels
from neuron.layers.lora import LoraRows
from neuron.models import build_model, text_config
from neuron.models.inputs import StepBatch, StepRejected, StepResult
from neuron.models.loader import CheckpointReader, open_checkpoint
from neuron.models.lora import PeftAdapter
from neuron.multimodal.image import VisionSpec
from neuron.rpc import protocol as p
from neuron.step import SeqStep, VerifyShape
from neuron.utils.lru import SizedLRU
from neuron.utils.native_memory import release_free_heap
from neuron.worker.cuda_graphs import DecodeGraphs, capture_decode_graphs
from neuron.worker.failure import WorkerFailure, resolve_dtype, resolve_kv_dtype
from neuron.worker.kv_pool import plan_kv_pool
from neuron.worker.step_input import BlockTables

log = logging.getLogger("neuron.worker")


def _share_bytes(share: list) -> int:
    """The bytes of an adapter's share (lora_share's tensors) in host memory."""
    return sum(t.nbytes for entry in share for t in entry if isinstance(t, torch.Tensor))


class ModelRunner:
    def __init__(self, model, num_blocks: int, tables: BlockTables):
        self.model = model
        self.kernels: Kernels = model.kernels  # what its layers run, chosen at load
        self.num_blocks = num_blocks
        self.kv_bytes = num_blocks * model.kv_block_bytes(tables.block_size)
        self.tables = tables
        self.graphs: DecodeGraphs | None = None  # decode steps, once captured
        self.verify_graphs: DecodeGraphs | None = None  # speculative decoding's verifying steps, captured apart
        # LoRA: each adapter's share of this rank kept in host memory by the leader's id for it (those
        # beyond the pool wait here to be swapped in), and which id each pool slot holds
        # (at most lora_host_bytes, least recently used out: one forgotten is read again from its folder)
        self.lora_host: SizedLRU[int, list] = SizedLRU(settings().lora_host_bytes)
        self.lora_in_slot: dict[int, int] = {}
        self.lora_base: tuple[dict, int] = ({}, 0)  # what an adapter is checked against: the config, the pool's rank

    @classmethod
    def load(cls, shard: p.ShardSpec, failed_kernels: dict[str, str], comm: Communicator, device: torch.device,
             on_layer_loaded: Callable[[int, int], None] | None = None) -> ModelRunner:
        """Build the model with the kernels the settings and the ranks' self-check leave it (every
        piece in `failed_kernels` on its reference), read this rank's slices, size and allocate the
        KV pool, capture graphs."""
        # what this process held on the device before (another model a host serves): not this model's
        held_before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        cpu_kernels = _CpuKernels() if device.type == "cpu" else None
        try:
            dtype = resolve_dtype(shard.dtype, str(device))
            config = json.loads(shard.config_json)
            kernels = Kernels.from_settings(failed_kernels)
            kernels.log_failures()
            vision = VisionSpec.from_wire(shard.vision) if shard.vision is not None else None
            model = build_model(config, comm, dtype, device, kernels, vision)
            model.kv_dtype = resolve_kv_dtype(shard.kv_cache_dtype, shard.dtype, str(device))
            with open_checkpoint(shard.weight_paths, config, shard.quantization, shard.stored_format) as reader:
                model.load(reader, on_layer_loaded)
            if shard.max_loras:
                if not hasattr(model, "enable_lora"):
                    raise ConfigError(f"LoRA adapters are not supported for model_type {config.get('model_type')!r}")
                model.enable_lora(shard.max_loras, shard.max_lora_rank)
            if cpu_kernels is not None:
                cpu_kernels.wait()
                # the weights as read, which the layers copied into panels, went back to the C heap's
                # free lists: give those pages back, or the rank holds up to a second copy's worth
                release_free_heap()
            num_blocks = plan_kv_pool(model, shard, device, held_before, comm.rank)
            model.allocate(num_blocks, shard.block_size, shard.max_slots, shard.max_model_len)
            runner = cls(model, num_blocks, BlockTables(shard.max_slots, num_blocks, shard.block_size,
                                                         shard.max_model_len, device, kernels.paged))
            runner.lora_base = (text_config(config), shard.max_lora_rank)
            if _graphs_wanted(model, device, comm):
                runner.capture_graphs(shard.max_slots, shard.verify)
        except UnsupportedModel as exc:
            raise WorkerFailure(p.ErrorKind.UNSUPPORTED_ARCH, str(exc)) from exc
        except (ConfigError, ValueError, OSError) as exc:
            raise WorkerFailure(p.ErrorKind.LOAD_FAILED, str(exc)) from exc
        finally:
            if cpu_kernels is not None:
                cpu_kernels.close()
        return runner

    def capture_graphs(self, max_batch: int, verify: VerifyShape = VerifyShape()) -> None:
        """Record decode steps of up to `max_batch` sequences in CUDA graphs (see cuda_graphs.py),
        and with speculative decoding its verifying steps (`verify`: tokens per sequence, and the
        most sequences that speculate in one step)."""
        self.graphs = capture_decode_graphs(self.model, max_batch)
        if verify.tokens > 1 and verify.batch > 0:
            self.verify_graphs = capture_decode_graphs(self.model, min(max_batch, verify.batch), verify.tokens)

    def step(self, seqs: list[SeqStep]) -> StepResult:
        """One batched forward; what this rank keeps of it (rank 0: logits, prompt logprobs and
        pooled hidden states)."""
        model, tables = self.model, self.tables
        if any(s.images for s in seqs) and getattr(model, "vision", None) is None:
            raise WorkerFailure(p.ErrorKind.UNSUPPORTED_ARCH, "this model has no vision tower: a step with images "
                                                              "cannot run")
        try:
            tables.check(seqs, model.config.vocab_size)
            self._check_lora(seqs)
            model.cache.check(seqs, model.config.vocab_size)
        except StepRejected as exc:
            raise WorkerFailure(p.ErrorKind.BAD_REQUEST, str(exc)) from exc
        batch = tables.prepare(seqs)
        model.cache.begin(seqs)
        if any(s.prompt_logprobs is not None for s in seqs):
            batch.prompt_topk = [s.prompt_logprobs for s in seqs]
        if any(s.pool is not None for s in seqs):
            batch.pool = [s.pool for s in seqs]
        if any(s.types_from is not None for s in seqs):
            batch.types_from = [s.types_from for s in seqs]
        if any(s.lora >= 0 for s in seqs):
            batch.lora = LoraRows.build([s.lora for s in seqs], [len(s.token_ids) for s in seqs],
                                        model.lora_slots, tables.device)
        try:
            logits = self._forward(batch)
        except Exception as exc:
            raise WorkerFailure(p.ErrorKind.FORWARD_FAILED, f"{type(exc).__name__}: {exc}") from exc
        tables.commit(batch)
        model.cache.commit(batch)
        return StepResult(logits, batch.prompt_out or {}, batch.pool_out or {})

    def _forward(self, batch: StepBatch) -> torch.Tensor | None:
        """A step that fits a captured graph replays it; any other runs the model's forward."""
        for graphs in (self.graphs, self.verify_graphs):
            if graphs is not None and graphs.fits(batch):
                return graphs.run(batch)
        return self.model.forward(batch)

    def _check_lora(self, seqs: list[SeqStep]) -> None:
        for s in seqs:
            if s.lora >= 0 and s.lora not in self.lora_in_slot:
                raise StepRejected(f"slot {s.slot}: LoRA slot {s.lora} holds no adapter")

    def load_lora(self, slot: int, lora_id: int, path: str) -> None:
        """Put adapter `lora_id` in pool slot `slot`, read from `path` unless host memory holds it."""
        model = self.model
        if not 0 <= slot < getattr(model, "lora_slots", 0):
            raise WorkerFailure(p.ErrorKind.BAD_REQUEST, f"LoRA slot {slot} outside the pool "
                                                         f"({getattr(model, 'lora_slots', 0)} slots)")
        share = self.lora_host.get(lora_id)
        if share is None:
            try:
                adapter = PeftAdapter.open(path, *self.lora_base)
                with CheckpointReader([adapter.path / "adapter_model.safetensors"]) as reader:
                    share = model.lora_share(adapter, reader)
            except (ConfigError, OSError) as exc:
                raise WorkerFailure(p.ErrorKind.LOAD_FAILED, str(exc)) from exc
            self.lora_host.put(lora_id, share, _share_bytes(share))
        model.put_lora(slot, share)
        self.lora_in_slot[slot] = lora_id

    def forget_lora(self, lora_id: int) -> None:
        self.lora_host.pop(lora_id)
        for slot in [k for k, v in self.lora_in_slot.items() if v == lora_id]:
            self.model.put_lora(slot, None)
            del self.lora_in_slot[slot]

    def clear(self, slots: list[int] | None) -> None:
        try:
            self.tables.clear(slots)
            self.model.cache.clear(slots)
        except StepRejected as exc:
            raise WorkerFailure(p.ErrorKind.BAD_REQUEST, str(exc)) from exc

    def release(self) -> None:
        """Free the captured graphs (and their memory pool) now, not when garbage collection gets
        to them, and let go of the model: a reference to this runner kept elsewhere (a caller's
        variable, a traceback) then holds none of its weights or KV pool."""
        for graphs in (self.graphs, self.verify_graphs):
            if graphs is not None:
                graphs.release()
        self.graphs = self.verify_graphs = None
        self.model = None


class _CpuKernels:
    """The CPU kernels built (on a machine's first run, or with a fresh NEURON_CACHE_DIR: seconds)
    and loaded while the shard loads, rather than inside the first step, which the step deadline
    bounds. Each build is a compiler process of its own, so they run side by side and beside the
    checkpoint's reading: the wait is the longest one's (20 s on a 2-core AVX2 VM, where one after
    the other took 37 s)."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(3, thread_name_prefix="cpu-kernels")
        self._loading = [self._pool.submit(kernel.library) for kernel in (cpu_ops, cpu_attention, cpu_decoder)]

    def wait(self) -> None:
        for loading in self._loading:
            loading.result()

    def close(self) -> None:
        self._pool.shutdown(wait=False)


def _graphs_wanted(model, device: torch.device, comm: Communicator) -> bool:
    """Decode from CUDA graphs: on CUDA, over the paged cache, with collectives the GPU stream
    runs (one rank, or NCCL), for a model that allows it, unless NEURON_NO_CUDA_GRAPHS."""
    return (device.type == "cuda" and not settings().no_cuda_graphs and model.decode_on_device_only
            and not getattr(model, "lora_slots", 0)  # adapter rows change every step: eager decode
            and model.cache.paged and comm.backend in ("single", "nccl"))
