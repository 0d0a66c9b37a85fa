"""Qwen3.5 / Qwen3.6 MoE: Qwen3.5's hybrid layers (Gated DeltaNet and gated full attention) with a
mixture-of-experts block in place of every dense MLP.

The block is transformers' `Qwen3_5MoeSparseMoeBlock`: top-k routed experts (a `SparseMoE`, see
neuron/layers/moe.py for how they split across ranks; top-k weights always renormalised) plus a
shared expert that every token runs, scaled per token by sigmoid(shared_expert_gate(x)). Both
checkpoint layouts (`qwen3_5_moe` with its vision tower, text-only `qwen3_5_moe_text`) and both
expert layouts (per-expert tensors, fused [E, ...] ones) load as Qwen3.5's do."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from neuron.distributed.comm import Communicator
from neuron.errors import ConfigError
from neuron.layers.kernels import Kernels
from neuron.layers.moe import SparseMoE
from neuron.layers.tensor_parallel import Reader, Shard
from neuron.models import text_config
from neuron.models.qwen3 import MLP
from neuron.models.qwen3_5 import Qwen35Config, Qwen35ForCausalLM
from neuron.models.qwen3_moe import routed_activation_bytes
from neuron.multimodal.image import VisionSpec


@dataclass(slots=True)
class Qwen35MoeConfig:
    base: Qwen35Config  # its intermediate_size is the shared expert's width
    num_experts: int
    top_k: int
    moe_intermediate_size: int

    @classmethod
    def from_dict(cls, d: dict) -> Qwen35MoeConfig:
        base = Qwen35Config.from_dict(d, mlp_width="shared_expert_intermediate_size")
        t = text_config(d)
        try:
            cfg = cls(
                base=base,
                num_experts=int(t["num_experts"]),
                top_k=int(t["num_experts_per_tok"]),
                moe_intermediate_size=int(t["moe_intermediate_size"]),
            )
        except KeyError as exc:
            raise ConfigError(f"config.json lacks required field {exc.args[0]!r}") from None
        if not 0 < cfg.top_k <= cfg.num_experts:
            raise ConfigError(f"num_experts_per_tok ({cfg.top_k}) must be in 1..num_experts ({cfg.num_experts})")
        return cfg


class SharedExpertMoE:
    """Routed experts plus a gated shared expert. Each splits across ranks like a dense MLP and
    yields this rank's partial output; the gate, a per-token scalar computed from the replicated
    [1, hidden] `shared_expert_gate`, scales the shared expert's partial exactly as it would the
    sum. The block sums both partials locally and costs one all-reduce."""

    def __init__(self, routed: SparseMoE, shared: MLP, gate: torch.Tensor, comm: Communicator):
        self.routed, self.shared, self.gate = routed, shared, gate
        self.comm = comm

    def tensors(self) -> list[torch.Tensor]:
        return [*self.routed.tensors(), self.shared.gate_up.weight, self.shared.down.weight, self.gate]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.routed.partial(x) + torch.sigmoid(F.linear(x, self.gate)) * self.shared.partial(x)
        self.comm.all_reduce(y)
        return y


class Qwen35MoeForCausalLM(Qwen35ForCausalLM):
    """This rank's share of a Qwen3.5 MoE model: Qwen3.5's, with a `SharedExpertMoE` in every layer."""

    def __init__(self, config: Qwen35MoeConfig, comm: Communicator, dtype: torch.dtype, device: torch.device,
                 kernels: Kernels, vision: VisionSpec | None = None, vision_config: dict | None = None):
        self.check_split(config, Shard(comm.rank, comm.world_size))
        super().__init__(config.base, comm, dtype, device, kernels, vision, vision_config)
        self.moe = config

    @staticmethod
    def check_split(config: Qwen35MoeConfig, shard: Shard, mlp_width: str = "") -> None:
        # Under the names config.json uses: the dense MLP's width is the shared expert's.
        Qwen35ForCausalLM.check_split(config.base, shard, "shared_expert_intermediate_size")
        shard.even(config.moe_intermediate_size, "moe_intermediate_size")

    def load_mlp(self, r: Reader, p: str) -> SharedExpertMoE:
        m = self.moe
        shared = super().load_mlp(r, f"{p}.shared_expert")  # the dense MLP, at the shared expert's width
        # transformers' Qwen3.5 MoE router always renormalises its top-k weights (no norm_topk_prob)
        routed = SparseMoE.load(r, p, m.num_experts, m.moe_intermediate_size, m.top_k, True, self.shard,
                                self.comm, self.dtype, self.device, self.kernels)
        gate = r.read(f"{p}.shared_expert_gate.weight").to(device=self.device, dtype=self.dtype)
        return SharedExpertMoE(routed, shared, gate, self.comm)

    def layer_tensors(self, layer) -> list[torch.Tensor]:
        return layer.mixer.tensors() + layer.mlp.tensors()

    def activation_bytes(self, step_tokens: int, max_slots: int, max_model_len: int) -> int:
        """Qwen3.5's bound (which counts the shared expert as its dense MLP) plus the routed experts'."""
        m = self.moe
        extra = routed_activation_bytes(step_tokens, m.top_k, m.base.hidden_size,
                                        m.moe_intermediate_size // self.shard.world, self.dtype)
        return super().activation_bytes(step_tokens, max_slots, max_model_len) + extra
