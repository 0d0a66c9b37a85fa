"""How many KV blocks a rank allocates: from an explicit byte budget, or from what its device has
left after the weights and a step's activations (CUDA), or room for every slot at full length (CPU)."""

from __future__ import annotations

import logging

import torch

from neuron.errors import ConfigError
from neuron.rpc import protocol as p
from neuron.worker.step_input import blocks_for

log = logging.getLogger("neuron.worker")

_MIB = 2**20


def plan_kv_pool(model, req: p.ShardSpec, device: torch.device, held_by_others: int = 0, rank: int = 0) -> int:
    """The blocks of `req.block_size` tokens this rank's pool holds for `model` (loaded, not
    allocated); `held_by_others`: what this process had allocated on the device before the model
    (another model of a host), not counted against its share. Rank 0 leaves room for a draft."""
    if req.block_size < 1:
        raise ConfigError(f"KV block size must be >= 1, got {req.block_size}")
    block_bytes = model.kv_block_bytes(req.block_size)
    if block_bytes == 0:  # an encoder keeps nothing: the blocks only count tokens for the leader
        return req.max_slots * blocks_for(req.max_model_len, req.block_size)
    reserve = model.activation_bytes(req.max_num_batched_tokens, req.max_slots, req.max_model_len)
    draft = (req.draft_block_bytes, req.draft_bytes) if rank == 0 else (0, 0)
    num_blocks = plan_num_blocks(block_bytes, req.block_size, max_slots=req.max_slots,
                                 max_model_len=req.max_model_len, kv_cache_bytes=req.kv_cache_bytes,
                                 gpu_memory_utilization=req.gpu_memory_utilization,
                                 activation_reserve=reserve, device=device, held_by_others=held_by_others,
                                 draft=draft)
    log.info("KV cache: %d blocks of %d tokens, %.1f MiB", num_blocks, req.block_size,
             num_blocks * block_bytes / 2**20)
    return num_blocks


def plan_num_blocks(block_bytes: int, block_size: int, *, max_slots: int, max_model_len: int, kv_cache_bytes: int,
                    gpu_memory_utilization: float, activation_reserve: int, device: torch.device,
                    held_by_others: int = 0, draft: tuple[int, int] = (0, 0)) -> int:
    """How many KV blocks this rank allocates: an explicit byte budget if given; on CUDA what its
    share of the device leaves after what this model has allocated (the weights; what this process
    held before it, `held_by_others`, is another model's) and the activation reserve, never more
    than is free now (counting what its allocator caches); on CPU room for `max_slots` full-length
    sequences, as a preallocated cache would hold. `draft`: on CUDA, a draft model's bytes per
    block of this pool (its own pool has as many) and its other bytes, all within the same share."""
    if kv_cache_bytes > 0:
        return kv_cache_bytes // block_bytes
    if device.type != "cuda":
        return max_slots * blocks_for(max_model_len, block_size)
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    free, total = torch.cuda.mem_get_info(device)
    in_use = torch.cuda.memory_allocated(device)
    allocated = max(in_use - held_by_others, 0)
    # The caching allocator keeps a freed model's blocks reserved; it hands them out again, and
    # frees them back to the driver when a request fits none of them, so they count as available.
    cached = max(torch.cuda.memory_reserved(device) - in_use, 0)
    draft_block_bytes, draft_bytes = draft
    budget = min(total * gpu_memory_utilization - allocated, free + cached) - activation_reserve - draft_bytes
    num_blocks = int(budget // (block_bytes + draft_block_bytes))
    if num_blocks <= 0:
        beside = f", and {draft_bytes / _MIB:.0f} MiB for the speculative draft model" if draft_bytes else ""
        raise ConfigError(
            f"no GPU memory left for the KV cache on {device}: {free / _MIB:.0f} MiB free of {total / _MIB:.0f} MiB, "
            f"this rank has {allocated / _MIB:.0f} MiB allocated and {cached / _MIB:.0f} MiB cached for reuse, "
            f"and reserves {activation_reserve / _MIB:.0f} MiB for activations{beside}; "
            "raise --gpu-memory-utilization, use more ranks, or lower --max-num-batched-tokens")
    return num_blocks
