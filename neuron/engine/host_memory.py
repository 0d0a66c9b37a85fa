"""Where a hosted model's ranks go, and whether what they need fits what their devices have left.

Each loaded model holds, in the ledger, the bytes its plan gave each of its devices (memory_plan:
weights as they are held, the KV cache, the rotary tables; the CPU ranks on this host counted
together). A new model fits when, on every device it would use, its plan fits what that device
has left: its budget (`--memory-budget`, else its size) less what the loaded models hold, and never
more than the device has free now. On CPU a plan whose default KV cache (room for max_num_seqs
full-length sequences) does not fit gets the KV cache that does, as long as one full-length
sequence fits; on a GPU the ranks size their KV cache from what is free when they load, so the
plan counts one sequence's. Nothing here starts a worker.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from neuron.engine.model_config import ModelConfig
from neuron.errors import NeuronError
from neuron.models.memory_plan import HEADROOM, MemoryPlan, available_bytes, kv_bytes_per_token, plan
from neuron.worker.failure import resolve_dtype, resolve_kv_dtype
from neuron.worker.step_input import blocks_for

_GIB = 2**30


class PlacementError(NeuronError):
    """Devices that do not exist, are another model's, or are too few."""

    status, code = 409, "devices_taken"


def place(model: ModelConfig, taken: set[str], share: bool) -> list[str]:
    """Each rank's device: the spec's `devices` (a GPU another model holds only if the spec shares),
    else on CPU the host's cores (models share them), else the GPUs no model holds with the most
    memory free, as many as the model has ranks."""
    spec = model.spec
    if spec.devices:
        clash = sorted({d for d in spec.devices if d.startswith("cuda") and d in taken})
        if clash and not share:
            raise PlacementError(f"device(s) {', '.join(clash)} belong to another model: name others, or set "
                                 "share_devices to put both on them (each then sizes its KV cache from what is free)")
        return list(spec.devices)
    if model.device == "cpu":
        return ["cpu"] * spec.tp
    visible = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    free = sorted((d for d in visible if d not in taken), key=lambda d: -_device_free(d))
    if len(free) < spec.tp:
        raise PlacementError(f"the model needs {spec.tp} GPU(s) of its own; {len(free)} of the {len(visible)} "
                             f"visible are free ({', '.join(sorted(taken)) or 'none'} held by other models)")
    return free[: spec.tp]


class MemoryLedger:
    """What each loaded model holds per device, against each device's budget."""

    def __init__(self, budget: int | None = None):
        self.budget = budget  # bytes each device may give the hosted models; None: its size
        self.held: dict[str, dict[str, int]] = {}  # model name -> device -> bytes

    def taken_gpus(self) -> set[str]:
        return {d for held in self.held.values() for d in held if d.startswith("cuda")}

    def release(self, name: str) -> None:
        self.held.pop(name, None)

    def fit(self, name: str, model: ModelConfig, devices: list[str],
            without: frozenset[str] = frozenset(), reserve: bool = True) -> tuple[ModelConfig | None, str]:
        """The model as it fits `devices` (its CPU KV cache lowered to what they hold, where
        needed), reserved in the ledger under `name`; or None and what it lacks, with the sizes.
        `without`: as if those models were unloaded; `reserve=False` only asks."""
        per_rank, one_sequence = _plans(model)
        need = _by_device(devices, per_rank.total)
        left = {d: self.left(d, without) for d in need}
        if all(need[d] <= left[d] for d in need):
            if reserve:
                self.held[name] = need
            return model, ""
        least = dataclasses.replace(per_rank, kv_cache=one_sequence)
        floor = _by_device(devices, least.total)
        cpu_ranks = devices.count("cpu")
        if all(floor[d] <= left[d] for d in need) and not any(d.startswith("cuda") and need[d] > left[d] for d in need):
            if cpu_ranks and not model.kv_cache_bytes:  # the CPU pool the room holds, in whole blocks
                block = kv_bytes_per_token(model.hf_config, model.spec.tp, _kv_dtype_bytes(model)) * model.spec.block_size
                kv = (left["cpu"] // cpu_ranks - per_rank.weights - per_rank.tables) // block * block
                fitted = dataclasses.replace(model, kv_cache_bytes=kv)
                if reserve:
                    self.held[name] = _by_device(devices, dataclasses.replace(per_rank, kv_cache=kv).total)
                return fitted, ""
        shortfall = "; ".join(f"{d} needs {floor[d] / _GIB:.2f} GiB at least ({_describe(least, devices.count(d))}) "
                              f"but has {max(left[d], 0) / _GIB:.2f} GiB left{self._holders(d)}"
                              for d in need if floor[d] > left[d]) or \
            "; ".join(f"{d} needs {need[d] / _GIB:.2f} GiB but has {max(left[d], 0) / _GIB:.2f} GiB left"
                      f"{self._holders(d)}" for d in need if need[d] > left[d])
        return None, shortfall

    def left(self, device: str, without: frozenset[str] = frozenset()) -> int:
        """What `device` can still give a model: its budget less what the loaded models hold, and no
        more than it has free now (plus what the models `without` would give back)."""
        budget = self.budget if self.budget is not None else _device_size(device)
        held = sum(h.get(device, 0) for n, h in self.held.items() if n not in without)
        freed = sum(h.get(device, 0) for n, h in self.held.items() if n in without)
        return min(budget - held, int((_device_free(device) + freed) * HEADROOM))

    def _holders(self, device: str) -> str:
        holders = [f"{n} {h[device] / _GIB:.2f} GiB" for n, h in self.held.items() if h.get(device)]
        budget = f" of a budget of {self.budget / _GIB:.2f} GiB" if self.budget is not None else ""
        return f"{budget} ({', '.join(holders)})" if holders else budget


def _plans(model: ModelConfig) -> tuple[MemoryPlan, int]:
    """One rank's plan with the KV cache the model asks for (or its CPU default), and the bytes of
    one full-length sequence's KV."""
    spec = model.spec
    dtype_bytes, kv_dtype_bytes = _dtype_bytes(model), _kv_dtype_bytes(model)
    one = blocks_for(model.max_model_len, spec.block_size) * spec.block_size
    per_token = kv_bytes_per_token(model.hf_config, spec.tp, kv_dtype_bytes)
    on_gpu = model.device.startswith("cuda")
    tokens = one if on_gpu else spec.max_num_seqs * one  # a GPU rank sizes its pool from what is free at load
    p = plan(model.hf_config, [Path(f) for f in model.weight_files], tp=spec.tp, dtype_bytes=dtype_bytes,
             quantization=spec.quantization or "", max_model_len=model.max_model_len, kv_tokens=tokens,
             kv_cache_bytes=model.kv_cache_bytes,
             lora=(spec.max_loras, spec.max_lora_rank) if spec.enable_lora else (0, 0),
             kv_dtype_bytes=kv_dtype_bytes)
    return p, one * per_token


def _dtype_bytes(model: ModelConfig) -> int:
    return torch.finfo(resolve_dtype(model.spec.dtype, model.device)).bits // 8


def _kv_dtype_bytes(model: ModelConfig) -> int:
    return torch.finfo(resolve_kv_dtype(model.spec.kv_cache_dtype, model.spec.dtype, model.device)).bits // 8


def _by_device(devices: list[str], per_rank: int) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in devices:
        out[d] = out.get(d, 0) + per_rank
    return out


def _describe(p: MemoryPlan, ranks: int) -> str:
    return (f"{ranks} rank(s) of weights {p.weights / _GIB:.2f} GiB, KV cache {p.kv_cache / _GIB:.2f} GiB, rotary "
            f"tables {p.tables / _GIB:.2f} GiB")


def _device_size(device: str) -> int:
    if device.startswith("cuda"):
        return torch.cuda.mem_get_info(torch.device(device))[1]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62  # unknown: the free memory bounds it


def _device_free(device: str) -> int:
    if device.startswith("cuda"):
        return torch.cuda.mem_get_info(torch.device(device))[0]
    free = available_bytes()
    return free if free is not None else 1 << 62
