"""Qwen3.5 / Qwen3.6 hybrid text model, tensor-parallel and batched: Gated DeltaNet layers
(recurrent state per slot) interleaved with gated full attention (paged KV blocks).

Checkpoints come in two layouts: the multimodal one (`model_type` "qwen3_5", text weights under
`model.language_model.`, the vision tower under `model.visual.`) and the text-only one
("qwen3_5_text", under `model.`); the MoE variants (qwen3_5_moe.py) share both. Both run text
prompts; the multimodal one also takes prompts with images (qwen3_5_images.py): its replicated
vision tower embeds the images, whose embeddings replace the prompt's placeholder tokens at
multimodal (time, height, width) positions, chunk by chunk like any prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from neuron.distributed.comm import Communicator
from neuron.errors import ConfigError
from neuron.layers.kernels import Kernels
from neuron.layers.norm import apply_rotary
from neuron.layers.rope import rope_parameters
from neuron.layers.tensor_parallel import (
    ColumnParallelLinear,
    HeadLayout,
    MergedColumnParallelLinear,
    ParallelLMHead,
    Reader,
    RowParallelLinear,
    Shard,
    VocabParallelEmbedding,
)
from neuron.models import MULTIMODAL_MODEL_TYPES
from neuron.models.base import CausalLM
from neuron.models.gated_deltanet import CHUNK, DeltaNetHeads, DeltaNetState, GatedDeltaNet
from neuron.models.inputs import KeptRows, StepBatch, StepRejected
from neuron.models.kv_cache import PagedKVCache
from neuron.models.qwen3 import MLP
from neuron.models.qwen3_5_images import SlotImages
from neuron.models.qwen3_5_vision import VisionTower
from neuron.multimodal.image import VisionSpec
from neuron.step import SeqStep

LINEAR, FULL = "linear_attention", "full_attention"


@dataclass(slots=True)
class Qwen35Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense MLP's width; in MoE models, the shared expert's
    num_layers: int
    layer_types: list[str]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rotary_dim: int
    mrope_section: list[int]
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    conv_kernel: int
    linear_k_heads: int
    linear_v_heads: int
    linear_k_dim: int
    linear_v_dim: int

    @classmethod
    def from_dict(cls, d: dict, mlp_width: str = "intermediate_size") -> "Qwen35Config":
        """The text model's settings; `mlp_width` names the field holding the dense MLP's width."""
        text = d
        if d.get("model_type") in MULTIMODAL_MODEL_TYPES:
            text = d.get("text_config")
            if not isinstance(text, dict):
                raise ConfigError(f"a {d['model_type']} config.json needs its text_config")
        try:
            cfg = cls._from_text(text, bool(d.get("tie_word_embeddings", False)), mlp_width)
        except KeyError as exc:
            raise ConfigError(f"config.json lacks required field {exc.args[0]!r}") from None
        if text.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act {text['hidden_act']!r} is not supported (only 'silu')")
        if len(cfg.layer_types) != cfg.num_layers or set(cfg.layer_types) - {LINEAR, FULL}:
            raise ConfigError(f"layer_types must list {cfg.num_layers} of {LINEAR!r} or {FULL!r}")
        return cfg

    @classmethod
    def _from_text(cls, t: dict, tie: bool, mlp_width: str) -> "Qwen35Config":
        heads, hidden, layers = int(t["num_attention_heads"]), int(t["hidden_size"]), int(t["num_hidden_layers"])
        head_dim = int(t.get("head_dim") or hidden // heads)
        rope = _rope(t)
        interval = int(t.get("full_attention_interval", 4))
        default_types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(layers)]
        return cls(
            vocab_size=int(t["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(t[mlp_width]),
            num_layers=layers,
            layer_types=list(t.get("layer_types") or default_types),
            num_heads=heads,
            num_kv_heads=int(t.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(t.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", t.get("rope_theta", 10000.0))),
            rotary_dim=int(head_dim * float(rope.get("partial_rotary_factor", t.get("partial_rotary_factor", 0.25)))),
            mrope_section=[int(s) for s in rope.get("mrope_section", [11, 11, 10])],
            max_position_embeddings=int(t.get("max_position_embeddings", 32768)),
            tie_word_embeddings=tie,
            attention_bias=bool(t.get("attention_bias", False)),
            conv_kernel=int(t.get("linear_conv_kernel_dim", 4)),
            linear_k_heads=int(t.get("linear_num_key_heads", 16)),
            linear_v_heads=int(t.get("linear_num_value_heads", 32)),
            linear_k_dim=int(t.get("linear_key_head_dim", 128)),
            linear_v_dim=int(t.get("linear_value_head_dim", 128)),
        )


def _rope(t: dict) -> dict:
    params = rope_parameters(t)
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        raise ConfigError(
            f"rope type {rope_type!r} is not supported (supported: default); "
            "remove rope scaling from config.json to run at the native context length"
        )
    return params


class MRotary:
    """Multimodal RoPE over the first `rotary_dim` channels of a head. Each frequency follows one
    position axis (time, height, width), interleaved as the checkpoint's `mrope_section` says; a
    text token has the same position on every axis, which is plain RoPE."""

    def __init__(self, rotary_dim: int, theta: float, section: list[int], max_len: int, dtype, device):
        n = rotary_dim // 2
        inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
        angles = torch.arange(max_len, dtype=torch.float)[:, None] * inv_freq  # [max_len, n]
        self.cos = angles.cos().to(device=device, dtype=dtype)
        self.sin = angles.sin().to(device=device, dtype=dtype)
        axis = torch.zeros(n, dtype=torch.long)
        axis[1 : 3 * section[1] : 3] = 1
        axis[2 : 3 * section[2] : 3] = 2
        self.axis = axis.to(device)
        self.freq = torch.arange(n, device=device)

    def tables(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for positions [T] (text) or [3, T] (time, height, width), as [T, 1, rotary_dim]."""
        if pos.dim() == 1:
            cos, sin = self.cos[pos], self.sin[pos]
        else:
            rows = pos[self.axis].T  # [T, n]: each frequency's own axis
            cos, sin = self.cos[rows, self.freq], self.sin[rows, self.freq]
        return torch.cat((cos, cos), -1).unsqueeze(1), torch.cat((sin, sin), -1).unsqueeze(1)


def apply_partial_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    d = cos.shape[-1]
    return torch.cat((apply_rotary(x[..., :d], cos, sin), x[..., d:]), dim=-1)


class OffsetRMSNorm:
    """RMSNorm scaling by (1 + weight), in float32 like the reference; replicated on every rank."""

    def __init__(self, weight: torch.Tensor, eps: float):
        self.weight = weight
        self.eps = eps

    @classmethod
    def load(cls, r: Reader, name: str, eps: float, device) -> "OffsetRMSNorm":
        return cls((1.0 + r.read(name).float()).to(device), eps)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), self.weight.shape, self.weight, self.eps).to(x.dtype)


class GatedAttention:
    """Full attention whose output is gated per channel by sigmoid(gate); q_proj yields, per head,
    the query followed by its gate. q, k, v column-parallel by heads, o row-parallel."""

    def __init__(self, layer: int, qkv, o_proj, q_norm, k_norm, layout: HeadLayout):
        self.layer = layer
        self.qkv, self.o_proj = qkv, o_proj
        self.q_norm, self.k_norm = q_norm, k_norm
        self.heads, self.kv_heads, self.head_dim = layout.local_heads, layout.local_kv_heads, layout.head_dim
        d = self.head_dim
        self.sizes = (self.heads * 2 * d, self.kv_heads * d, self.kv_heads * d)

    @classmethod
    def load(cls, r: Reader, layer: int, prefix: str, c: Qwen35Config, layout: HeadLayout, comm, dtype, device,
             kernels: Kernels):
        d, s = c.head_dim, layout.shard
        q0, q1 = s.rank * layout.local_heads * 2 * d, (s.rank + 1) * layout.local_heads * 2 * d
        k0, k1 = (h * d for h in layout.kv_head_range())
        parts = [(f"{prefix}.q_proj", q0, q1), (f"{prefix}.k_proj", k0, k1), (f"{prefix}.v_proj", k0, k1)]
        qkv = ColumnParallelLinear.load_ranges(r, parts, dtype, device, kernels, bias=c.attention_bias)
        o_proj = RowParallelLinear.load(r, f"{prefix}.o_proj", c.num_heads * d, s, comm, dtype, device, kernels,
                                        bias=c.attention_bias)
        q_norm = OffsetRMSNorm.load(r, f"{prefix}.q_norm.weight", c.rms_norm_eps, device)
        k_norm = OffsetRMSNorm.load(r, f"{prefix}.k_norm.weight", c.rms_norm_eps, device)
        return cls(layer, qkv, o_proj, q_norm, k_norm, layout)

    def tensors(self) -> list[torch.Tensor]:
        return [self.qkv.weight, self.o_proj.weight]

    def __call__(self, h: torch.Tensor, batch: StepBatch, rope: tuple, cache: PagedKVCache,
                 kept: KeptRows | None = None) -> torch.Tensor:
        """The block's output for every row, or for the `kept` rows alone (every key and value stored)."""
        t, d = h.shape[0], self.head_dim
        qg, k, v = self.qkv(h).split(self.sizes, dim=-1)
        q, gate = qg.view(t, self.heads, 2 * d).split(d, dim=-1)
        q = apply_partial_rotary(self.q_norm(q), *rope)
        k = apply_partial_rotary(self.k_norm(k.view(t, self.kv_heads, d)), *rope)
        cache.write(self.layer, batch, k, v.view(t, self.kv_heads, d))
        if kept is not None:
            q, gate = q[kept.index], gate[kept.index]
        o = cache.attend(self.layer, batch, q, kept) * torch.sigmoid(gate)
        return self.o_proj(o.reshape(q.shape[0], -1))


class HybridCache:
    """KV blocks for the full-attention layers, recurrent state per slot for the linear ones, and
    the images of the slots whose prefill has not passed them (with a vision tower).
    The recurrent state cannot rewind or be shared: a step continues exactly where its slot's
    state stands, or starts a sequence from nothing at offset 0 (a cached prefix cannot seed it)."""

    def __init__(self, kv: PagedKVCache, linear: DeltaNetState, slots: int, images: SlotImages | None = None):
        self.kv = kv
        self.linear = linear
        self.images = images
        self.state_at: list[int | None] = [0] * slots  # None: a step failed mid-way
        # Text after images sits at `offset + shift` on every rotary axis: an image's tokens
        # advance positions by its grid's longer side, not by their count.
        self.shift = [0] * slots

    def check(self, seqs: list[SeqStep], vocab_size: int) -> None:
        """Refuse a step the recurrent state cannot take (the block tables checked the rest)."""
        for s in seqs:
            if s.fresh or s.offset == 0:
                if s.offset:
                    raise StepRejected(
                        f"slot {s.slot}: a cached prefix of {s.offset} tokens cannot seed linear-attention "
                        "state; this model needs prefix caching off"
                    )
                continue
            at = self.state_at[s.slot]
            if s.offset != at:
                where = "unknown after a failed step" if at is None else f"at position {at}"
                raise StepRejected(
                    f"slot {s.slot}: offset {s.offset} but its recurrent state is {where}; "
                    "a linear-attention step must continue where the slot stands or restart at 0"
                )
        if self.images is not None:
            self.images.check(seqs)

    def begin(self, seqs: list[SeqStep]) -> None:
        self.linear.begin(seqs)
        if self.images is not None:
            self.images.begin(seqs)
        for s in seqs:
            self.state_at[s.slot] = None  # until the step commits
            if s.fresh:
                self.shift[s.slot] = 0 if self.images is None else self.images.shift(s.slot)

    def positions(self, batch: StepBatch) -> torch.Tensor:
        """The step's rotary positions: each token's offset plus its slot's shift."""
        shifts = [self.shift[slot] for slot in batch.slots]
        if not any(shifts):
            return batch.positions
        per_seq = torch.tensor(shifts, dtype=torch.long, device=batch.positions.device)
        if not batch.all_decode:
            per_seq = per_seq.repeat_interleave(torch.tensor(batch.lengths, device=per_seq.device))
        return batch.positions + per_seq

    def commit(self, batch: StepBatch) -> None:
        step = self.linear
        for slot, offset, n in zip(step.slots, step.offsets, step.lengths):
            self.state_at[slot] = offset + n
        if self.images is not None:
            self.images.commit(batch)

    def clear(self, slots: list[int] | None) -> None:
        targets = range(len(self.state_at)) if slots is None else slots
        for slot in targets:
            self.state_at[slot] = 0
            self.shift[slot] = 0
        if self.images is not None:
            self.images.clear(targets)


class DecoderLayer:
    def __init__(self, mixer, mlp: MLP, input_norm: OffsetRMSNorm, post_norm: OffsetRMSNorm):
        self.mixer, self.mlp = mixer, mlp
        self.input_norm, self.post_norm = input_norm, post_norm
        self.linear = isinstance(mixer, GatedDeltaNet)

    def __call__(self, x: torch.Tensor, batch: StepBatch, rope: tuple, cache: HybridCache,
                 kept: KeptRows | None = None) -> torch.Tensor:
        h = self.input_norm(x)
        if self.linear:  # the recurrent state takes every row
            h = self.mixer(h, cache.linear)
            h = h if kept is None else h[kept.index]
        else:
            h = self.mixer(h, batch, rope, cache.kv, kept)
        x = (x if kept is None else x[kept.index]) + h
        return x + self.mlp(self.post_norm(x))


class Qwen35ForCausalLM(CausalLM):
    """This rank's share of a Qwen3.5 text model plus its per-slot state."""

    def __init__(self, config: Qwen35Config, comm: Communicator, dtype: torch.dtype, device: torch.device,
                 kernels: Kernels, vision: VisionSpec | None = None, vision_config: dict | None = None):
        c = config
        self.config = c
        self.kernels = kernels
        self.vision_spec = vision
        self.vision: VisionTower | None = None
        if vision is not None:
            self.vision = VisionTower(vision_config or {}, dtype, device)
        self.comm = comm
        self.dtype = dtype
        self.device = device
        self.shard = Shard(comm.rank, comm.world_size)
        Qwen35ForCausalLM.check_split(c, self.shard)
        self.layout = HeadLayout(c.num_heads, c.num_kv_heads, c.head_dim, self.shard)
        self.heads = DeltaNetHeads(c.linear_k_heads, c.linear_v_heads, c.linear_k_dim, c.linear_v_dim, self.shard)
        self.layers: list[DecoderLayer] = []
        self.cache: HybridCache | None = None

    @staticmethod
    def check_split(c: Qwen35Config, shard: Shard, mlp_width: str = "intermediate_size") -> None:
        """Refuse a tensor-parallel size this model's heads and widths do not split into."""
        HeadLayout(c.num_heads, c.num_kv_heads, c.head_dim, shard).validate()
        DeltaNetHeads(c.linear_k_heads, c.linear_v_heads, c.linear_k_dim, c.linear_v_dim, shard).validate()
        shard.even(c.intermediate_size, mlp_width)

    def load(self, r: Reader, progress: Callable[[int, int], None] | None = None) -> None:
        c, s, dt, dev = self.config, self.shard, self.dtype, self.device
        p = "model.language_model" if r.has("model.language_model.embed_tokens.weight") else "model"
        self.embed = VocabParallelEmbedding.load(r, f"{p}.embed_tokens.weight", c.vocab_size, s, self.comm, dt, dev)
        head = f"{p}.embed_tokens.weight" if c.tie_word_embeddings or not r.has("lm_head.weight") else "lm_head.weight"
        self.lm_head = ParallelLMHead.load(r, head, c.vocab_size, s, self.comm, dt, dev, self.kernels,
                                           tied=self.embed if head.endswith("embed_tokens.weight") else None)
        self.norm = OffsetRMSNorm.load(r, f"{p}.norm.weight", c.rms_norm_eps, dev)
        self.layers = []
        for i in range(c.num_layers):
            self.layers.append(self._load_layer(r, f"{p}.layers.{i}", i))
            if progress:
                progress(i + 1, c.num_layers)
        if self.vision is not None and not r.has("model.visual.patch_embed.proj.weight"):
            self.vision = self.vision_spec = None  # a text-only export of a multimodal model
        if self.vision is not None:
            self.vision.load(r, "model.visual")

    def _load_layer(self, r: Reader, p: str, i: int) -> DecoderLayer:
        c, dt, dev, k = self.config, self.dtype, self.device, self.kernels
        index = c.layer_types[:i].count(c.layer_types[i])  # among layers of its own kind
        if c.layer_types[i] == LINEAR:
            mixer = GatedDeltaNet.load(r, index, f"{p}.linear_attn", self.heads, c.rms_norm_eps, self.comm, dt, dev, k)
        else:
            mixer = GatedAttention.load(r, index, f"{p}.self_attn", c, self.layout, self.comm, dt, dev, k)
        input_norm = OffsetRMSNorm.load(r, f"{p}.input_layernorm.weight", c.rms_norm_eps, dev)
        post_norm = OffsetRMSNorm.load(r, f"{p}.post_attention_layernorm.weight", c.rms_norm_eps, dev)
        return DecoderLayer(mixer, self.load_mlp(r, f"{p}.mlp"), input_norm, post_norm)

    def load_mlp(self, r: Reader, p: str):
        """The feed-forward block under `p`; a hook for models whose layers differ only there (MoE)."""
        c, s, dt, dev, k = self.config, self.shard, self.dtype, self.device, self.kernels
        gate_up = MergedColumnParallelLinear.load(r, [f"{p}.gate_proj", f"{p}.up_proj"], c.intermediate_size, s, dt, dev,
                                                  k)
        return MLP(gate_up, RowParallelLinear.load(r, f"{p}.down_proj", c.intermediate_size, s, self.comm, dt, dev, k))

    def _conv_dim(self) -> int:
        h = self.heads
        return 2 * h.local_k() * h.k_dim + h.local_v * h.v_dim

    def _state_bytes(self, max_slots: int) -> int:
        c = self.config
        per_slot = DeltaNetState.bytes_per_slot(c.layer_types.count(LINEAR), self._conv_dim(), c.conv_kernel,
                                                self.heads, self.dtype)
        return max_slots * per_slot

    def kv_block_bytes(self, block_size: int) -> int:
        """Bytes of one KV block on this rank: K and V of `block_size` tokens in every full-attention layer."""
        c = self.config
        per_token = 2 * c.layer_types.count(FULL) * self.layout.local_kv_heads * c.head_dim
        return per_token * block_size * torch.finfo(self.cache_dtype).bits // 8

    def activation_bytes(self, step_tokens: int, max_slots: int, max_model_len: int) -> int:
        """A generous bound on one step's transient memory, plus the per-slot recurrent state that
        is allocated beside the KV pool: both kept free of KV blocks on GPUs."""
        c, lay, h, paged = self.config, self.layout, self.heads, self.kernels.paged
        size = torch.finfo(self.dtype).bits // 8
        attn_width = (2 * lay.local_heads + 2 * lay.local_kv_heads) * c.head_dim
        linear_width = self._conv_dim() + h.local_v * (h.v_dim + 2)
        width = 4 * c.hidden_size + 2 * max(attn_width, linear_width) + 3 * c.intermediate_size // self.shard.world
        hidden = step_tokens * width * size
        scores = lay.local_heads * step_tokens * max_model_len * 4
        gathered = 2 * (1 if paged else max_slots) * max_model_len * lay.local_kv_heads * c.head_dim * size
        delta = 8 * h.local_v * step_tokens * (CHUNK + h.k_dim + h.v_dim) * 4  # chunk systems, float32
        logits = 3 * max_slots * c.vocab_size * 4
        return 2 * (hidden + max(scores, gathered, delta) + logits) + 256 * 2**20 + self._state_bytes(max_slots)

    def allocate(self, num_blocks: int, block_size: int, max_slots: int, max_model_len: int) -> None:
        c = self.config
        self.check_model_len(max_model_len, c.max_position_embeddings)
        self.rotary = MRotary(c.rotary_dim, c.rope_theta, c.mrope_section, max_model_len, self.dtype, self.device)
        kv = PagedKVCache(c.layer_types.count(FULL), num_blocks, block_size, max_model_len,
                          self.layout.local_kv_heads, c.head_dim, self.cache_dtype, self.device, self.kernels)
        linear = DeltaNetState(c.layer_types.count(LINEAR), max_slots, self._conv_dim(), c.conv_kernel, self.heads,
                               self.dtype, self.device)
        images = None
        if self.vision is not None:
            images = SlotImages(self.vision, self.vision_spec, max_slots, max_model_len, self.device)
        self.cache = HybridCache(kv, linear, max_slots, images)

    def layer_tensors(self, layer) -> list[torch.Tensor]:
        return layer.mixer.tensors() + [layer.mlp.gate_up.weight, layer.mlp.down.weight]

    def weight_bytes(self) -> int:
        vision = self.vision.tensors() if self.vision is not None else []
        return super().weight_bytes() + sum(t.numel() * t.element_size() for t in vision)

    @torch.inference_mode()
    def forward(self, batch: StepBatch) -> torch.Tensor | None:
        """The step; where its chunks reach a sequence's images, their embeddings replace the
        placeholders'. The tower runs first: it has no collective, so a failure there comes before any."""
        assert self.cache is not None
        images = self.cache.images
        if images is not None:
            images.encode(batch)
        x, positions = self.embed(batch.token_ids), self.cache.positions(batch)
        if images is not None:
            x, positions = images.place(x, positions, batch)
        return self.run(x, positions, batch)
