"""Qwen3 dense, tensor-parallel and batched: every step carries several sequences, each with its
own KV slot and position offset; the single-sequence step is the batch of one.

The same decoder runs the dense families whose layers differ from Qwen3's only in switches:
Llama and Mistral (no per-head q/k RMSNorm; `attention_bias` on q, k, v and o) and Qwen2 / Qwen2.5
(no q/k norm; biases on q, k and v, none on o)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from neuron.distributed.comm import Communicator
from neuron.errors import ConfigError
from neuron.layers import cpu_decoder
from neuron.layers.kernels import Kernels
from neuron.layers.lora import LoraPool, LoraRows
from neuron.layers.norm import add_rms_norm, norm_rope, rope_heads, silu_mul
from neuron.layers.rope import RopeScaling, Rotary
from neuron.layers.tensor_parallel import (
    HeadLayout,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    Reader,
    RMSNorm,
    RowParallelLinear,
    Shard,
    VocabParallelEmbedding,
)
from neuron.models.base import CausalLM
from neuron.models.inputs import KeptRows, StepBatch
from neuron.models.kv_cache import PagedKVCache
from neuron.models.lora import PeftAdapter


@dataclass(slots=True)
class Qwen3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeScaling
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q, k and v
    o_bias: bool = False
    mlp_bias: bool = False  # Llama's optional biases on gate, up and down
    qk_norm: bool = True  # Qwen3's RMSNorm over each query and key head before the rotary embedding

    @classmethod
    def from_dict(cls, d: dict) -> "Qwen3Config":
        family = d.get("model_type", "qwen3")
        _check_family(family, d)
        try:
            heads = int(d["num_attention_heads"])
            hidden = int(d["hidden_size"])
            cfg = cls(
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_layers=int(d["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope=RopeScaling.from_config(d),
                max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=family == "qwen2" or bool(d.get("attention_bias", False)),
                o_bias=family != "qwen2" and bool(d.get("attention_bias", False)),
                qk_norm=family in ("qwen3", "qwen3_moe"),
                mlp_bias=family in ("llama", "mistral") and bool(d.get("mlp_bias", False)),
            )
        except KeyError as exc:
            raise ConfigError(f"config.json lacks required field {exc.args[0]!r}") from None
        if d.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act {d['hidden_act']!r} is not supported (only 'silu')")
        if d.get("use_sliding_window"):
            raise ConfigError("sliding-window attention (use_sliding_window=true) is not supported")
        return cfg


def _check_family(family: str, d: dict) -> None:
    """Refuse what the shared decoder does not run, naming it."""
    if d.get("mlp_bias") and family not in ("llama", "mistral"):
        raise ConfigError(f"{family}: mlp_bias=true is not supported (biases on the MLP projections)")
    window = d.get("sliding_window")
    if family == "mistral" and window is not None and int(window) < int(d.get("max_position_embeddings", 0)):
        raise ConfigError(f"mistral: sliding-window attention (sliding_window={window}) is not supported; "
                          "neuron attends over the whole context, which changes this model's output past the window")


class Attention:
    def __init__(self, layer: int, qkv, o_proj, q_norm, k_norm, layout: HeadLayout):
        self.layer = layer
        self.qkv, self.o_proj = qkv, o_proj
        self.q_norm, self.k_norm = q_norm, k_norm
        self.heads, self.kv_heads, self.head_dim = layout.local_heads, layout.local_kv_heads, layout.head_dim

    def __call__(self, h: torch.Tensor, batch: StepBatch, rope: tuple, cache: PagedKVCache,
                 kept: KeptRows | None = None) -> torch.Tensor:
        """The attention block's output for every row, or for the `kept` rows alone (every row's key
        and value stored all the same)."""
        t = h.shape[0]
        q, k, v = self.qkv(h, batch.lora)
        q, k = q.view(t, self.heads, self.head_dim), k.view(t, self.kv_heads, self.head_dim)
        if self.q_norm is None:  # Llama, Mistral, Qwen2: the rotary embedding alone
            q, k = rope_heads(self.qkv.kernels, q, *rope), rope_heads(self.qkv.kernels, k, *rope)
        else:
            q = norm_rope(self.q_norm.kernels, q, self.q_norm.weight, self.q_norm.eps, *rope)
            k = norm_rope(self.k_norm.kernels, k, self.k_norm.weight, self.k_norm.eps, *rope)
        cache.write(self.layer, batch, k, v.view(t, self.kv_heads, self.head_dim))
        lora = batch.lora
        if kept is not None:
            q, lora = q[kept.index], kept.lora
        return self.o_proj(cache.attend(self.layer, batch, q, kept).reshape(q.shape[0], -1), lora)


class MLP:
    def __init__(self, gate_up: MergedColumnParallelLinear, down: RowParallelLinear):
        self.gate_up, self.down = gate_up, down

    def __call__(self, x: torch.Tensor, rows: LoraRows | None = None) -> torch.Tensor:
        return self.down(silu_mul(self.gate_up.kernels, *self.gate_up(x, rows)), rows)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output, before the down projection's all-reduce."""
        return self.down.partial(silu_mul(self.gate_up.kernels, *self.gate_up(x)))


class DecoderLayer:
    def __init__(self, attn: Attention, mlp: MLP, input_norm: RMSNorm, post_norm: RMSNorm):
        self.attn, self.mlp = attn, mlp
        self.input_norm, self.post_norm = input_norm, post_norm

    def __call__(self, x, batch: StepBatch, rope: tuple, cache: PagedKVCache, kept: KeptRows | None = None
                 ) -> torch.Tensor:
        post = self.post_norm
        a = self.attn(self.input_norm(x), batch, rope, cache, kept)
        x, h = add_rms_norm(post.kernels, x if kept is None else x[kept.index], a, post.weight, post.eps)
        lora = batch.lora if kept is None else kept.lora
        # a mixture-of-experts block takes no adapter (models/lora.py refuses one that targets it)
        return x + (self.mlp(h) if lora is None or type(self.mlp) is not MLP else self.mlp(h, lora))


def _lora_rows(batch: StepBatch) -> torch.Tensor | None:
    """Each row's LoRA pool slot for the C loop, or None without adapters."""
    return None if batch.lora is None else batch.lora.per_row


class Qwen3ForCausalLM(CausalLM):
    """This rank's share of a Qwen3 model plus its KV block pool."""

    decode_on_device_only = True

    def __init__(self, config: Qwen3Config, comm: Communicator, dtype: torch.dtype, device: torch.device,
                 kernels: Kernels):
        self.config = config
        self.comm = comm
        self.kernels = kernels
        self.dtype = dtype
        self.device = device
        self.shard = Shard(comm.rank, comm.world_size)
        Qwen3ForCausalLM.check_split(config, self.shard)
        self.layout = HeadLayout(config.num_heads, config.num_kv_heads, config.head_dim, self.shard)
        self.layers: list[DecoderLayer] = []
        self.cache: PagedKVCache | None = None
        self._stack: cpu_decoder.DecoderStack | None = None
        self._stack_for: tuple = (None, None)  # the layers and cache the plan points into
        self.lora_slots = 0  # LoRA adapters the pool holds (enable_lora); 0: none

    @staticmethod
    def check_split(config: Qwen3Config, shard: Shard) -> None:
        """Refuse a tensor-parallel size this model's heads and widths do not split into."""
        HeadLayout(config.num_heads, config.num_kv_heads, config.head_dim, shard).validate()
        shard.even(config.intermediate_size, "intermediate_size")

    def load(self, r: Reader, progress: Callable[[int, int], None] | None = None) -> None:
        c, s, dt, dev, k = self.config, self.shard, self.dtype, self.device, self.kernels
        self.embed = VocabParallelEmbedding.load(r, "model.embed_tokens.weight", c.vocab_size, s, self.comm, dt, dev)
        head = "model.embed_tokens.weight" if c.tie_word_embeddings or not r.has("lm_head.weight") else "lm_head.weight"
        self.lm_head = ParallelLMHead.load(r, head, c.vocab_size, s, self.comm, dt, dev, k,
                                           tied=self.embed if head == "model.embed_tokens.weight" else None)
        self.norm = RMSNorm.load(r, "model.norm.weight", c.rms_norm_eps, dt, dev, k)
        self.layers = []
        for i in range(c.num_layers):
            self.layers.append(self._load_layer(r, i))
            if progress:
                progress(i + 1, c.num_layers)

    def _load_layer(self, r: Reader, i: int) -> DecoderLayer:
        c, s, dt, dev, k = self.config, self.shard, self.dtype, self.device, self.kernels
        p = f"model.layers.{i}"
        qkv = QKVParallelLinear.load(r, f"{p}.self_attn", self.layout, dt, dev, k, bias=c.attention_bias)
        o_proj = RowParallelLinear.load(
            r, f"{p}.self_attn.o_proj", c.num_heads * c.head_dim, s, self.comm, dt, dev, k, bias=c.o_bias
        )
        q_norm = k_norm = None
        if c.qk_norm:
            q_norm = RMSNorm.load(r, f"{p}.self_attn.q_norm.weight", c.rms_norm_eps, dt, dev, k)
            k_norm = RMSNorm.load(r, f"{p}.self_attn.k_norm.weight", c.rms_norm_eps, dt, dev, k)
        attn = Attention(i, qkv, o_proj, q_norm, k_norm, self.layout)
        input_norm = RMSNorm.load(r, f"{p}.input_layernorm.weight", c.rms_norm_eps, dt, dev, k)
        post_norm = RMSNorm.load(r, f"{p}.post_attention_layernorm.weight", c.rms_norm_eps, dt, dev, k)
        return DecoderLayer(attn, self.load_mlp(r, i), input_norm, post_norm)

    def load_mlp(self, r: Reader, i: int):
        """Layer i's feed-forward block; a hook for models whose layers differ only there (MoE)."""
        c, s, p = self.config, self.shard, f"model.layers.{i}.mlp"
        gate_up = MergedColumnParallelLinear.load(
            r, [f"{p}.gate_proj", f"{p}.up_proj"], c.intermediate_size, s, self.dtype, self.device, self.kernels,
            bias=c.mlp_bias
        )
        down = RowParallelLinear.load(r, f"{p}.down_proj", c.intermediate_size, s, self.comm, self.dtype, self.device,
                                      self.kernels, bias=c.mlp_bias)
        return MLP(gate_up, down)

    def kv_block_bytes(self, block_size: int) -> int:
        """Bytes of one KV block on this rank: K and V of `block_size` tokens in every layer."""
        c = self.config
        per_token = 2 * c.num_layers * self.layout.local_kv_heads * c.head_dim
        return per_token * block_size * torch.finfo(self.cache_dtype).bits // 8

    def activation_bytes(self, step_tokens: int, max_slots: int, max_model_len: int) -> int:
        """A generous bound on one step's transient memory, kept free of KV blocks on GPUs."""
        c, lay, paged = self.config, self.layout, self.kernels.paged
        size = torch.finfo(self.dtype).bits // 8
        width = 4 * c.hidden_size + (lay.local_heads + 2 * lay.local_kv_heads) * c.head_dim * 2 \
            + 3 * c.intermediate_size // self.shard.world
        hidden = step_tokens * width * size
        # attention: a chunk's scores against a full context, or the gathered K and V (paged: one
        # sequence's, where the reference stands in for a kernel; gather: every slot's at once)
        scores = lay.local_heads * step_tokens * max_model_len * 4
        gathered = 2 * (1 if paged else max_slots) * max_model_len * lay.local_kv_heads * c.head_dim * size
        logits = 3 * max_slots * c.vocab_size * 4  # rank 0 gathers the full vocabulary
        return 2 * (hidden + max(scores, gathered) + logits) + 256 * 2**20

    def allocate(self, num_blocks: int, block_size: int, max_slots: int, max_model_len: int) -> None:
        c = self.config
        self.check_model_len(max_model_len, c.rope.max_len(c.max_position_embeddings))
        self.rotary = Rotary(c.head_dim, c.rope, max_model_len, self.dtype, self.device)
        self.cache = PagedKVCache(c.num_layers, num_blocks, block_size, max_model_len, self.layout.local_kv_heads,
                                  c.head_dim, self.cache_dtype, self.device, self.kernels)

    @torch.inference_mode()
    def forward(self, batch: StepBatch) -> torch.Tensor | None:
        """As CausalLM.forward; a decode step goes from its token ids to its logits in one C++ call
        where the plan also took the embedding and rotary tables (see `run`)."""
        stack = self._logits_stack(batch)
        logits = None if stack is None else stack.run_tokens(batch.token_ids, batch.positions, batch.paged,
                                                             _lora_rows(batch))
        return super().forward(batch) if logits is None else logits

    def run(self, x: torch.Tensor, positions: torch.Tensor, batch: StepBatch) -> torch.Tensor | None:
        """As CausalLM.run; a decode step ends in the same C++ call as the layers where the plan took
        the final norm and head: between a step's streamed weights the caches are cold, and the
        separate norm and head calls cost about 100 us a token on the 191M model."""
        stack = self._logits_stack(batch)
        logits = None if stack is None else stack.run(x, *self.rotary.tables(positions), batch.paged,
                                                      _lora_rows(batch), with_logits=True)
        return super().run(x, positions, batch) if logits is None else logits

    def run_layers(self, x: torch.Tensor, batch: StepBatch, rope: tuple, kept: KeptRows | None = None
                   ) -> torch.Tensor:
        """Every layer in one C++ call where the plan takes the model and the step takes the plan
        (CPU fp32, dense layers, a small step: cpu_decoder.py), else one layer after the other."""
        stack = self._decoder_stack()
        out = None if stack is None else stack.run(x, *rope, batch.paged, _lora_rows(batch), kept=kept)
        return super().run_layers(x, batch, rope, kept) if out is None else out

    def _logits_stack(self, batch: StepBatch) -> cpu_decoder.DecoderStack | None:
        """The plan, where the step may end in its call with every row's logits: a decode step (each
        row wants its logits; no prompt logprobs, no pooling) and a plan that took the head (tp 1)."""
        if not (batch.all_decode and batch.prompt_topk is None and batch.pool is None):
            return None
        stack = self._decoder_stack()
        return stack if stack is not None and stack.head is not None else None

    def _decoder_stack(self) -> cpu_decoder.DecoderStack | None:
        """The plan of the layers and cache the model holds now, built the first time they are seen."""
        layers, cache = self._stack_for
        if layers is not self.layers or cache is not self.cache:
            self._stack, self._stack_for = self._build_stack(), (self.layers, self.cache)
        return self._stack

    def _build_stack(self) -> cpu_decoder.DecoderStack | None:
        k, c, lay = self.kernels, self.config, self.layout
        if not (k.fused_layers and k.cpu_ops and k.paged and type(self.cache) is PagedKVCache and self.layers):
            return None
        if any(type(layer) is not DecoderLayer or type(layer.attn) is not Attention or type(layer.mlp) is not MLP
               for layer in self.layers):
            return None  # a MoE block, or a layer of another model built on this one
        norms = [n for layer in self.layers for n in (layer.input_norm, layer.post_norm, layer.attn.q_norm,
                                                      layer.attn.k_norm) if n is not None]
        if len({n.eps for n in norms}) != 1:
            return None
        weights = [self._layer_weights(i, layer) for i, layer in enumerate(self.layers)]
        stack = cpu_decoder.DecoderStack.build(weights, c.hidden_size, lay.local_heads, lay.local_kv_heads,
                                               c.head_dim, self.layers[0].mlp.gate_up.sizes[0], norms[0].eps,
                                               self.comm, k)
        if stack is not None and type(self.norm) is RMSNorm and type(self.lm_head) is ParallelLMHead:
            if stack.attach_head(self.norm.weight, self.norm.eps, self.lm_head.weight, self.lm_head.vocab,
                                 self.lm_head.kernels) and type(self.embed) is VocabParallelEmbedding:
                stack.attach_inputs(self.embed.weight, self.rotary.cos, self.rotary.sin)
        return stack

    def _layer_weights(self, i: int, layer: DecoderLayer) -> cpu_decoder.LayerWeights:
        a, m = layer.attn, layer.mlp
        return cpu_decoder.LayerWeights(
            layer.input_norm.weight, a.qkv.weight, a.qkv.bias, None if a.q_norm is None else a.q_norm.weight,
            None if a.k_norm is None else a.k_norm.weight, a.o_proj.weight, a.o_proj.bias, layer.post_norm.weight, m.gate_up.weight,
            m.gate_up.bias, m.down.weight, m.down.bias, self.cache.k[i], self.cache.v[i],
            {name: pool for name, pool in (("qkv", a.qkv.lora), ("o", a.o_proj.lora), ("gate_up", m.gate_up.lora),
                                           ("down", m.down.lora)) if pool is not None})

    # ---- LoRA adapters (layers/lora.py, models/lora.py) ----

    def enable_lora(self, slots: int, rank: int) -> None:
        """A pool of `slots` adapters of rank up to `rank` beside every attention projection and every
        dense MLP's, sharded like the projection (a mixture-of-experts block has none)."""
        lay, c, dt, dev, k = self.layout, self.config, self.dtype, self.device, self.kernels
        q, kv, hidden = lay.local_heads * c.head_dim, lay.local_kv_heads * c.head_dim, c.hidden_size
        for layer in self.layers:
            a, m = layer.attn, layer.mlp
            a.qkv.lora = LoraPool(slots, rank, hidden, [(0, q), (q, kv), (q + kv, kv)], dt, dev, k)
            a.o_proj.lora = LoraPool(slots, rank, q, [(0, hidden)], dt, dev, k)
            if type(m) is MLP:
                inter = m.gate_up.sizes[0]
                m.gate_up.lora = LoraPool(slots, rank, hidden, [(0, inter), (inter, inter)], dt, dev, k)
                m.down.lora = LoraPool(slots, rank, inter, [(0, hidden)], dt, dev, k)
        self.lora_slots = slots
        self._stack_for = (None, None)  # the C loop's plan is built anew, with the pools

    def lora_share(self, adapter: PeftAdapter, reader) -> list[tuple[LoraPool, int, torch.Tensor, torch.Tensor]]:
        """This rank's share of `adapter` (read through `reader`): for every projection it adapts,
        the pool, the projection's part in it, A and scaled B, sliced like the base weight."""
        c, s, lay = self.config, self.shard, self.layout
        d = c.head_dim
        q_rows = (s.rank * lay.local_heads * d, (s.rank + 1) * lay.local_heads * d)
        kv_rows = tuple(h * d for h in lay.kv_head_range())
        mlp_rows = s.even(c.intermediate_size, "intermediate_size")
        share = []
        for i, layer in enumerate(self.layers):
            a = layer.attn
            parts = [(a.qkv.lora, 0, "q_proj", None, q_rows), (a.qkv.lora, 1, "k_proj", None, kv_rows),
                     (a.qkv.lora, 2, "v_proj", None, kv_rows), (a.o_proj.lora, 0, "o_proj", q_rows, None)]
            if type(m := layer.mlp) is MLP:
                parts += [(m.gate_up.lora, 0, "gate_proj", None, mlp_rows),
                          (m.gate_up.lora, 1, "up_proj", None, mlp_rows), (m.down.lora, 0, "down_proj", mlp_rows, None)]
            for pool, part, proj, a_cols, b_rows in parts:
                ab = adapter.read(reader, i, proj, a_cols, b_rows)
                if ab is not None:
                    share.append((pool, part, ab[0].to(self.dtype), ab[1].to(self.dtype)))
        return share

    def put_lora(self, slot: int, share: list | None) -> None:
        """Fill pool slot `slot` with an adapter's share (lora_share), or empty it (None)."""
        for layer in self.layers:
            mlp = (layer.mlp.gate_up.lora, layer.mlp.down.lora) if type(layer.mlp) is MLP else ()
            for pool in (layer.attn.qkv.lora, layer.attn.o_proj.lora, *mlp):
                pool.clear(slot)
        for pool, part, a, b in share or []:
            pool.set(slot, part, a, b)

    def layer_tensors(self, layer) -> list[torch.Tensor]:
        a, m = layer.attn, layer.mlp
        return [a.qkv.weight, a.o_proj.weight, m.gate_up.weight, m.down.weight]
