"""What a model will take of a host's memory, worked out from its config and its files' tensor
index before any worker starts, and compared with what the host has.

A config's sizes are untrusted: a head_dim of 2^20, a vocabulary of 2^26 or a max_model_len of
10^9 each plan terabytes, and on a CPU the first touch of those pages drove the host out of memory
within seconds. So the plan (weights, KV cache, rotary tables, per rank) is compared with
MemAvailable for the ranks that share this host, as the CUDA side compares with free device
memory, and refused with its sizes. Weights are counted as they will be held (dense ones in the
model dtype, quantized ones as stored or as quantized at load).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from neuron.errors import ConfigError
from neuron.models.config_check import sparse_layers

_GIB = 2**30
HEADROOM = 0.9  # of MemAvailable: the leader, the tokenizer and a step's activations need the rest
_DTYPE_BYTES = {"F64": 8, "F32": 4, "I64": 8, "I32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2, "I8": 1, "U8": 1,
                "F8_E4M3": 1, "F8_E5M2": 1, "BOOL": 1}


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """Bytes one rank holds: its share of the weights, its KV cache, its rotary tables."""

    weights: int
    kv_cache: int
    tables: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.tables


def kv_bytes_per_token(config: dict, tp: int, dtype_bytes: int) -> int:
    """K and V of one token on one rank, over the layers that keep KV (full attention); none for an
    encoder, which keeps nothing between steps."""
    from neuron.models import is_encoder, text_config

    if is_encoder(config):
        return 0
    t = text_config(config)
    heads = t["num_attention_heads"]
    kv_heads = max(1, (t.get("num_key_value_heads") or heads) // tp)
    head_dim = t.get("head_dim") or t["hidden_size"] // heads
    types = t.get("layer_types")
    layers = t["num_hidden_layers"]
    if isinstance(types, list) and config.get("model_type", "").startswith("qwen3_5"):
        layers = types.count("full_attention")
    elif config.get("model_type", "").startswith("qwen3_5"):
        layers //= t.get("full_attention_interval", 4)
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def weight_bytes(files: list[Path], dtype_bytes: int, quantization: str = "") -> int:
    """All weights as the ranks will hold them together: dense floating-point tensors in the model
    dtype (about one byte per value when `quantization` at load takes them: linear layers, and
    under int8 the LM head), everything else as stored."""
    from neuron.models.gguf import is_gguf

    if len(files) == 1 and is_gguf(Path(files[0])):
        return _gguf_bytes(files[0], dtype_bytes)
    from safetensors import safe_open

    from neuron.models.loader import _safetensors

    total = 0
    for path in files:
        f = _safetensors(path, lambda p: safe_open(str(p), framework="pt", device="cpu"))
        for name in f.keys():
            sl = _safetensors(path, lambda _: f.get_slice(name), name)
            numel = 1
            for d in sl.get_shape():
                numel *= d
            kind = sl.get_dtype()
            if kind in ("F32", "F16", "BF16", "F64"):
                size = 1 if quantized_at_load(name, len(sl.get_shape()), quantization) else dtype_bytes
            else:
                size = _DTYPE_BYTES.get(kind, 4)
            total += numel * size
    return total


def quantized_at_load(name: str, dims: int, quantization: str) -> bool:
    """Whether `quantization` at load (loader.QuantizingReader) takes the floating-point tensor `name`."""
    from neuron.layers.quantized import HEAD_QUANTIZATIONS

    if not quantization or dims != 2 or "embed" in name:
        return False
    return "lm_head" not in name or quantization in HEAD_QUANTIZATIONS


def _gguf_bytes(path: Path, dtype_bytes: int) -> int:
    from neuron.models.gguf import held_bytes, open_file

    return sum(held_bytes(t, dtype_bytes) for t in open_file(path).tensors.values())


def plan(config: dict, files: list[Path], *, tp: int, dtype_bytes: int, quantization: str, max_model_len: int,
         kv_tokens: int | None, kv_cache_bytes: int, lora: tuple[int, int] = (0, 0),
         kv_dtype_bytes: int | None = None) -> MemoryPlan:
    """One rank's plan. `quantization`: at load ("" for none). KV: `kv_cache_bytes` when given,
    else room for `kv_tokens` tokens of `kv_dtype_bytes` per element (None: the model's). `lora`:
    the LoRA adapter pool's slots and rank, counted with the weights."""
    from neuron.models import text_config

    t = text_config(config)
    head_dim = t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"]
    kv = kv_cache_bytes or kv_tokens * kv_bytes_per_token(config, tp, kv_dtype_bytes or dtype_bytes)
    tables = 2 * max_model_len * head_dim * dtype_bytes  # cos and sin per position
    adapters = lora_pool_bytes(t, tp, *lora, dtype_bytes) if lora[0] else 0
    weights = weight_bytes(files, dtype_bytes, quantization)
    tied = config.get("tie_word_embeddings", t.get("tie_word_embeddings"))
    if tied and quantized_at_load("lm_head.weight", 2, quantization):
        weights += t["vocab_size"] * t["hidden_size"]  # the tied head's quantized copy
    return MemoryPlan(weights // tp + adapters, kv, tables)


def lora_pool_bytes(t: dict, tp: int, slots: int, rank: int, dtype_bytes: int) -> int:
    """One rank's LoRA pool (layers/lora.py): per projection group A [slots, parts * rank, in] and B
    [out, slots, parts * rank], the sharded side split by tp."""
    hidden, heads = t["hidden_size"], t["num_attention_heads"]
    head_dim = t.get("head_dim") or hidden // heads
    q, kv = heads * head_dim // tp, max(1, (t.get("num_key_value_heads") or heads) // tp) * head_dim
    inter = (t.get("intermediate_size") or 0) // tp
    layers = t["num_hidden_layers"]
    dense = layers - len(sparse_layers(t))  # a mixture-of-experts block holds no adapter

    def pools(groups) -> int:
        return sum(parts * rank * slots * (inputs + outputs) for parts, inputs, outputs in groups)
    attention = pools([(3, hidden, q + 2 * kv), (1, q, hidden)])
    mlp = pools([(2, hidden, 2 * inter), (1, inter, hidden)])
    return (attention * layers + mlp * dense) * dtype_bytes


def available_bytes() -> int | None:
    """What this host can still give: MemAvailable, or the cgroup's remaining limit if lower."""
    from neuron.utils.procfs import available_memory

    free = available_memory()
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
        if limit != "max":
            room = int(limit) - used
            free = room if free is None else min(free, room)
    except (OSError, ValueError):
        pass
    return free


def describe(p: MemoryPlan, ranks: int) -> str:
    return (f"{p.total / _GIB:.2f} GiB per rank (weights {p.weights / _GIB:.2f}, KV cache {p.kv_cache / _GIB:.2f}, "
            f"rotary tables {p.tables / _GIB:.2f}) x {ranks} rank(s) on this host = {p.total * ranks / _GIB:.2f} GiB")


def check_fits(p: MemoryPlan, ranks: int, available: int | None, fix: str) -> None:
    """Refuse a plan the host cannot hold, with its sizes and what to change (`fix`)."""
    if available is None or p.total * ranks <= available * HEADROOM:
        return
    raise ConfigError(f"not enough memory: the model needs {describe(p, ranks)}, but this host has "
                      f"{available / _GIB:.2f} GiB available; {fix}")
