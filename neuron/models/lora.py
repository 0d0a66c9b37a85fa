"""PEFT LoRA checkpoints: read, checked against the base model, and sliced for one rank.

An adapter is a folder holding `adapter_config.json` (r, lora_alpha, use_rslora, target_modules)
and `adapter_model.safetensors`, whose tensors PEFT names
`base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_{A|B}.weight`: A is [r, in], B is
[out, r], and the layer's output gains (x A^T) B^T times alpha / r (alpha / sqrt(r) with rsLoRA).

`PeftAdapter.open` reads only the config and the tensors' shapes, and refuses, naming it, what
neuron cannot apply: modules_to_save, DoRA, LoRA biases, per-module rank or alpha patterns, a
target outside the attention and MLP projections, a rank over the pool's, and any tensor whose
shape says it was trained on another base (hidden size, layer count, head widths). The leader
checks an adapter this way before any rank loads it, so a bad one harms nothing already loaded.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from neuron.errors import ConfigError
from neuron.models.config_check import sparse_layers
from neuron.models.loader import CheckpointReader, read_json

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTENTION + MLP
_TENSOR = re.compile(r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")


class LoraError(ConfigError):
    """An adapter neuron cannot apply to this base model; the message names the cause."""


@dataclass(frozen=True, slots=True)
class BaseShapes:
    """What an adapter's tensors must fit: the base model's layers and projection widths."""

    num_layers: int
    hidden: int
    q: int  # num_heads * head_dim
    kv: int  # num_kv_heads * head_dim
    intermediate: int
    sparse: frozenset[int] = frozenset()  # layers whose MLP is a mixture of experts: no adapter there

    @classmethod
    def of(cls, config: dict) -> BaseShapes:
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or hidden // heads)
        kv_heads = int(config.get("num_key_value_heads") or heads)
        layers = int(config["num_hidden_layers"])
        return cls(layers, hidden, heads * head_dim, kv_heads * head_dim, int(config.get("intermediate_size") or 0),
                   sparse_layers(config))

    def in_out(self, proj: str) -> tuple[int, int]:
        return {"q_proj": (self.hidden, self.q), "k_proj": (self.hidden, self.kv), "v_proj": (self.hidden, self.kv),
                "o_proj": (self.q, self.hidden), "gate_proj": (self.hidden, self.intermediate),
                "up_proj": (self.hidden, self.intermediate), "down_proj": (self.intermediate, self.hidden)}[proj]


@dataclass(frozen=True, slots=True)
class PeftAdapter:
    """A checked adapter: its folder, rank and scaling, and the (layer, projection) pairs it
    adapts, each with the names of its A and B tensors."""

    path: Path
    rank: int
    scaling: float
    targets: dict[tuple[int, str], tuple[str, str]]

    @classmethod
    def open(cls, path: str | Path, base: dict, max_rank: int) -> PeftAdapter:
        """The adapter at `path`, checked against the base model's `config` and the pool's rank."""
        folder = Path(path)
        if not folder.is_dir():
            raise LoraError(f"LoRA adapter {str(path)!r}: no such folder (it needs adapter_config.json and "
                            "adapter_model.safetensors)")
        config = read_json(folder / "adapter_config.json")
        rank, scaling = _rank_and_scaling(config, folder, max_rank)
        weights = folder / "adapter_model.safetensors"
        if not weights.is_file():
            raise LoraError(f"LoRA adapter {folder}: adapter_model.safetensors is missing")
        shapes = BaseShapes.of(base)
        with CheckpointReader([weights]) as reader:
            targets = _targets(reader, folder, shapes, rank)
        return cls(folder, rank, scaling, targets)

    def projections(self) -> set[str]:
        return {proj for _, proj in self.targets}

    def read(self, reader: CheckpointReader, layer: int, proj: str, a_cols: tuple[int, int] | None = None,
             b_rows: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layer `layer`'s `proj` as this rank holds it, or None where the adapter leaves it out:
        A (its input columns `a_cols` where the layer is row-parallel) and B scaled (its output
        rows `b_rows` where column-parallel)."""
        names = self.targets.get((layer, proj))
        if names is None:
            return None
        a = reader.read(names[0], None if a_cols is None else 1, *(a_cols or (0, None)))
        b = reader.read(names[1], None if b_rows is None else 0, *(b_rows or (0, None)))
        for name, t in zip(names, (a, b)):  # one NaN would turn every output of its requests to NaN
            if not bool(torch.isfinite(t).all()):
                raise LoraError(f"LoRA adapter {self.path}: tensor {name!r} holds values that are not finite "
                                "(NaN or infinity)")
        return a.float(), b.float() * self.scaling


_FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
_REFUSED = {"modules_to_save": "modules_to_save (layers trained in full beside the adapter)",
            "use_dora": "DoRA (use_dora)", "rank_pattern": "a per-module rank (rank_pattern)",
            "alpha_pattern": "a per-module alpha (alpha_pattern)", "lora_bias": "LoRA biases (lora_bias)",
            "layer_replication": "layer_replication", "fan_in_fan_out": "fan_in_fan_out"}


def _rank_and_scaling(config: dict, folder: Path, max_rank: int) -> tuple[int, float]:
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"LoRA adapter {folder}: adapter_config.json is not a LoRA adapter's "
                        f"(peft_type {config.get('peft_type') if isinstance(config, dict) else None!r})")
    if config.get("target_parameters"):  # what PEFT writes for the fused experts of a MoE block
        raise LoraError(f"LoRA adapter {folder}: it adapts parameters {config['target_parameters']!r:.80} "
                        "(target_parameters), such as a mixture-of-experts block's experts; neuron applies "
                        "adapters to the attention and dense MLP projections only")
    for key, what in _REFUSED.items():
        if config.get(key):
            raise LoraError(f"LoRA adapter {folder}: {what} is not supported")
    if config.get("bias", "none") != "none":
        raise LoraError(f"LoRA adapter {folder}: bias={config['bias']!r} is not supported (only 'none')")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise LoraError(f"LoRA adapter {folder}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoraError(f"LoRA adapter {folder}: rank {rank} exceeds --max-lora-rank {max_rank}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise LoraError(f"LoRA adapter {folder}: lora_alpha must be a number, got {alpha!r}")
    targets = config.get("target_modules")
    if isinstance(targets, (list, tuple)):
        unknown = [t for t in targets if t not in TARGETS]
        if unknown:
            raise LoraError(f"LoRA adapter {folder}: target module {unknown[0]!r} is not supported (neuron applies "
                            f"adapters to {', '.join(TARGETS)})")
    return rank, alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def _targets(reader: CheckpointReader, folder: Path, shapes: BaseShapes, rank: int) -> dict:
    found: dict[tuple[int, str], dict[str, str]] = {}
    for name in reader.names():
        m = _TENSOR.fullmatch(name)
        if m is None and ".mlp.experts." in name:
            raise LoraError(f"LoRA adapter {folder}: tensor {name!r} adapts an expert of a mixture-of-experts block; "
                            "neuron applies adapters to the attention of such layers and to dense MLPs only")
        if m is None or m.group(3) not in TARGETS:
            raise LoraError(f"LoRA adapter {folder}: tensor {name!r} adapts a module neuron does not (it applies "
                            f"adapters to {', '.join(TARGETS)} of the decoder layers)")
        layer, proj, which = int(m.group(1)), m.group(3), m.group(4)
        if layer >= shapes.num_layers:
            raise LoraError(f"LoRA adapter {folder}: tensor {name!r} is for layer {layer}, but the base model has "
                            f"{shapes.num_layers} layers: the adapter was trained on another base model")
        if proj in MLP and layer in shapes.sparse:
            raise LoraError(f"LoRA adapter {folder}: tensor {name!r} adapts the MLP of layer {layer}, which is a "
                            "mixture of experts; neuron applies adapters to the attention of such layers only")
        if reader.dtype(name) not in _FLOAT_DTYPES:
            raise LoraError(f"LoRA adapter {folder}: tensor {name!r} is {reader.dtype(name)}; an adapter's "
                            f"tensors are floating point ({', '.join(_FLOAT_DTYPES)})")
        inputs, outputs = shapes.in_out(proj)
        want = [rank, inputs] if which == "A" else [outputs, rank]
        if reader.shape(name) != want:
            raise LoraError(f"LoRA adapter {folder}: tensor {name!r} has shape {reader.shape(name)}, the base model "
                            f"needs {want} (hidden_size {shapes.hidden}, rank {rank}): the adapter was trained on "
                            "another base model")
        found.setdefault((layer, proj), {})[which] = name
    if not found:
        raise LoraError(f"LoRA adapter {folder}: adapter_model.safetensors holds no LoRA tensors")
    half = next((k for k, v in found.items() if len(v) != 2), None)
    if half is not None:
        raise LoraError(f"LoRA adapter {folder}: layer {half[0]} {half[1]} has only lora_{next(iter(found[half]))}")
    return {k: (v["A"], v["B"]) for k, v in sorted(found.items())}
