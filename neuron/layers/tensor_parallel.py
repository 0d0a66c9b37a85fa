"""Every tensor-parallel layer of neuron, each rank reading only its slice of the checkpoint.

Column-parallel layers split the output dimension and need no communication; row-parallel
layers split the input dimension and sum their partial outputs with one all-reduce. A layer is a
plain object holding tensors: the decode path stays short enough to read and cheap to call. The
layers that choose between kernels hold the model's `Kernels`, given at load.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from neuron.distributed.comm import Communicator
from neuron.errors import ConfigError
from neuron.layers import quantized
from neuron.layers.cpu_linear import held, linear
from neuron.layers.cpu_ops import PanelWeight
from neuron.layers.kernels import Kernels
from neuron.layers.lora import LoraPool, LoraRows
from neuron.layers.norm import rms_norm
from neuron.layers.quantized import QuantizedWeight, Weight


@dataclass(slots=True, frozen=True)
class Shard:
    """Where this rank sits: its index and the number of ranks."""

    rank: int
    world: int

    def even(self, size: int, what: str) -> tuple[int, int]:
        """This rank's [start, end) of a dimension that must split evenly."""
        if size % self.world:
            raise ConfigError(f"{what} ({size}) is not divisible by the tensor-parallel size {self.world}")
        per = size // self.world
        return self.rank * per, (self.rank + 1) * per

    def padded(self, size: int) -> tuple[int, int, int]:
        """This rank's [start, end) of a dimension that may not divide (the vocabulary), and the
        common padded shard size; the last shards may be short or empty."""
        per = -(-size // self.world)
        start = min(size, self.rank * per)
        return start, min(size, start + per), per


class Reader:
    """What layers need from a checkpoint: a tensor or a slice of one along a dimension."""

    def read(self, name: str, dim: int | None = None, start: int = 0, end: int | None = None) -> torch.Tensor:
        raise NotImplementedError

    def has(self, name: str) -> bool:
        raise NotImplementedError

    def shape(self, name: str) -> list[int] | None:
        """The full shape of tensor `name` as a layer sees it, without reading it; None where the
        format stores it packed and only a read tells."""
        return None

    def source(self, name: str) -> str:
        """The file that holds tensor `name`, for messages."""
        return "the checkpoint"

    def inputs_order(self, name: str) -> str | None:
        """How the inputs (columns) of weight `name` are ordered where not as transformers orders
        them: "tiled" for Qwen3.5's out_proj read from a GGUF file (this rank's value heads key head
        fastest, as llama.cpp stores them); None otherwise. Wrappers ask the reader they wrap."""
        inner = getattr(self, "inner", None)
        return inner.inputs_order(name) if isinstance(inner, Reader) else None

    def read_weight(self, name: str, dim: int | None = None, start: int = 0, end: int | None = None,
                    vocab: bool = False) -> torch.Tensor | QuantizedWeight:
        """A linear layer's weight (or this rank's slice of it): quantized where the checkpoint
        stores it so or the reader quantizes at load, else as `read` gives it. `vocab`: the rows of
        an embedding or LM head, which load-time quantization leaves as read (a head's then go
        through `head_weight`)."""
        return self.read(name, dim, start, end)

    def head_weight(self, w: Weight) -> Weight:
        """What an LM head's rows `w` (this rank's, as read) are held as: as read, unless the reader
        quantizes at load in a format that takes the head too."""
        return w

    def close(self) -> None:
        """Let go of the files; a reader is used in a `with` block."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _place(t: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return t.to(device=device, dtype=dtype).contiguous()


def _weight(r: Reader, parts: list[tuple[str, int, int, int | None]], dtype, device) -> Weight:
    """A linear layer's weight: `parts` (name, dim, start, end) read and stacked along the outputs,
    dense in `dtype` or kept quantized as read."""
    ws = [r.read_weight(name, dim, a, b) for name, dim, a, b in parts]
    if all(isinstance(w, torch.Tensor) for w in ws):
        return _place(ws[0] if len(ws) == 1 else torch.cat(ws), dtype, device)
    return quantized.stack(ws, dtype, device)


class ColumnParallelLinear:
    """y = x W^T with W's rows (outputs) split across ranks; each rank keeps its output slice."""

    def __init__(self, weight: torch.Tensor, kernels: Kernels, bias: torch.Tensor | None = None):
        self.weight = held(weight, kernels)
        self.kernels = kernels
        self.bias = bias

    @classmethod
    def load(cls, r: Reader, prefix: str, out_features: int, shard: Shard, dtype, device, kernels: Kernels,
             bias=False):
        start, end = shard.even(out_features, f"{prefix} outputs")
        w = _weight(r, [(f"{prefix}.weight", 0, start, end)], dtype, device)
        b = _place(r.read(f"{prefix}.bias", 0, start, end), dtype, device) if bias else None
        return cls(w, kernels, b)

    @classmethod
    def load_ranges(cls, r: Reader, parts: list[tuple[str, int, int]], dtype, device, kernels: Kernels, bias=False):
        """Rows [start, end) of each named projection, stacked into one matmul: for fused
        checkpoints whose per-head groups make a rank's share several runs of rows."""
        w = _weight(r, [(f"{name}.weight", 0, a, b) for name, a, b in parts], dtype, device)
        b = torch.cat([r.read(f"{name}.bias", 0, a, b) for name, a, b in parts]) if bias else None
        return cls(w, kernels, None if b is None else _place(b, dtype, device))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return linear(self, x, self.weight, self.bias)


class RowParallelLinear:
    """y = sum_over_ranks(x_r W_r^T) + b with W's columns (inputs) split across ranks."""

    def __init__(self, weight: torch.Tensor, comm: Communicator, kernels: Kernels, bias: torch.Tensor | None = None):
        self.weight = held(weight, kernels)
        self.bias = bias
        self.comm = comm
        self.kernels = kernels
        self.lora: LoraPool | None = None  # adapters (layers/lora.py): A's columns of this rank's inputs

    @classmethod
    def load(cls, r: Reader, prefix: str, in_features: int, shard: Shard, comm, dtype, device, kernels: Kernels,
             bias=False):
        start, end = shard.even(in_features, f"{prefix} inputs")
        w = _weight(r, [(f"{prefix}.weight", 1, start, end)], dtype, device)
        b = _place(r.read(f"{prefix}.bias"), dtype, device) if bias else None
        return cls(w, comm, kernels, b)

    def __call__(self, x: torch.Tensor, rows: LoraRows | None = None) -> torch.Tensor:
        y = self.partial(x, rows)
        self.comm.all_reduce(y)
        return y if self.bias is None else y + self.bias

    def partial(self, x: torch.Tensor, rows: LoraRows | None = None) -> torch.Tensor:
        """This rank's share of the output, before the all-reduce and the bias: for a block that
        sums several row-parallel outputs (a MoE's shared expert) and reduces once. The rows'
        adapters add their share here, so it joins the same all-reduce."""
        y = linear(self, x, self.weight)
        return y if rows is None or self.lora is None else self.lora.add_to(y, x, rows)


@dataclass(slots=True, frozen=True)
class HeadLayout:
    """How attention heads land on ranks. Query heads split evenly; KV heads split evenly when
    there are at least as many as ranks, otherwise each is replicated on world/num_kv ranks."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    shard: Shard

    @property
    def local_heads(self) -> int:
        return self.num_heads // self.shard.world

    @property
    def local_kv_heads(self) -> int:
        return max(1, self.num_kv_heads // self.shard.world)

    def validate(self) -> None:
        w = self.shard.world
        if self.num_heads % w:
            raise ConfigError(f"num_attention_heads ({self.num_heads}) is not divisible by tp={w}")
        if self.num_kv_heads >= w and self.num_kv_heads % w:
            raise ConfigError(f"num_key_value_heads ({self.num_kv_heads}) is not divisible by tp={w}")
        if self.num_kv_heads < w and w % self.num_kv_heads:
            raise ConfigError(f"tp={w} is not a multiple of num_key_value_heads ({self.num_kv_heads})")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")

    def kv_head_range(self) -> tuple[int, int]:
        w, r = self.shard.world, self.shard.rank
        if self.num_kv_heads >= w:
            per = self.num_kv_heads // w
            return r * per, (r + 1) * per
        head = r // (w // self.num_kv_heads)
        return head, head + 1


class QKVParallelLinear:
    """q, k and v projections fused into one column-parallel matmul over this rank's heads."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, layout: HeadLayout, kernels: Kernels):
        self.weight = held(weight, kernels)
        self.bias = bias
        self.layout = layout
        self.kernels = kernels
        d = layout.head_dim
        self.sizes = (layout.local_heads * d, layout.local_kv_heads * d, layout.local_kv_heads * d)
        self.lora: LoraPool | None = None  # adapters (layers/lora.py): B's rows of this rank's heads

    @classmethod
    def load(cls, r: Reader, prefix: str, layout: HeadLayout, dtype, device, kernels: Kernels, bias=False):
        layout.validate()
        d, s = layout.head_dim, layout.shard
        q0, q1 = s.rank * layout.local_heads * d, (s.rank + 1) * layout.local_heads * d
        k0, k1 = (h * d for h in layout.kv_head_range())
        parts = [(f"{prefix}.q_proj", q0, q1), (f"{prefix}.k_proj", k0, k1), (f"{prefix}.v_proj", k0, k1)]
        w = _weight(r, [(f"{name}.weight", 0, a, b) for name, a, b in parts], dtype, device)
        b = torch.cat([r.read(f"{name}.bias", 0, a, b) for name, a, b in parts]) if bias else None
        return cls(w, None if b is None else _place(b, dtype, device), layout, kernels)

    def __call__(self, x: torch.Tensor, rows: LoraRows | None = None) -> tuple[torch.Tensor, ...]:
        return _with_adapters(self, x, linear(self, x, self.weight, self.bias), rows).split(self.sizes, dim=-1)


class MergedColumnParallelLinear:
    """Several column-parallel projections of the same input (gate and up) in one matmul."""

    def __init__(self, weight: torch.Tensor, sizes: tuple[int, ...], kernels: Kernels,
                 bias: torch.Tensor | None = None):
        self.weight = held(weight, kernels)
        self.sizes = sizes
        self.kernels = kernels
        self.bias = bias
        self.lora: LoraPool | None = None  # adapters (layers/lora.py): B's rows of this rank's outputs

    @classmethod
    def load(cls, r: Reader, prefixes: list[str], out_features: int, shard: Shard, dtype, device, kernels: Kernels,
             bias=False):
        start, end = shard.even(out_features, f"{prefixes[0]} outputs")
        w = _weight(r, [(f"{p}.weight", 0, start, end) for p in prefixes], dtype, device)
        b = _place(torch.cat([r.read(f"{p}.bias", 0, start, end) for p in prefixes]), dtype, device) if bias else None
        return cls(w, (end - start,) * len(prefixes), kernels, b)

    def __call__(self, x: torch.Tensor, rows: LoraRows | None = None) -> tuple[torch.Tensor, ...]:
        return _with_adapters(self, x, linear(self, x, self.weight, self.bias), rows).split(self.sizes, dim=-1)


def _with_adapters(layer, x: torch.Tensor, y: torch.Tensor, rows: LoraRows | None) -> torch.Tensor:
    """A column-parallel layer's output `y` plus the contribution of the adapters its rows run."""
    return y if rows is None or layer.lora is None else layer.lora.add_to(y, x, rows)


def _vocab_rows(r: Reader, name: str, vocab: int, shard: Shard, dtype, device) -> tuple[Weight, int]:
    """This rank's vocabulary rows, zero-padded to the common shard size (kept quantized where the
    checkpoint stores them so)."""
    start, end, per = shard.padded(vocab)
    rows = r.read_weight(name, 0, start, end, vocab=True) if end > start else None
    if isinstance(rows, QuantizedWeight):
        return rows.pad_rows(per).to(device), start
    hidden = r.read(name, 0, 0, 1).shape[1] if rows is None else rows.shape[1]
    w = torch.zeros(per, hidden, dtype=dtype, device=device)
    if rows is not None:
        w[: end - start] = rows.to(device=device, dtype=dtype)
    return w, start


class VocabParallelEmbedding:
    """Each rank embeds the ids in its vocabulary range (zeros elsewhere); an all-reduce sums."""

    def __init__(self, weight: Weight, start: int, comm: Communicator, dtype: torch.dtype | None = None):
        self.weight = weight
        self.start = start
        self.comm = comm
        self.dtype = dtype  # what a quantized table's rows dequantize to

    @classmethod
    def load(cls, r: Reader, name: str, vocab: int, shard: Shard, comm, dtype, device):
        w, start = _vocab_rows(r, name, vocab, shard, dtype, device)
        return cls(w, start, comm, dtype)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, torch.Tensor):
            return F.embedding(ids, self.weight)
        return self.weight.rows(ids.reshape(-1), self.dtype).view(*ids.shape, -1)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if self.comm.world_size == 1:
            return self._lookup(ids)
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = self._lookup(local.masked_fill(outside, 0))
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        self.comm.all_reduce(out)
        return out


class ParallelLMHead:
    """Vocabulary-parallel output projection; the full logits exist on rank 0 only."""

    def __init__(self, weight: Weight, vocab: int, comm: Communicator, kernels: Kernels):
        self.weight = held(weight, kernels)
        self.vocab = vocab
        self.comm = comm
        self.kernels = kernels

    @classmethod
    def load(cls, r: Reader, name: str, vocab: int, shard: Shard, comm, dtype, device, kernels: Kernels,
             tied: VocabParallelEmbedding | None = None):
        """`tied`: the embedding whose rows (`name`'s, read alike) the head shares, held once."""
        w = tied.weight if tied is not None else _vocab_rows(r, name, vocab, shard, dtype, device)[0]
        head = cls(r.head_weight(w), vocab, comm, kernels)
        if tied is not None and isinstance(head.weight, PanelWeight):
            tied.weight = head.weight  # the embedding reads its rows from the head's panels: one copy
        return head

    def __call__(self, h: torch.Tensor) -> torch.Tensor | None:
        local = linear(self, h, self.weight)
        parts = self.comm.gather_to_rank0(local)
        if parts is None:
            return None
        return torch.cat(parts, dim=-1)[..., : self.vocab]


class RMSNorm:
    """Replicated on every rank; computed in float32 like the reference."""

    def __init__(self, weight: torch.Tensor, eps: float, kernels: Kernels):
        self.weight = weight
        self.eps = eps
        self.kernels = kernels

    @classmethod
    def load(cls, r: Reader, name: str, eps: float, dtype, device, kernels: Kernels):
        return cls(_place(r.read(name), dtype, device), eps, kernels)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(self.kernels, x, self.weight, self.eps)
