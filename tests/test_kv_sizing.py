"""KV pool sizing on CUDA counts only live memory, without a GPU: torch.cuda's memory queries are
faked. A model freed before (its blocks still cached by the allocator) must not shrink the next
pool; live allocations still bound it."""

from __future__ import annotations

import pytest
import torch

from neuron.errors import ConfigError
from neuron.worker.kv_pool import plan_num_blocks

GIB = 2**30
BLOCK_BYTES = 2 * 2**20
CUDA0 = torch.device("cuda:0")


def fake_gpu_memory(monkeypatch, *, free: int, total: int, allocated: int, reserved: int) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved)


def plan(utilization: float = 0.9) -> int:
    return plan_num_blocks(BLOCK_BYTES, 16, max_slots=8, max_model_len=4096, kv_cache_bytes=0,
                           gpu_memory_utilization=utilization, activation_reserve=2 * GIB, device=CUDA0)


def test_a_pool_after_a_freed_model_is_as_large_as_the_first(monkeypatch):
    # 80 GiB device, 0.5 GiB of it the CUDA context; the model's weights take 16 GiB.
    fake_gpu_memory(monkeypatch, free=int(63.5 * GIB), total=80 * GIB, allocated=16 * GIB, reserved=16 * GIB)
    first = plan()
    assert first == (72 - 16 - 2) * GIB // BLOCK_BYTES
    # The first model and its pool are freed, but the allocator still reserves their 70 GiB;
    # the second model's weights reuse 16 GiB of that cache.
    fake_gpu_memory(monkeypatch, free=int(9.5 * GIB), total=80 * GIB, allocated=16 * GIB, reserved=70 * GIB)
    assert plan() == first


def test_a_budget_spent_by_live_allocations_is_refused(monkeypatch):
    fake_gpu_memory(monkeypatch, free=int(8.5 * GIB), total=80 * GIB, allocated=71 * GIB, reserved=71 * GIB)
    with pytest.raises(ConfigError, match=r"no GPU memory left for the KV cache on cuda:0: 8704 MiB free of "
                                          r"81920 MiB, this rank has 72704 MiB allocated and 0 MiB cached"):
        plan()


def test_cached_memory_never_lifts_the_budget_past_the_device(monkeypatch):
    # A driver report and allocator counters that disagree must not promise more than the device has.
    fake_gpu_memory(monkeypatch, free=80 * GIB, total=80 * GIB, allocated=0, reserved=40 * GIB)
    assert plan(utilization=1.0) == (80 - 2) * GIB // BLOCK_BYTES


def test_a_second_model_in_the_process_gets_its_own_share(monkeypatch):
    # A host's first model (rank 0 in this process) holds 30 GiB of an 80 GiB device; the second,
    # sharing the device at 0.4, has loaded 6 GiB of weights: its share is 0.4 of the device, less
    # its own weights, not less the first model's memory.
    fake_gpu_memory(monkeypatch, free=int(43.5 * GIB), total=80 * GIB, allocated=36 * GIB, reserved=36 * GIB)
    blocks = plan_num_blocks(BLOCK_BYTES, 16, max_slots=8, max_model_len=4096, kv_cache_bytes=0,
                             gpu_memory_utilization=0.4, activation_reserve=2 * GIB, device=CUDA0,
                             held_by_others=30 * GIB)
    assert blocks == (32 - 6 - 2) * GIB // BLOCK_BYTES
    # and never more than is free
    fake_gpu_memory(monkeypatch, free=10 * GIB, total=80 * GIB, allocated=36 * GIB, reserved=36 * GIB)
    blocks = plan_num_blocks(BLOCK_BYTES, 16, max_slots=8, max_model_len=4096, kv_cache_bytes=0,
                             gpu_memory_utilization=0.4, activation_reserve=2 * GIB, device=CUDA0,
                             held_by_others=30 * GIB)
    assert blocks == (10 - 2) * GIB // BLOCK_BYTES


def test_a_draft_on_the_same_gpu_takes_its_blocks_and_weights_from_the_share(monkeypatch):
    # The target's weights take 16 GiB of an 80 GiB device at 0.9; speculative decoding's draft
    # will hold 4 GiB and a block of its own for each of the target's (as large as the target's).
    fake_gpu_memory(monkeypatch, free=int(63.5 * GIB), total=80 * GIB, allocated=16 * GIB, reserved=16 * GIB)
    blocks = plan_num_blocks(BLOCK_BYTES, 16, max_slots=8, max_model_len=4096, kv_cache_bytes=0,
                             gpu_memory_utilization=0.9, activation_reserve=2 * GIB, device=CUDA0,
                             draft=(BLOCK_BYTES, 4 * GIB))
    assert blocks == (72 - 16 - 2 - 4) * GIB // (2 * BLOCK_BYTES)
    # an explicit budget is the user's: the draft gets as many blocks again, beside it
    assert plan_num_blocks(BLOCK_BYTES, 16, max_slots=8, max_model_len=4096, kv_cache_bytes=GIB,
                           gpu_memory_utilization=0.9, activation_reserve=2 * GIB, device=CUDA0,
                           draft=(BLOCK_BYTES, 4 * GIB)) == GIB // BLOCK_BYTES
    fake_gpu_memory(monkeypatch, free=int(7 * GIB), total=80 * GIB, allocated=16 * GIB, reserved=16 * GIB)
    with pytest.raises(ConfigError, match="and 8192 MiB for the speculative draft model"):
        plan_num_blocks(BLOCK_BYTES, 16, max_slots=8, max_model_len=4096, kv_cache_bytes=0,
                        gpu_memory_utilization=0.9, activation_reserve=2 * GIB, device=CUDA0,
                        draft=(BLOCK_BYTES, 8 * GIB))


def test_rank_0_of_a_cuda_target_leaves_room_for_its_draft(tmp_path, monkeypatch):
    """The target's shard spec carries what its draft holds on rank 0's GPU: a block as large as
    the draft's KV block, and at least its weights. Not on CPU, and not with an explicit KV budget."""
    import dataclasses
    import json

    from checkpoints import build_checkpoint, truncated_copy

    from neuron.engine import engine_config
    from neuron.engine.engine_config import EngineConfig
    from neuron.engine.model_config import resolve_model_config
    from neuron.models.memory_plan import kv_bytes_per_token

    target = build_checkpoint(tmp_path / "target", seed=3)
    draft = truncated_copy(target, tmp_path / "draft", 1)
    spec = {"method": "draft", "model": str(draft), "num_speculative_tokens": 3}
    cfg = resolve_model_config(EngineConfig(model=str(target), device="cpu", dtype="float32",
                                            speculative_config=spec))
    shard = cfg.shard_spec()
    assert (shard.draft_block_bytes, shard.draft_bytes) == (0, 0)
    monkeypatch.setattr(engine_config, "check_device", lambda device: None)  # a CPU build of torch
    on_gpu = dataclasses.replace(cfg, device="cuda:0")
    shard = on_gpu.shard_spec()
    draft_weights = (draft / "model.safetensors").stat().st_size
    draft_config = json.loads((draft / "config.json").read_text())  # one layer of the target's two
    assert shard.draft_block_bytes == kv_bytes_per_token(draft_config, 1, 4) * shard.block_size \
        == kv_bytes_per_token(cfg.hf_config, 1, 4) * shard.block_size // 2
    assert shard.draft_bytes > 0.9 * draft_weights
    assert dataclasses.replace(on_gpu, kv_cache_bytes=GIB).shard_spec().draft_bytes == 0


def test_a_cpu_pool_is_zero_and_not_resident_until_written():
    """A CPU rank's pools are sized for max_num_seqs full-length sequences; allocating them must not
    write (and so hold) all of it at start."""
    from neuron.layers.kernels import Kernels
    from neuron.models.kv_cache import PagedKVCache

    def resident() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    before = resident()
    cache = PagedKVCache(layers=4, num_blocks=4096, block_size=16, max_len=512, kv_heads=2, head_dim=128,
                         dtype=torch.bfloat16, device=torch.device("cpu"), kernels=Kernels())
    pools = cache.k + cache.v
    assert sum(p.numel() * p.element_size() for p in pools) >= 256 << 20
    assert resident() - before < 32 << 20
    assert all(p.shape == (2, 4097 * 16, 128) and p.dtype == torch.bfloat16 for p in pools)
    cache.k[3][1, -16:] = 1.5
    assert cache.k[3][1, -17:].float().sum().item() == 1.5 * 16 * 128
    assert not cache.v[0][:, :64].any()


def test_a_cpu_pool_the_host_cannot_map_names_its_size(monkeypatch):
    import errno
    import mmap

    from neuron.executor.executor import resource_shortage
    from neuron.models.kv_cache import zeroed_pool

    def refuse(*args, **kwargs):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(mmap, "mmap", refuse)
    with pytest.raises(OSError, match=r"cannot map 4194304 bytes for a KV cache pool of shape \(2, 4096, 128\)") as err:
        zeroed_pool((2, 4096, 128), torch.float32, "cpu")
    assert err.value.errno == errno.ENOMEM and resource_shortage(err.value) == "Cannot allocate memory"
