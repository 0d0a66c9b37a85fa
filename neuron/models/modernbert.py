"""ModernBERT, tensor-parallel: the newer encoder behind gte-modernbert, modernbert-embed and the
gte rerankers built on it.

It runs as the BERT family does (bert.py: each input whole in one step, nothing kept, rank 0 pools,
the leader runs the classification head), with layers of its own: pre-norm (LayerNorm without
bias; the first layer's attention takes the embeddings as they are), rotary positions with one
base for global layers and another for local ones, local layers attending within
`local_attention // 2` positions either way, a fused Wqkv, a gated GELU MLP (Wi's first half the
input, its second the gate), and a final norm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from neuron.errors import ConfigError
from neuron.layers.norm import rope_heads
from neuron.layers.rope import RopeScaling, Rotary
from neuron.layers.tensor_parallel import ColumnParallelLinear, Reader, RowParallelLinear, VocabParallelEmbedding
from neuron.models import pooling
from neuron.models.bert import BertModel, LayerNorm, attend_both_ways, per_length
from neuron.models.inputs import StepBatch

_ACTIVATIONS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}
_PREFIXES = ("", "model.")
_DEFAULT_THETA = {"full_attention": 160_000.0, "sliding_attention": 10_000.0}  # transformers' defaults
_OLD_THETA_KEYS = {"full_attention": "global_rope_theta", "sliding_attention": "local_rope_theta"}


def layer_types(d: dict) -> list[str]:
    """Each layer's attention: config.json's `layer_types`, else every `global_attn_every_n_layers`-th
    layer global from the first (transformers' rule for the older configs)."""
    layers = int(d["num_hidden_layers"])
    types = d.get("layer_types")
    if types is None:
        every = int(d.get("global_attn_every_n_layers", 3))
        return ["sliding_attention" if i % every else "full_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or \
            any(t not in ("full_attention", "sliding_attention") for t in types):
        raise ConfigError(f"layer_types must list {layers} of 'full_attention' or 'sliding_attention'")
    return list(types)


def rope_thetas(d: dict) -> dict[str, float]:
    """The rotary base of each kind of layer: `rope_parameters[kind].rope_theta`, else the older
    `global_rope_theta` / `local_rope_theta`, else transformers' defaults. Only unscaled rope."""
    params = d.get("rope_parameters") if isinstance(d.get("rope_parameters"), dict) else {}
    thetas = {}
    for kind, default in _DEFAULT_THETA.items():
        p = params.get(kind) or {}
        if not isinstance(p, dict) or p.get("rope_type", "default") != "default":
            raise ConfigError(f"rope_parameters.{kind}: only the default rotary embedding is supported, got {p!r:.60}")
        theta = p.get("rope_theta", d.get(_OLD_THETA_KEYS[kind], default))
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0 < theta <= 1e12:
            raise ConfigError(f"rope_parameters.{kind}.rope_theta must be a number in (0, 1e12], got {theta!r:.40}")
        thetas[kind] = float(theta)
    return thetas


@dataclass(slots=True)
class ModernBertConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    norm_eps: float
    norm_bias: bool
    attention_bias: bool
    mlp_bias: bool
    activation: str  # F.gelu's `approximate`
    max_position_embeddings: int
    layer_types: list[str]
    thetas: dict[str, float]
    window: int  # a local layer's reach either way (local_attention // 2)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def max_len(self) -> int:
        return self.max_position_embeddings

    @classmethod
    def from_dict(cls, d: dict) -> ModernBertConfig:
        act = d.get("hidden_activation", "gelu")
        if act not in _ACTIVATIONS:
            raise ConfigError(f"hidden_activation {act!r} is not supported ({', '.join(_ACTIVATIONS)} are)")
        try:
            heads, hidden = int(d["num_attention_heads"]), int(d["hidden_size"])
            cfg = cls(vocab_size=int(d["vocab_size"]), hidden_size=hidden,
                      intermediate_size=int(d["intermediate_size"]), num_layers=int(d["num_hidden_layers"]),
                      num_heads=heads, norm_eps=float(d.get("norm_eps", 1e-5)), norm_bias=bool(d.get("norm_bias")),
                      attention_bias=bool(d.get("attention_bias")), mlp_bias=bool(d.get("mlp_bias")),
                      activation=_ACTIVATIONS[act], max_position_embeddings=int(d.get("max_position_embeddings", 8192)),
                      layer_types=layer_types(d), thetas=rope_thetas(d),
                      window=int(d.get("local_attention", 128)) // 2)
        except KeyError as exc:
            raise ConfigError(f"config.json lacks required field {exc.args[0]!r}") from None
        if hidden % heads:
            raise ConfigError(f"hidden_size ({hidden}) is not a multiple of num_attention_heads ({heads})")
        return cfg


def _window(n: int, reach: int, dtype: torch.dtype, device) -> torch.Tensor | None:
    """A local layer's keys for an input of n tokens: those within `reach` positions of the query
    either way, as what is added to the scores ([n, n], -inf past the window: PyTorch's CPU
    attention takes an additive mask 3-4x faster than a boolean one); None where the window holds
    the whole input."""
    if n <= reach + 1:
        return None
    at = torch.arange(n, device=device)
    return torch.zeros(n, n, dtype=dtype, device=device).masked_fill_((at[:, None] - at[None, :]).abs() > reach,
                                                                       float("-inf"))


class ModernBertLayer:
    def __init__(self, attn_norm: LayerNorm | None, qkv: ColumnParallelLinear, o: RowParallelLinear,
                 mlp_norm: LayerNorm, wi: ColumnParallelLinear, wo: RowParallelLinear, local: bool,
                 heads: int, head_dim: int, activation: str):
        self.attn_norm, self.qkv, self.o = attn_norm, qkv, o
        self.mlp_norm, self.wi, self.wo = mlp_norm, wi, wo
        self.local, self.heads, self.head_dim, self.activation = local, heads, head_dim, activation

    def __call__(self, x: torch.Tensor, rope: tuple, lengths: list[int], window: Callable) -> torch.Tensor:
        h = x if self.attn_norm is None else self.attn_norm(x)
        t = h.shape[0]
        q, k, v = (part.view(t, self.heads, self.head_dim) for part in self.qkv(h).chunk(3, dim=-1))
        kernels = self.qkv.kernels
        q, k = rope_heads(kernels, q, *rope), rope_heads(kernels, k, *rope)
        x = x + self.o(attend_both_ways(q, k, v, lengths, window if self.local else None))
        gate_in, gate = self.wi(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.wo(torch.nn.functional.gelu(gate_in, approximate=self.activation) * gate)


class ModernBertModel(BertModel):
    """This rank's share of a ModernBERT encoder (what it shares with BERT's: bert.py)."""

    def load(self, r: Reader, progress: Callable[[int, int], None] | None = None) -> None:
        c, s, dt, dev, k = self.config, self.shard, self.dtype, self.device, self.kernels
        prefix = next((p for p in _PREFIXES if r.has(f"{p}embeddings.tok_embeddings.weight")), None)
        if prefix is None:
            raise ConfigError("a ModernBERT checkpoint needs embeddings.tok_embeddings.weight (under model. or no "
                              "prefix)")
        self.embed = VocabParallelEmbedding.load(r, f"{prefix}embeddings.tok_embeddings.weight", c.vocab_size, s,
                                                 self.comm, dt, dev)
        self.positions = self.token_types = None

        def norm(name: str) -> LayerNorm:
            return LayerNorm.load(r, name, c.norm_eps, dt, dev, bias=c.norm_bias)

        self.embed_norm = norm(f"{prefix}embeddings.norm")
        hidden, inter = c.hidden_size, c.intermediate_size
        a, b = s.even(hidden, "hidden_size")  # this rank's heads' channels in each of q, k and v
        i0, i1 = s.even(inter, "intermediate_size")
        self.layers = []
        for i in range(c.num_layers):
            p = f"{prefix}layers.{i}"
            qkv = ColumnParallelLinear.load_ranges(r, [(f"{p}.attn.Wqkv", j * hidden + a, j * hidden + b)
                                                       for j in range(3)], dt, dev, k, bias=c.attention_bias)
            o = RowParallelLinear.load(r, f"{p}.attn.Wo", hidden, s, self.comm, dt, dev, k, bias=c.attention_bias)
            wi = ColumnParallelLinear.load_ranges(r, [(f"{p}.mlp.Wi", i0, i1), (f"{p}.mlp.Wi", inter + i0, inter + i1)],
                                                  dt, dev, k, bias=c.mlp_bias)
            wo = RowParallelLinear.load(r, f"{p}.mlp.Wo", inter, s, self.comm, dt, dev, k, bias=c.mlp_bias)
            self.layers.append(ModernBertLayer(None if i == 0 else norm(f"{p}.attn_norm"), qkv, o,
                                               norm(f"{p}.mlp_norm"), wi, wo, c.layer_types[i] == "sliding_attention",
                                               self.layout.local_heads, c.head_dim, c.activation))
            if progress:
                progress(i + 1, c.num_layers)
        self.final_norm = norm(f"{prefix}final_norm")

    def layer_tensors(self, layer: ModernBertLayer) -> list[torch.Tensor]:
        return [layer.qkv.weight, layer.o.weight, layer.wi.weight, layer.wo.weight]

    def allocate(self, num_blocks: int, block_size: int, max_slots: int, max_model_len: int) -> None:
        super().allocate(num_blocks, block_size, max_slots, max_model_len)
        c = self.config
        self.rotary = {kind: Rotary(c.head_dim, RopeScaling(theta=theta), max_model_len, self.dtype, self.device)
                       for kind, theta in c.thetas.items()}

    @torch.inference_mode()
    def forward(self, batch: StepBatch) -> None:
        """As BertModel.forward: rank 0 keeps what pooling asks of each input; no logits."""
        x = self.embed_norm(self.embed(batch.token_ids))
        ropes = {kind: rotary.tables(batch.positions) for kind, rotary in self.rotary.items()}
        c = self.config
        window = per_length(lambda n: _window(n, c.window, x.dtype, x.device))
        for layer, kind in zip(self.layers, c.layer_types):
            x = layer(x, ropes[kind], batch.lengths, window)
        x = self.final_norm(x)
        if batch.pool is not None and self.comm.rank == 0:
            batch.pool_out = pooling.compute(self, x, batch)
        return None
