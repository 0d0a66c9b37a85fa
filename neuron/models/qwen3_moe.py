"""Qwen3-MoE: Qwen3's attention and decoder layers with sparse mixture-of-experts MLP blocks.

Everything but the feed-forward block is Qwen3's: this model only chooses, per layer, between a
dense MLP and a `SparseMoE` (see neuron/layers/moe.py for how experts split across ranks)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from neuron.distributed.comm import Communicator
from neuron.errors import ConfigError
from neuron.layers.kernels import Kernels
from neuron.layers.moe import SparseMoE
from neuron.layers.tensor_parallel import Reader, Shard
from neuron.models.config_check import is_sparse_layer
from neuron.models.qwen3 import Qwen3Config, Qwen3ForCausalLM


@dataclass(slots=True)
class Qwen3MoeConfig:
    base: Qwen3Config
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]

    @classmethod
    def from_dict(cls, d: dict) -> Qwen3MoeConfig:
        base = Qwen3Config.from_dict(d)
        try:
            cfg = cls(
                base=base,
                # Qwen's checkpoints say num_experts; transformers >= 5 writes num_local_experts
                num_experts=int(d["num_experts"] if "num_experts" in d else d["num_local_experts"]),
                top_k=int(d["num_experts_per_tok"]),
                moe_intermediate_size=int(d["moe_intermediate_size"]),
                norm_topk_prob=bool(d.get("norm_topk_prob", False)),
                decoder_sparse_step=int(d.get("decoder_sparse_step", 1)),
                mlp_only_layers=tuple(int(i) for i in d.get("mlp_only_layers") or ()),
            )
        except KeyError as exc:
            raise ConfigError(f"config.json lacks required field {exc.args[0]!r}") from None
        if not 0 < cfg.top_k <= cfg.num_experts:
            raise ConfigError(f"num_experts_per_tok ({cfg.top_k}) must be in 1..num_experts ({cfg.num_experts})")
        if cfg.decoder_sparse_step < 1:
            raise ConfigError(f"decoder_sparse_step ({cfg.decoder_sparse_step}) must be at least 1")
        return cfg

    def is_sparse(self, layer: int) -> bool:
        return is_sparse_layer(layer, self.mlp_only_layers, self.decoder_sparse_step)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """This rank's share of a Qwen3-MoE model: Qwen3's, with MoE blocks where the config says."""

    def __init__(self, config: Qwen3MoeConfig, comm: Communicator, dtype: torch.dtype, device: torch.device,
                 kernels: Kernels):
        self.check_split(config, Shard(comm.rank, comm.world_size))  # before any weight is read
        super().__init__(config.base, comm, dtype, device, kernels)
        self.moe = config

    @staticmethod
    def check_split(config: Qwen3MoeConfig, shard: Shard) -> None:
        Qwen3ForCausalLM.check_split(config.base, shard)
        shard.even(config.moe_intermediate_size, "moe_intermediate_size")

    def load_mlp(self, r: Reader, i: int):
        m = self.moe
        if not m.is_sparse(i):
            return super().load_mlp(r, i)
        return SparseMoE.load(r, f"model.layers.{i}.mlp", m.num_experts, m.moe_intermediate_size, m.top_k,
                              m.norm_topk_prob, self.shard, self.comm, self.dtype, self.device, self.kernels)

    def layer_tensors(self, layer) -> list[torch.Tensor]:
        if not isinstance(layer.mlp, SparseMoE):
            return super().layer_tensors(layer)
        return [layer.attn.qkv.weight, layer.attn.o_proj.weight, *layer.mlp.tensors()]

    def activation_bytes(self, step_tokens: int, max_slots: int, max_model_len: int) -> int:
        """Qwen3's bound plus the MoE block's (see `routed_activation_bytes`)."""
        m = self.moe
        extra = routed_activation_bytes(step_tokens, m.top_k, m.base.hidden_size,
                                        m.moe_intermediate_size // self.shard.world, self.dtype)
        return super().activation_bytes(step_tokens, max_slots, max_model_len) + extra


def routed_activation_bytes(step_tokens: int, top_k: int, hidden: int, local_inter: int, dtype: torch.dtype) -> int:
    """A step's transient memory in a `SparseMoE` block, with the models' 2x margin: the
    per-(token, expert) copies of sorted inputs, outputs and local gate/up activations."""
    pairs = step_tokens * top_k
    return 2 * pairs * (3 * hidden + 3 * local_inter) * (torch.finfo(dtype).bits // 8)
