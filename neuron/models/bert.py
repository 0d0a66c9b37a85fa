"""BERT, RoBERTa, XLM-RoBERTa, DistilBERT and MPNet encoders, tensor-parallel: the embedding and
reranking models people run beside a chat model (sentence-transformers' MiniLM and mpnet, BGE, E5,
GTE, bge-reranker, the ms-marco cross-encoders). The families differ in names (`Layout`;
DistilBERT's config too: `standard_config`), in where positions start, in token types, and in
MPNet's relative-position bias on every layer's scores (`relative_buckets`); the layers are one.

An encoder attends in both directions, so a token's output depends on the tokens after it: an
input runs whole in one step (the scheduler never cuts it into chunks, engine/scheduler.py) and
keeps nothing between steps, so the model holds no KV pool; its `cache` only refuses a step that
does not start an input at its first token. Each layer is post-norm: attention (q, k and v
column-parallel with biases, the output row-parallel), a residual and LayerNorm, then an MLP
(GELU; ReLU where the config says), a residual and LayerNorm (ModernBERT's pre-norm layers are
modernbert.py's, on the same frame). The embeddings add learned absolute positions (RoBERTa's counted after
its padding id, as transformers counts them) and token types: a pair's second text (from where its
step says it starts, `SeqStep.types_from`) is type 1 where the model has two types, as the
tokenizer's pair template marks it. Rank 0 pools the last layer's output (models/pooling.py); the
classification heads run on the leader (engine/classifier.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from neuron.distributed.comm import Communicator
from neuron.errors import ConfigError
from neuron.layers import quantized
from neuron.layers.kernels import Kernels
from neuron.layers.tensor_parallel import (
    ColumnParallelLinear,
    HeadLayout,
    QKVParallelLinear,
    Reader,
    RowParallelLinear,
    Shard,
    VocabParallelEmbedding,
)
from neuron.models import pooling
from neuron.models.inputs import StepBatch, StepRejected

_ROBERTA = ("roberta", "xlm-roberta")
_NO_TYPES = ("distilbert", "mpnet", "modernbert")  # families without a token-type table
# hidden_act values and the activation each is in transformers (F.gelu's `approximate`, or ReLU)
_ACTIVATIONS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "relu": "relu"}
# where a checkpoint keeps the encoder: a bare model's names, or under its task model's prefix
_PREFIXES = ("", "bert.", "roberta.", "distilbert.", "mpnet.", "model.")
# DistilBERT's config.json names, as the standard ones (transformers' attribute_map, and its FFN width)
_DISTILBERT_KEYS = {"dim": "hidden_size", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
                    "hidden_dim": "intermediate_size", "activation": "hidden_act"}


@dataclass(frozen=True, slots=True)
class Layout:
    """A family's tensor names within layer `layer.format(i)`: its attention's q, k and v (under
    `attn`, as q_proj, k_proj, v_proj are read), the attention output, its norm, the MLP's two
    projections and the closing norm."""

    layer: str
    attn: str
    qkv: tuple[str, str, str]
    o: str
    attn_norm: str
    up: str
    down: str
    out_norm: str


BERT_LAYOUT = Layout("encoder.layer.{}", "attention.self", ("query", "key", "value"), "attention.output.dense",
                     "attention.output.LayerNorm", "intermediate.dense", "output.dense", "output.LayerNorm")
DISTILBERT_LAYOUT = Layout("transformer.layer.{}", "attention", ("q_lin", "k_lin", "v_lin"), "attention.out_lin",
                           "sa_layer_norm", "ffn.lin1", "ffn.lin2", "output_layer_norm")
MPNET_LAYOUT = Layout("encoder.layer.{}", "attention.attn", ("q", "k", "v"), "attention.attn.o", "attention.LayerNorm",
                      "intermediate.dense", "output.dense", "output.LayerNorm")
MPNET_BIAS = "encoder.relative_attention_bias.weight"  # [buckets, heads], shared by every layer
_MPNET_BUCKETS, _MPNET_EXACT, _MPNET_REACH = 32, 8, 128  # both sides together; exact offsets a side; log range


def layout(config: dict) -> Layout:
    return {"distilbert": DISTILBERT_LAYOUT, "mpnet": MPNET_LAYOUT}.get(config.get("model_type"), BERT_LAYOUT)


def relative_buckets(n: int, device) -> torch.Tensor:
    """MPNet's bucket for every query and key of an input of `n` tokens ([n, n]): half the buckets
    for keys before the query, half for keys after; within a side the first offsets exactly, the
    rest on a log scale out to _MPNET_REACH positions, the farthest sharing the last bucket."""
    at = torch.arange(n, device=device)
    offset = at[:, None] - at[None, :]  # the query's position less the key's
    side = _MPNET_BUCKETS // 2
    distance = offset.abs()
    far = _MPNET_EXACT + (torch.log(distance.float().clamp(min=1) / _MPNET_EXACT)
                          / math.log(_MPNET_REACH / _MPNET_EXACT) * (side - _MPNET_EXACT)).long()
    near = distance < _MPNET_EXACT
    return (offset < 0).long() * side + torch.where(near, distance, far.clamp(max=side - 1))


def standard_config(config: dict) -> dict:
    """DistilBERT's config.json with the standard names beside its own (hidden_size for dim, ...),
    as transformers reads them, so every part of neuron reads one set; any other as it is."""
    if config.get("model_type") != "distilbert":
        return config
    return {**{std: config[own] for own, std in _DISTILBERT_KEYS.items() if own in config}, **config}


def token_types(config: dict) -> int:
    """How many token types the model embeds: none for DistilBERT, MPNet and ModernBERT (no table), else its
    config's."""
    return 0 if config.get("model_type") in _NO_TYPES else int(config.get("type_vocab_size", 2))


def roberta_padding(config: dict) -> int | None:
    """RoBERTa's padding id, past which its positions are counted (transformers' default 1); None
    for BERT, whose positions start at 0."""
    if config.get("model_type") == "mpnet":
        return 1  # transformers' MPNet counts past 1 whatever the config's pad_token_id
    if config.get("model_type") not in _ROBERTA:
        return None
    pad = config.get("pad_token_id")
    return 1 if pad is None else int(pad)


def position_offset(config: dict) -> int:
    """How far an input's first position lies past row 0 of the table: RoBERTa's padding id plus one."""
    pad = roberta_padding(config)
    return 0 if pad is None else pad + 1


@dataclass(slots=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    layer_norm_eps: float
    max_position_embeddings: int
    type_vocab_size: int  # 0: no token-type table (DistilBERT)
    activation: str  # F.gelu's `approximate`, or relu
    position_offset: int  # RoBERTa: positions start after the padding id
    padding: int | None  # RoBERTa's padding id, past which it counts positions; None: BERT's from 0
    names: Layout = BERT_LAYOUT  # the family's tensor names
    relative: bool = False  # MPNet: a learned bias per head and relative-position bucket on every layer's scores

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def max_len(self) -> int:
        """The longest input: the position table's rows past RoBERTa's offset."""
        return self.max_position_embeddings - self.position_offset

    @classmethod
    def from_dict(cls, d: dict) -> BertConfig:
        act = d.get("hidden_act", "gelu")
        if act not in _ACTIVATIONS:
            raise ConfigError(f"hidden_act {act!r} is not supported for an encoder ({', '.join(_ACTIVATIONS)} are)")
        kind = d.get("position_embedding_type", "absolute")
        if kind != "absolute":
            raise ConfigError(f"position_embedding_type {kind!r} is not supported (absolute positions only)")
        try:
            heads, hidden = int(d["num_attention_heads"]), int(d["hidden_size"])
            cfg = cls(vocab_size=int(d["vocab_size"]), hidden_size=hidden,
                      intermediate_size=int(d["intermediate_size"]), num_layers=int(d["num_hidden_layers"]),
                      num_heads=heads, layer_norm_eps=float(d.get("layer_norm_eps", 1e-12)),
                      max_position_embeddings=int(d.get("max_position_embeddings", 512)),
                      type_vocab_size=token_types(d), activation=_ACTIVATIONS[act],
                      position_offset=position_offset(d), padding=roberta_padding(d),
                      names=layout(d), relative=d.get("model_type") == "mpnet")
        except KeyError as exc:
            raise ConfigError(f"config.json lacks required field {exc.args[0]!r}") from None
        if hidden % heads:
            raise ConfigError(f"hidden_size ({hidden}) is not a multiple of num_attention_heads ({heads})")
        if cfg.max_len < 2:
            raise ConfigError(f"max_position_embeddings ({cfg.max_position_embeddings}) leaves no positions past "
                              f"the padding id ({cfg.position_offset - 1})")
        return cfg


class _Named(Reader):
    """The checkpoint under the names the shared layers ask for: the encoder's prefix in front, and
    q_proj, k_proj, v_proj as the family names them (BERT's query, key and value)."""

    def __init__(self, inner: Reader, prefix: str, qkv: tuple[str, str, str]):
        self.inner, self.prefix = inner, prefix
        self.proj = {f".{ours}.": f".{theirs}." for ours, theirs in zip(("q_proj", "k_proj", "v_proj"), qkv)}

    def _name(self, name: str) -> str:
        for ours, theirs in self.proj.items():
            name = name.replace(ours, theirs)
        return self.prefix + name

    def read(self, name, dim=None, start=0, end=None):
        return self.inner.read(self._name(name), dim, start, end)

    def read_weight(self, name, dim=None, start=0, end=None, vocab=False):
        return self.inner.read_weight(self._name(name), dim, start, end, vocab)

    def has(self, name: str) -> bool:
        return self.inner.has(self._name(name))

    def shape(self, name: str):
        return self.inner.shape(self._name(name))

    def source(self, name: str) -> str:
        return self.inner.source(self._name(name))


@dataclass(slots=True)
class LayerNorm:
    weight: torch.Tensor
    bias: torch.Tensor | None
    eps: float

    @classmethod
    def load(cls, r: Reader, prefix: str, eps: float, dtype, device, bias: bool = True) -> LayerNorm:
        weight = r.read(f"{prefix}.weight").to(device=device, dtype=dtype)
        return cls(weight, r.read(f"{prefix}.bias").to(device=device, dtype=dtype) if bias else None, eps)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class EncoderLayer:
    def __init__(self, qkv: QKVParallelLinear, o: RowParallelLinear, attn_norm: LayerNorm,
                 up: ColumnParallelLinear, down: RowParallelLinear, out_norm: LayerNorm, activation: str):
        self.qkv, self.o, self.attn_norm = qkv, o, attn_norm
        self.up, self.down, self.out_norm = up, down, out_norm
        self.activation = activation
        lay = qkv.layout
        self.heads, self.head_dim = lay.local_heads, lay.head_dim

    def __call__(self, x: torch.Tensor, lengths: list[int], bias: Callable[[int], torch.Tensor] | None = None
                 ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = (part.view(t, self.heads, self.head_dim) for part in self.qkv(x))
        x = self.attn_norm(x + self.o(attend_both_ways(q, k, v, lengths, bias)))
        h = self.up(x)
        h = F.relu(h) if self.activation == "relu" else F.gelu(h, approximate=self.activation)
        return self.out_norm(x + self.down(h))


def attend_both_ways(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int],
                     mask: Callable[[int], torch.Tensor | None] | None = None) -> torch.Tensor:
    """Every input's queries ([tokens, heads, head_dim]) over all of its own keys, in both
    directions; [tokens, heads * head_dim]. `mask(n)`: what an input of n tokens' scores take
    (PyTorch's attn_mask: MPNet's bias added to them, ModernBERT's window of keys kept), or None.
    Each input as [1, heads, n, head_dim]: given three dimensions, PyTorch's CPU attention takes
    its reference path, 4x slower at BERT-base's 12 heads of 64."""
    out = torch.empty(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype, device=q.device)
    start = 0
    for n in lengths:
        heads = [t[start:start + n].unsqueeze(0).transpose(1, 2) for t in (q, k, v)]
        kept = None if mask is None else mask(n)
        out[start:start + n] = F.scaled_dot_product_attention(*heads, attn_mask=kept)[0].transpose(0, 1).reshape(n, -1)
        start += n
    return out


def per_length(make: Callable[[int], torch.Tensor | None]) -> Callable[[int], torch.Tensor | None]:
    """`make`, each length's result kept: a step's inputs of one length, in every layer, share it."""
    made: dict[int, torch.Tensor | None] = {}

    def get(n: int) -> torch.Tensor | None:
        if n not in made:
            made[n] = make(n)
        return made[n]

    return get


class _NoCache:
    """An encoder keeps nothing between steps: what the model runner asks of a KV cache, with the
    one check an encoder needs (every step starts its inputs at their first token)."""

    paged = False

    def check(self, seqs: list, vocab_size: int) -> None:
        for s in seqs:
            if s.offset != 0:
                raise StepRejected(f"slot {s.slot}: an encoder runs an input whole, in one step from its first token "
                                   f"(this step starts at position {s.offset})")
            if s.types_from is not None and not 0 <= s.types_from <= len(s.token_ids):
                raise StepRejected(f"slot {s.slot}: the second token type starts at {s.types_from}, outside the "
                                   f"input's {len(s.token_ids)} tokens")

    def begin(self, seqs: list) -> None:
        """A step starts."""

    def commit(self, batch: StepBatch) -> None:
        """The step ran."""

    def clear(self, slots: list[int] | None) -> None:
        """The slots' inputs are gone; nothing was kept of them."""


class BertModel:
    """This rank's share of a BERT-family encoder."""

    decode_on_device_only = False
    kv_dtype: torch.dtype | None = None
    lora_slots = 0

    def __init__(self, config: BertConfig, comm: Communicator, dtype: torch.dtype, device: torch.device,
                 kernels: Kernels):
        self.config, self.comm, self.dtype, self.device, self.kernels = config, comm, dtype, device, kernels
        self.shard = Shard(comm.rank, comm.world_size)
        BertModel.check_split(config, self.shard)
        self.layout = HeadLayout(config.num_heads, config.num_heads, config.head_dim, self.shard)
        self.layers: list[EncoderLayer] = []
        self.cache: _NoCache | None = None
        self.relative: torch.Tensor | None = None  # MPNet's bias table, this rank's heads

    @staticmethod
    def check_split(config: BertConfig, shard: Shard) -> None:
        """Refuse a tensor-parallel size this model's heads and widths do not split into."""
        HeadLayout(config.num_heads, config.num_heads, config.head_dim, shard).validate()
        shard.even(config.intermediate_size, "intermediate_size")

    def load(self, r: Reader, progress: Callable[[int, int], None] | None = None) -> None:
        c, s, dt, dev, k = self.config, self.shard, self.dtype, self.device, self.kernels
        prefix = next((p for p in _PREFIXES if r.has(f"{p}embeddings.word_embeddings.weight")), None)
        if prefix is None:
            raise ConfigError("an encoder checkpoint needs embeddings.word_embeddings.weight (under "
                              f"{', '.join(p for p in _PREFIXES if p)} or no prefix)")
        names = c.names
        r = _Named(r, prefix, names.qkv)
        self.embed = VocabParallelEmbedding.load(r, "embeddings.word_embeddings.weight", c.vocab_size, s, self.comm,
                                                 dt, dev)
        # (every read's shape is checked against the config's: weight_shapes.py)
        self.positions = r.read("embeddings.position_embeddings.weight").to(device=dev, dtype=dt)
        self.token_types = None if not c.type_vocab_size else \
            r.read("embeddings.token_type_embeddings.weight").to(device=dev, dtype=dt)
        self.embed_norm = LayerNorm.load(r, "embeddings.LayerNorm", c.layer_norm_eps, dt, dev)
        heads = self.layout.local_heads
        self.relative = None if not c.relative else \
            r.read(MPNET_BIAS, 1, self.shard.rank * heads, (self.shard.rank + 1) * heads).to(device=dev, dtype=dt)
        self.layers = []
        for i in range(c.num_layers):
            p = names.layer.format(i)

            def norm(name: str) -> LayerNorm:
                return LayerNorm.load(r, f"{p}.{name}", c.layer_norm_eps, dt, dev)

            qkv = QKVParallelLinear.load(r, f"{p}.{names.attn}", self.layout, dt, dev, k, bias=True)
            o = RowParallelLinear.load(r, f"{p}.{names.o}", c.hidden_size, s, self.comm, dt, dev, k, bias=True)
            up = ColumnParallelLinear.load(r, f"{p}.{names.up}", c.intermediate_size, s, dt, dev, k, bias=True)
            down = RowParallelLinear.load(r, f"{p}.{names.down}", c.intermediate_size, s, self.comm, dt, dev, k,
                                          bias=True)
            self.layers.append(EncoderLayer(qkv, o, norm(names.attn_norm), up, down, norm(names.out_norm),
                                            c.activation))
            if progress:
                progress(i + 1, c.num_layers)

    def layer_tensors(self, layer: EncoderLayer) -> list[torch.Tensor]:
        return [layer.qkv.weight, layer.o.weight, layer.up.weight, layer.down.weight]

    def weight_bytes(self) -> int:
        tensors = [t for t in (self.embed.weight, self.positions, self.token_types, self.relative) if t is not None]
        for layer in self.layers:
            tensors += self.layer_tensors(layer)
        return sum(t.numel() * t.element_size() for w in tensors for t in quantized.tensors(w))

    def kv_block_bytes(self, block_size: int) -> int:
        return 0  # nothing is kept between steps

    def activation_bytes(self, step_tokens: int, max_slots: int, max_model_len: int) -> int:
        """A generous bound on one step's transient memory: the hidden states and MLP rows, and one
        input's attention scores at full length."""
        c, size = self.config, torch.finfo(self.dtype).bits // 8
        hidden = step_tokens * (6 * c.hidden_size + 2 * c.intermediate_size // self.shard.world) * size
        scores = self.layout.local_heads * max_model_len * max_model_len * 4
        return 2 * (hidden + scores) + 256 * 2**20

    def allocate(self, num_blocks: int, block_size: int, max_slots: int, max_model_len: int) -> None:
        if max_model_len > self.config.max_len:
            raise ConfigError(f"max_model_len {max_model_len} exceeds the encoder's {self.config.max_len} positions")
        self.cache = _NoCache()

    @staticmethod
    def norm(x: torch.Tensor) -> torch.Tensor:
        """What pooling reads: the last layer's output as it is (each layer ends in its own norm)."""
        return x

    @torch.inference_mode()
    def forward(self, batch: StepBatch) -> None:
        """Encode every input of the step; rank 0 keeps what pooling asks of each. No logits: an
        encoder generates nothing."""
        ids = batch.token_ids
        positions, types = self._positions_and_types(ids, batch)
        x = self.embed(ids) + self.positions[positions]
        if self.token_types is not None:
            x = x + self.token_types[types]
        x = self.embed_norm(x)
        bias = None if self.relative is None else self._relative_bias()
        for layer in self.layers:
            x = layer(x, batch.lengths, bias)
        if batch.pool is not None and self.comm.rank == 0:
            batch.pool_out = pooling.compute(self, x, batch)
        return None

    def _relative_bias(self) -> Callable[[int], torch.Tensor]:
        """MPNet's score bias for an input of n tokens ([1, this rank's heads, n, n]), made once a
        step for each length the step holds."""
        return per_length(lambda n: self.relative[relative_buckets(n, self.device)].permute(2, 0, 1).unsqueeze(0))

    def _positions_and_types(self, ids: torch.Tensor, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's row of the position table (RoBERTa: counted over the non-padding tokens past
        the padding id, as transformers counts them) and its token type (1 from where a pair's
        second text starts, `SeqStep.types_from`, where the model has a second type)."""
        c = self.config
        types = torch.zeros_like(ids)
        positions = batch.positions if c.padding is None else torch.empty_like(ids)
        start, pair = 0, batch.types_from if c.type_vocab_size > 1 else None
        for k, n in enumerate(batch.lengths):
            part = ids[start:start + n]
            if c.padding is not None:
                real = part.ne(c.padding).to(ids.dtype)
                positions[start:start + n] = real.cumsum(0) * real + c.padding
            if pair is not None and pair[k] is not None:
                types[start + pair[k]:start + n] = 1
            start += n
        return positions, types
