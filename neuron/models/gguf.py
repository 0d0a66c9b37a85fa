"""GGUF files (llama.cpp, Ollama) as checkpoints: the config and tokenizer from the file's metadata,
the weights kept in their quantized blocks and split across ranks.

Each rank maps the file and copies out only its slices: output rows whole, input columns on the
type's block boundaries (32 values for the legacy types and IQ4_NL, 256 for the K-quants and
IQ4_XS), refused otherwise with the sizes. The blocks are rewritten once into neuron's quantized
layout (neuron/layers/quantized.py) without changing a value, each dequantizing bit for bit as
the `gguf` package does:

- Q8_0: int8 codes under d per 32. Q4_0: 4-bit codes with offset 8 d. Q4_1: 4-bit codes under d
  with offset -m. Q5_0: int8 codes q - 16 under d. Q5_1: int8 codes 0..31 under d, offset -m.
- Q2_K: int8 codes 0..3 under d x sc with offset dmin x m per 16 (4-bit sc and m). Q3_K: int8
  codes -4..3 (q - 4 where the hmask bit is clear) under d x (sc - 32) per 16.
- Q4_K and Q5_K: 4- and 8-bit codes under d x sc with offset dmin x m per 32 (6-bit sc and m).
  Q6_K: int8 codes q - 32 under d x scale per 16.
- IQ4_NL and IQ4_XS: the codebook's values as int8 codes, under d per 32 (IQ4_NL) or under
  d x (ls - 32) per 32 (IQ4_XS).

d, m and dmin stay fp16, as the file stores them (the kernels widen them exactly as they read).
The two-level factors multiply in fp32 as gguf's do (d x sc before the code), so each product
rounds the same. F32, F16 and BF16 tensors load as dense ones; any other type (the IQ1-IQ3
families, TQ1_0, ...) is refused on the leader, naming it and its tensors, before workers start.
llama.cpp stores Llama's q and k rows permuted for its rotary layout; the reader undoes that.
Its `bert` architecture (BERT embedding models) is read under BERT's transformers names. A file
split into shards (PREFIX-00001-of-0000N.gguf) is read from its first shard's metadata and every
shard's tensors, each shard checked to be the one its name says.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import numpy as np
import torch

from neuron.errors import ConfigError
from neuron.layers.quantized import QuantizedWeight, pack_nibbles
from neuron.layers.tensor_parallel import Reader
from neuron.models.gguf_layout import ARRAY, STRING, read_layout

ARCHITECTURES = {"qwen3": "qwen3", "llama": "llama", "qwen3moe": "qwen3_moe", "qwen2": "qwen2", "qwen35": "qwen3_5_text",
                 "qwen35moe": "qwen3_5_moe_text", "bert": "bert"}
# Qwen3.5's linear-attention layers (llama.cpp's `qwen35`), and the one name its layers spell otherwise
_QWEN35_NAMES = {
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight", "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight", "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight", "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight", "linear_attn.A_log": "ssm_a", "linear_attn.dt_bias": "ssm_dt.bias",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    # Qwen3.5-MoE's shared expert and its gate
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
# its RMSNorm weights, which llama.cpp stores plus one (the multiplier the zero-centred norm applies)
_QWEN35_OFFSET = ("input_layernorm.weight", "post_attention_layernorm.weight", "model.norm.weight", "q_norm.weight",
                  "k_norm.weight")
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
}
_EXPERT_NAMES = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}
_TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
              "model.norm.weight": "output_norm.weight",
              # BERT's (llama.cpp's `bert` architecture: all-MiniLM, mxbai-embed-large, BGE's English models)
              "embeddings.word_embeddings.weight": "token_embd.weight",
              "embeddings.position_embeddings.weight": "position_embd.weight",
              "embeddings.token_type_embeddings.weight": "token_types.weight",
              "embeddings.LayerNorm.weight": "token_embd_norm.weight",
              "embeddings.LayerNorm.bias": "token_embd_norm.bias",
              # a cross-encoder's head (RoBERTa's classifier.dense and out_proj; BERT's classifier, which
              # the converter names out_proj, its pooler left out)
              "classifier.dense.weight": "cls.weight", "classifier.dense.bias": "cls.bias",
              "classifier.out_proj.weight": "cls.output.weight", "classifier.out_proj.bias": "cls.output.bias",
              # a decoder reranker's (llama.cpp's Qwen3-Reranker: its LM head's `yes` and `no` rows)
              "score.weight": "cls.output.weight", "score.bias": "cls.output.bias"}
_ENCODER_LAYER_NAMES = {"attention.self.query": "attn_q", "attention.self.key": "attn_k",
                        "attention.self.value": "attn_v", "attention.output.dense": "attn_output",
                        "attention.output.LayerNorm": "attn_output_norm", "intermediate.dense": "ffn_up",
                        "output.dense": "ffn_down", "output.LayerNorm": "layer_output_norm"}
QK_K = 256
_POSITIONS = "embeddings.position_embeddings.weight"


def _gguf():
    try:
        import gguf
    except ImportError:  # a dependency; missing only in a broken install
        raise ConfigError("reading GGUF files needs the `gguf` package (pip install gguf)") from None
    return gguf


def gguf_name(name: str) -> str | None:
    """The GGUF tensor that holds a transformers-named weight; None for names GGUF does not use."""
    return locate(name)[0]


def locate(name: str, qwen35: bool = False) -> tuple[str | None, int | None]:
    """(GGUF tensor, expert) holding a transformers-named weight: MoE experts are stacked in one
    tensor per projection (blk.N.ffn_gate_exps.weight, [experts, out, in]). `qwen35`: in a Qwen3.5
    file (its linear-attention layers' names)."""
    if qwen35:
        parts = name.split(".", 3)
        if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in _QWEN35_NAMES:
            return f"blk.{parts[2]}.{_QWEN35_NAMES[parts[3]]}", None
    if name in _TOP_NAMES:
        return _TOP_NAMES[name], None
    if name.startswith("encoder.layer."):  # encoder.layer.N.attention.self.query.weight
        _, _, layer, rest = name.split(".", 3)
        within, _, kind = rest.rpartition(".")
        if within in _ENCODER_LAYER_NAMES and kind in ("weight", "bias") and layer.isdigit():
            return f"blk.{layer}.{_ENCODER_LAYER_NAMES[within]}.{kind}", None
        return None, None
    parts = name.split(".", 3)
    if len(parts) != 4 or parts[:2] != ["model", "layers"]:
        return None, None
    if parts[3] in _LAYER_NAMES:
        return f"blk.{parts[2]}.{_LAYER_NAMES[parts[3]]}", None
    expert = parts[3].split(".")  # mlp.experts.E.gate_proj.weight
    if len(expert) == 5 and expert[:2] == ["mlp", "experts"] and expert[3] in _EXPERT_NAMES and expert[4] == "weight":
        return f"blk.{parts[2]}.{_EXPERT_NAMES[expert[3]]}.weight", int(expert[2])
    return None, None


def is_gguf(path: Path) -> bool:
    """Whether the file at `path` is a GGUF file: named .gguf, or beginning with GGUF's magic (Ollama
    keeps its GGUF files as blobs named by their digest)."""
    if path.suffix == ".gguf":
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def find_gguf(path: Path) -> Path | None:
    """`path` itself when it is a GGUF file (is_gguf; a split file's first shard for any of its
    shards), the one GGUF file or split set of a directory without safetensors weights (several are
    refused by name), else None."""
    if path.is_file():
        if not is_gguf(path):
            return None
        first = _first_shard(path)
        return first if first.is_file() else path  # a lone shard-like name is refused by GGUFFile
    files = sorted(path.glob("*.gguf")) if path.is_dir() else []
    if not files or any(path.glob("*.safetensors")):
        return None
    models = sorted({_first_shard(f).name for f in files})
    if len(models) > 1:
        raise ConfigError(f"{path} holds several GGUF models ({', '.join(models)}); name one: {path / models[0]}")
    if not (path / models[0]).is_file():
        raise ConfigError(f"{path}: the first shard of its split GGUF file, {models[0]}, is missing (a download "
                          "that did not finish?)")
    return path / models[0]


# a split file's shards, as llama.cpp's gguf-split and converter name them: PREFIX-00001-of-00003.gguf
_SHARD = re.compile(r"(.+)-(\d{5})-of-(\d{5})\.gguf")
MAX_SHARDS = 99999


def _shard_name(prefix: str, number: int, count: int) -> str:
    return f"{prefix}-{number:05d}-of-{count:05d}.gguf"


def _first_shard(path: Path) -> Path:
    shard = _SHARD.fullmatch(path.name)
    return path.with_name(_shard_name(shard[1], 1, int(shard[3]))) if shard else path


def open_file(path: str | Path) -> GGUFFile:
    """The GGUF file at `path`, read once per process while it is unchanged: the leader reads its
    config, types and tokenizer and rank 0 its tensors. The path is kept as named, not resolved: a
    split file's shards are found beside its first (in a Hugging Face cache, links to blobs)."""
    st = Path(path).stat()
    return _opened(str(Path(path).absolute()), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=4)
def _opened(path: str, mtime_ns: int, size: int) -> GGUFFile:
    return GGUFFile(path)


class GGUFFile:
    """A GGUF file's metadata and tensor index (the tensors stay mapped, unread, until sliced). A
    split file (llama.cpp's gguf-split, or its converter's --split-max-size) is read whole from its
    first shard: that shard's metadata, every shard's tensors."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        layout = read_layout(path)  # every count bounded, every value read once
        self.fields, self.tensors = layout.fields, layout.tensors
        count = self._whole("split.count", 1)
        if count > 1:
            self._read_shards(count)

    def _whole(self, key: str, default: int, fields: dict | None = None, most: int = MAX_SHARDS) -> int:
        """A split's count or number: an integer from 0 to `most` (`default` when absent)."""
        f = (self.fields if fields is None else fields).get(key)
        if f is None:
            return default
        if not isinstance(f.value, int) or isinstance(f.value, bool) or not 0 <= f.value <= most:
            raise ConfigError(f"{self.path.name}: GGUF metadata {key} must be a whole number up to {most}")
        return f.value

    def _read_shards(self, count: int) -> None:
        shard = _SHARD.fullmatch(self.path.name)
        if self._whole("split.no", 0) != 0 or not shard or int(shard[2]) != 1 or int(shard[3]) != count:
            raise ConfigError(f"{self.path.name} is one shard of a GGUF file split in {count}; name its first shard, "
                              f"PREFIX-00001-of-{count:05d}.gguf as llama.cpp names it, with the others beside it")
        for number in range(2, count + 1):
            path = self.path.with_name(_shard_name(shard[1], number, count))
            if not path.is_file():
                raise ConfigError(f"{self.path.name}: shard {number} of {count}, {path.name}, is missing from "
                                  f"{path.parent} (a download that did not finish?)")
            layout = read_layout(path)
            if self._whole("split.no", -1, layout.fields) != number - 1 or \
                    self._whole("split.count", -1, layout.fields) != count:
                raise ConfigError(f"{path.name}: its split.no and split.count do not say it is shard {number} of "
                                  f"{count} of {self.path.name}")
            for name, t in layout.tensors.items():
                if name in self.tensors:
                    raise ConfigError(f"{path.name}: tensor {name!r} is in an earlier shard of {self.path.name} too")
                self.tensors[name] = t
        total = self._whole("split.tensors.count", len(self.tensors), most=1 << 31)
        if total != len(self.tensors):
            raise ConfigError(f"{self.path.name}: its {count} shards hold {len(self.tensors)} tensors, not the "
                              f"{total} split.tensors.count says")

    def field(self, key: str, default=None):
        """A metadata value: one number or string (an array is refused by name, never hashed or
        converted by mistake); `tokenizer.*` arrays are read by the tokenizer converter instead."""
        f = self.fields.get(key)
        if f is None:
            return default
        if f.kind == ARRAY:
            raise ConfigError(f"{self.path.name}: GGUF metadata {key} must be a single value, not an array")
        if f.kind != STRING:
            return f.value
        try:
            return f.value.decode("utf-8")
        except UnicodeDecodeError:
            raise ConfigError(f"{self.path.name}: GGUF metadata {key} is a string that is not UTF-8") from None

    def array(self, key: str) -> list | None:
        """An array field's items (strings decoded as UTF-8), None when the file has no such key; a
        single value, or a string that is not UTF-8, is refused naming the key."""
        f = self.fields.get(key)
        if f is None:
            return None
        if f.kind != ARRAY:
            raise ConfigError(f"{self.path.name}: GGUF metadata {key} must be an array")
        if f.items != STRING:
            return f.value.tolist() if isinstance(f.value, np.ndarray) else list(f.value)
        try:
            return [item.decode("utf-8") for item in f.value]
        except UnicodeDecodeError:
            raise ConfigError(f"{self.path.name}: GGUF metadata {key} holds a string that is not UTF-8") from None

    def count(self, key: str) -> int | None:
        """How many items an array field holds, without decoding them."""
        f = self.fields.get(key)
        return None if f is None else len(f.value) if f.kind == ARRAY else 1

    def check_types(self) -> None:
        """Refuse a file holding a tensor type neuron cannot read, in one line naming each such type
        and its tensors; the leader calls it before any worker starts."""
        unread: dict[str, list[str]] = {}
        for name, t in self.tensors.items():
            if t.tensor_type.name not in _DENSE and t.tensor_type.name not in _DECODERS:
                unread.setdefault(t.tensor_type.name, []).append(name)
        if unread:
            found = ", ".join(f"{kind} ({len(names)} tensor{'s' if len(names) > 1 else ''}: {', '.join(names[:3])}"
                              f"{', ...' if len(names) > 3 else ''})" for kind, names in unread.items())
            verb = "type {} is" if len(unread) == 1 else "types {} are"
            raise ConfigError(f"{self.path.name}: GGUF tensor {verb.format(found)} not supported; neuron reads "
                              f"{', '.join([*_DENSE, *_DECODERS])}")

    def types(self) -> str:
        """The file's weight types, most common first ("Q4_K, Q6_K, F32"), for logs and /health."""
        counts: dict[str, int] = {}
        for t in self.tensors.values():
            if len(t.shape) > 1:
                counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + int(t.n_elements)
        return ", ".join(sorted(counts, key=counts.get, reverse=True))


def held_bytes(t, dtype_bytes: int) -> int:
    """Bytes neuron holds for a file's tensor: dense ones in the model dtype, quantized ones in
    neuron's layout, which widens some codes (Q5_0 to Q3_K, IQ4 types: a byte a value)."""
    kind = t.tensor_type.name
    if kind in _DENSE:
        return int(t.n_elements) * dtype_bytes
    if kind not in _DECODERS:
        return int(t.n_bytes)
    block, per_block = _held_per_block(kind)
    return int(t.n_elements) // block * per_block


@functools.cache
def _held_per_block(kind: str) -> tuple[int, int]:
    """(values, bytes held) of one block of a quantized type, from decoding one."""
    gguf = _gguf()
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    w = _DECODERS[kind](np.zeros((1, 1, size), dtype=np.uint8), block)
    return block, sum(x.numel() * x.element_size() for x in w.tensors())


class GGUFReader(Reader):
    """This rank's reader over a GGUF file, under transformers' tensor names."""

    def __init__(self, path: str | Path, config: dict):
        """`config`: the model's (the leader read it from this file's metadata), for Llama's heads."""
        self.file = open_file(path)
        heads = config["num_attention_heads"]
        self._heads = {"q": heads, "k": config.get("num_key_value_heads") or heads}
        self._permuted = config["model_type"] == "llama"
        # Qwen3.5: llama.cpp orders the value heads of its linear attention tiled (key head fastest:
        # v0 of each key head, then v1 of each, ...) where transformers groups them by key head
        self._qwen35 = config["model_type"] in ("qwen3_5_text", "qwen3_5_moe_text")
        if self._qwen35:
            k_heads, v_heads = config["linear_num_key_heads"], config["linear_num_value_heads"]
            # (key heads, value heads per key head, a value head's width, the q (or k) block's rows)
            self._v = (k_heads, v_heads // k_heads, config["linear_value_head_dim"],
                       k_heads * config["linear_key_head_dim"])
        # XLM-RoBERTa's position rows up to its padding id, which llama.cpp's converter cuts (its
        # positions are counted past the padding id, so the rows before are never read but by a
        # padding token inside an input): put back as zeros
        self._cut = config["pad_token_id"] + 1 if config["model_type"] == "xlm-roberta" else 0

    def has(self, name: str) -> bool:
        return locate(name, self._qwen35)[0] in self.file.tensors

    def shape(self, name: str) -> list[int]:
        _, t, expert = self._tensor(name)
        shape = [int(s) for s in reversed(t.shape)]  # transformers' order: [out, in], [experts, out, in]
        if self._cut and name.endswith(_POSITIONS):
            shape[0] += self._cut
        if self._qwen35 and name.endswith("linear_attn.conv1d.weight"):
            shape.insert(1, 1)  # llama.cpp squeezes the depthwise kernel's channel axis
        return shape[1:] if expert is not None else shape

    def source(self, name: str) -> str:
        return f"{self.file.path.name} ({locate(name, self._qwen35)[0]})"

    def _tensor(self, name: str):
        key, expert = locate(name, self._qwen35)
        t = self.file.tensors.get(key) if key else None
        if t is None:
            raise ConfigError(f"weight {name!r} ({key or 'no GGUF name'}) is missing from {self.file.path.name}")
        return key, t, expert

    def _value_heads(self, index: np.ndarray, width: int) -> np.ndarray:
        """The file's positions of transformers' `index` over Qwen3.5's value heads, `width` values
        a head: head g = key head k * per + j (grouped) is file head j * key heads + k (tiled)."""
        k_heads, per = self._v[0], self._v[1]
        head, within = np.divmod(index, width)
        k, j = np.divmod(head, per)
        return (j * k_heads + k) * width + within

    def _rows(self, name: str, n: int, start: int, end: int) -> np.ndarray | slice:
        """The file's rows for transformers' rows [start, end): llama.cpp permutes Llama's q and k
        rows within each head (pairs of the rotary halves interleaved), and orders Qwen3.5's value
        heads tiled (the value block of in_proj_qkv and conv1d, in_proj_z, in_proj_a and _b, A_log,
        dt_bias)."""
        if self._qwen35 and ".linear_attn." in name:
            rows, leaf = np.arange(start, end), name.rsplit(".linear_attn.", 1)[1]
            dv, qk = self._v[2], self._v[3] * 2
            if leaf in ("in_proj_qkv.weight", "conv1d.weight"):
                return np.where(rows < qk, rows, qk + self._value_heads(rows - qk, dv))
            if leaf == "in_proj_z.weight":
                return self._value_heads(rows, dv)
            if leaf in ("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias"):
                return self._value_heads(rows, 1)
            return slice(start, end)
        proj = name.rsplit(".", 2)[-2] if self._permuted else ""
        if proj not in ("q_proj", "k_proj"):
            return slice(start, end)
        heads = self._heads[proj[0]]
        half = n // heads // 2
        # transformers' row h*2*half + t*half + i sits at file row h*2*half + 2*i + t
        h, rest = np.divmod(np.arange(start, end), 2 * half)
        t, i = np.divmod(rest, half)
        return h * 2 * half + 2 * i + t

    def _raw(self, name: str, dim: int | None, start: int, end: int | None):
        """(type, this slice's rows as stored, its column count): quantized rows stay bytes."""
        key, t, expert = self._tensor(name)
        gguf = _gguf()
        kind = gguf.GGMLQuantizationType(int(t.tensor_type))
        data = t.data
        shape = [int(s) for s in reversed(t.shape)]  # transformers' order: [out, in], [experts, out, in]
        if expert is not None:
            data, shape = data[expert], shape[1:]
        if len(shape) == 1:
            n = shape[0]
            return kind, np.array(data[self._rows(name, n, *((0, n) if dim is None else (start, end)))]), n
        n, k = shape
        if dim is None or dim == 0:
            a, b = (0, n) if dim is None else (start, n if end is None else end)
            return kind, np.array(data[self._rows(name, n, a, b)]), k  # a copy of these rows only
        end = k if end is None else end
        block, size = gguf.GGML_QUANT_SIZES[kind]
        if start % block or end % block:
            raise ConfigError(
                f"{key} ({kind.name}, {n} x {k}): this rank's inputs [{start}, {end}) do not fall on the type's "
                f"blocks of {block} values; choose a tensor-parallel size that splits {k} into multiples of {block}")
        a, b = (start, end) if kind.name in _DENSE else (start // block * size, end // block * size)
        return kind, np.array(data[self._rows(name, n, 0, n), a:b]), end - start

    def read(self, name: str, dim: int | None = None, start: int = 0, end: int | None = None) -> torch.Tensor:
        w = self.read_weight(name, dim, start, end)
        return w.dequantize() if isinstance(w, QuantizedWeight) else w

    def read_weight(self, name, dim=None, start=0, end=None, vocab=False):
        if self._cut and name.endswith(_POSITIONS):
            if dim is not None:
                raise ConfigError(f"{gguf_name(name)}: XLM-RoBERTa's position table is read whole")
            table = self._slice(name, None, 0, None)
            table = table.dequantize() if isinstance(table, QuantizedWeight) else table
            return torch.cat([table.new_zeros(self._cut, table.shape[1]), table])
        return self._slice(name, dim, start, end)

    def _slice(self, name, dim, start, end):
        """The tensor's slice: dense in fp32, or quantized as neuron holds it."""
        if self._qwen35 and name.endswith("linear_attn.out_proj.weight"):
            return self._out_proj(name, dim, start, end)
        kind, raw, k = self._raw(name, dim, start, end)
        if self._qwen35 and name.endswith(_QWEN35_OFFSET):
            return _DENSE[kind.name](raw) - 1 if kind.name in _DENSE else self._dense(name, kind, raw, k) - 1
        if self._qwen35 and name.endswith("linear_attn.conv1d.weight"):
            return _DENSE[kind.name](raw).unsqueeze(1) if kind.name in _DENSE else \
                self._dense(name, kind, raw, k).unsqueeze(1)
        if self._qwen35 and name.endswith("linear_attn.A_log"):
            return torch.log(-(_DENSE[kind.name](raw) if kind.name in _DENSE else self._dense(name, kind, raw, k)))
        if kind.name in _DENSE:
            return _DENSE[kind.name](raw)
        decode = _DECODERS.get(kind.name)
        if decode is None:
            raise ConfigError(f"{gguf_name(name)}: GGUF tensor type {kind.name} is not supported "
                              f"(supported: {', '.join([*_DENSE, *_DECODERS])})")
        return decode(raw.reshape(raw.shape[0], -1, _gguf().GGML_QUANT_SIZES[kind][1]), k)

    def _dense(self, name: str, kind, raw: np.ndarray, k: int) -> torch.Tensor:
        """A quantized slice dequantized (a vector stored quantized: a hostile or odd file's)."""
        decode = _DECODERS.get(kind.name)
        if decode is None or raw.ndim != 2:
            raise ConfigError(f"{locate(name, self._qwen35)[0]}: GGUF tensor type {kind.name} is not read here")
        return decode(raw.reshape(raw.shape[0], -1, _gguf().GGML_QUANT_SIZES[kind][1]), k).dequantize()

    def inputs_order(self, name: str) -> str | None:
        return "tiled" if self._qwen35 and name.endswith("linear_attn.out_proj.weight") else None

    def _out_proj(self, name: str, dim: int | None, start: int, end: int | None):
        """Qwen3.5's out_proj, whose inputs (the value heads) the file orders tiled: the columns of
        this slice's value heads (transformers' [start, end)) in the file's order, which the layer
        matches by ordering its input so (inputs_order). The whole tensor is the file's as stored;
        a rank's share is whole blocks wherever its heads' runs fall on block boundaries (a
        K-quant's 256 values are two heads of 128: an even number of key heads a rank), else its
        rows are dequantized first."""
        key, t, _ = self._tensor(name)
        gguf = _gguf()
        kind = gguf.GGMLQuantizationType(int(t.tensor_type))
        n, k = (int(x) for x in reversed(t.shape))
        a, b = (start, n if end is None else end) if dim == 0 else (0, n)
        c0, c1 = (start, k if end is None else end) if dim == 1 else (0, k)
        cols = np.sort(self._value_heads(np.arange(c0, c1), self._v[2]))
        data = t.data[a:b]
        if kind.name in _DENSE:
            return _DENSE[kind.name](np.array(data[:, cols]))
        block, size = gguf.GGML_QUANT_SIZES[kind]
        runs = cols.reshape(-1, block) if cols.size % block == 0 else None
        if runs is not None and not (runs[:, 0] % block).any() and (np.diff(runs, axis=1) == 1).all():
            blocks = np.array(data).reshape(b - a, -1, size)[:, runs[:, 0] // block]
            return _DECODERS[kind.name](np.ascontiguousarray(blocks), c1 - c0)
        whole = self._dense(name, kind, np.array(data), k)
        return whole[:, torch.from_numpy(cols)].contiguous()

    def close(self) -> None:
        self.file = None


# ---- the block formats, rewritten into QuantizedWeight without changing a value -------------------


def _f16(blocks: np.ndarray, at: int) -> torch.Tensor:
    """The fp16 field at byte `at` of every block, [rows, blocks], kept in fp16: the kernels widen
    it as they read it, and a row's factors take the bytes they take in the file."""
    return torch.from_numpy(np.ascontiguousarray(blocks[..., at:at + 2]).view(np.float16)[..., 0].copy())


def _int8_codes(q: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(q.astype(np.int8).reshape(q.shape[0], -1)).view(np.uint8))


def _fast_codes(kind: str, blocks: np.ndarray, per_block: int) -> torch.Tensor | None:
    """The blocks' codes ([rows, blocks, bytes]: `per_block` bytes of codes a block, as the numpy
    decoders below make them) rewritten by the kernel library in one pass, several times faster
    than numpy's passes (docs/benchmarks.md); None where the library is not built."""
    from neuron.layers import cpu_ops

    return cpu_ops.gguf_codes(int(_gguf().GGMLQuantizationType[kind]), blocks, per_block)


def _scale_min(blocks: np.ndarray, at: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The K-quants' eight 6-bit scales and mins per super-block, packed in 12 bytes at `at`."""
    s = blocks[..., at:at + 12]
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    rows = blocks.shape[0]
    return (torch.from_numpy(np.ascontiguousarray(sc.reshape(rows, -1)).astype(np.int8)),
            torch.from_numpy(np.ascontiguousarray(mn.reshape(rows, -1)).astype(np.int8)))


def _q8_0(blocks: np.ndarray, k: int) -> QuantizedWeight:
    return QuantizedWeight(codes=_int8_codes(blocks[..., 2:34].view(np.int8)), k=k, bits=8, group=32,
                           scale=_f16(blocks, 0), format="Q8_0")


def _packed(blocks: np.ndarray, at: int) -> torch.Tensor:
    """16 bytes of 4-bit codes per block at `at`, already in neuron's layout (byte i: value i in its
    low nibble, value i + 16 in its high one), as [rows, k // 2]."""
    return torch.from_numpy(np.ascontiguousarray(blocks[..., at:at + 16]).reshape(blocks.shape[0], -1))


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """The 32 values of each run of 16 bytes, in Q4_0's order: the low nibbles, then the high ones."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q4_0(blocks: np.ndarray, k: int) -> QuantizedWeight:
    d = _f16(blocks, 0)
    z = d.float() * 8  # exact in fp16 too, unless it passes fp16's largest value: then both fp32
    fits = z.numel() == 0 or bool(z.abs().max() <= torch.finfo(torch.float16).max)
    d, z = (d, z.half()) if fits else (d.float(), z)
    return QuantizedWeight(codes=_packed(blocks, 2), k=k, bits=4, group=32, scale=d, offset=z, format="Q4_0")


def _q4_1(blocks: np.ndarray, k: int) -> QuantizedWeight:
    # gguf adds m to d*q; subtracting -m rounds the same (negation is exact)
    return QuantizedWeight(codes=_packed(blocks, 4), k=k, bits=4, group=32, scale=_f16(blocks, 0),
                           offset=-_f16(blocks, 2), format="Q4_1")


def _five_bits(blocks: np.ndarray, at: int) -> np.ndarray:
    """Q5_0's and Q5_1's 32 codes per block, 0..31: bit i of the little-endian u32 at `at` is value
    i's fifth bit, the 16 bytes after it hold the low four bits in Q4_0's order."""
    high = np.unpackbits(blocks[..., at:at + 4], axis=-1, bitorder="little")
    return _nibbles(blocks[..., at + 4:at + 20]) | (high << 4)


def _q5_0(blocks: np.ndarray, k: int) -> QuantizedWeight:
    codes = _fast_codes("Q5_0", blocks, 32)
    if codes is None:
        codes = _int8_codes(_five_bits(blocks, 2).astype(np.int16) - 16)
    return QuantizedWeight(codes=codes, k=k, bits=8, group=32, scale=_f16(blocks, 0), format="Q5_0")


def _q5_1(blocks: np.ndarray, k: int) -> QuantizedWeight:
    codes = _fast_codes("Q5_1", blocks, 32)
    if codes is None:
        codes = _int8_codes(_five_bits(blocks, 4))
    return QuantizedWeight(codes=codes, k=k, bits=8, group=32, scale=_f16(blocks, 0), offset=-_f16(blocks, 2),
                           format="Q5_1")


def _two_bits(qs: np.ndarray) -> np.ndarray:
    """Q2_K's and Q3_K's low two bits of 256 values from 64 bytes: value h*128 + j*32 + l is bits
    2j..2j+1 of byte h*32 + l."""
    rows, nb = qs.shape[:2]
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)
    return ((qs.reshape(rows, nb, 2, 1, 32) >> shifts) & 0x03).reshape(rows, nb, QK_K)


def _int8_subs(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x.astype(np.int8).reshape(x.shape[0], -1)))


def _q2_k(blocks: np.ndarray, k: int) -> QuantizedWeight:
    scales = blocks[..., 0:16]  # per 16 values: the scale in the low nibble, the min in the high one
    codes = _fast_codes("Q2_K", blocks, QK_K)
    if codes is None:
        codes = _int8_codes(_two_bits(blocks[..., 16:80]))
    return QuantizedWeight(codes=codes, k=k, bits=8, group=16, per_super=16,
                           scale=_f16(blocks, 80), scale_sub=_int8_subs(scales & 0x0F), offset=_f16(blocks, 82),
                           offset_sub=_int8_subs(scales >> 4), format="Q2_K")


def _q3_k(blocks: np.ndarray, k: int) -> QuantizedWeight:
    rows, nb = blocks.shape[:2]
    # sixteen 6-bit scales in 12 bytes: low nibbles of bytes 0..7 then their high nibbles; the top
    # two bits of scale 4j + b are bits 2j..2j+1 of byte 8 + b
    s = blocks[..., 96:108]
    low = _nibbles(s[..., 0:8])
    high = (s[..., None, 8:12] >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)) & 0x03
    scales = (low | (high.reshape(rows, nb, 16) << 4)).astype(np.int16) - 32
    codes = _fast_codes("Q3_K", blocks, QK_K)
    if codes is None:
        # bit j of hmask byte l is value j*32 + l's third bit; where it is clear the value is 4 lower
        hmask = (blocks[..., None, 0:32] >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 0x01
        codes = _int8_codes(_two_bits(blocks[..., 32:96]).astype(np.int16)
                            - 4 * (1 - hmask.reshape(rows, nb, QK_K).astype(np.int16)))
    return QuantizedWeight(codes=codes, k=k, bits=8, group=16, per_super=16, scale=_f16(blocks, 108),
                           scale_sub=_int8_subs(scales), format="Q3_K")


# IQ4_NL's and IQ4_XS's codebook: a 4-bit code i stands for the value _IQ4_VALUES[i] (times the scale)
_IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)


def _iq4_nl(blocks: np.ndarray, k: int) -> QuantizedWeight:
    codes = _fast_codes("IQ4_NL", blocks, 32)
    if codes is None:
        codes = _int8_codes(_IQ4_VALUES[_nibbles(blocks[..., 2:18])])
    return QuantizedWeight(codes=codes, k=k, bits=8, group=32, scale=_f16(blocks, 0), format="IQ4_NL")


def _iq4_xs(blocks: np.ndarray, k: int) -> QuantizedWeight:
    rows, nb = blocks.shape[:2]
    # eight 6-bit scales: the low four bits in the nibbles of bytes 4..7 (low first), the top two
    # bits of scale i at bits 2i..2i+1 of the little-endian u16 at byte 2
    low = np.stack([blocks[..., 4:8] & 0x0F, blocks[..., 4:8] >> 4], axis=-1).reshape(rows, nb, 8)
    high16 = blocks[..., 2].astype(np.uint16) | (blocks[..., 3].astype(np.uint16) << 8)
    high = (high16[..., None] >> np.arange(0, 16, 2, dtype=np.uint16)) & 0x03
    scales = (low | (high.astype(np.uint8) << 4)).astype(np.int16) - 32
    codes = _fast_codes("IQ4_XS", blocks, QK_K)
    if codes is None:
        codes = _int8_codes(_IQ4_VALUES[_nibbles(blocks[..., 8:136].reshape(rows, nb, 8, 16))])
    return QuantizedWeight(codes=codes, k=k, bits=8, group=32, per_super=8, scale=_f16(blocks, 0),
                           scale_sub=_int8_subs(scales), format="IQ4_XS")


def _q4_k(blocks: np.ndarray, k: int) -> QuantizedWeight:
    rows, nb = blocks.shape[:2]
    sc, mn = _scale_min(blocks, 4)
    codes = _fast_codes("Q4_K", blocks, QK_K // 2)
    if codes is None:
        qs = blocks[..., 16:144].reshape(rows, nb, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
        codes = pack_nibbles(torch.from_numpy(np.ascontiguousarray((qs & 0x0F).reshape(rows, -1))))
    return QuantizedWeight(codes=codes, k=k, bits=4, group=32, per_super=8, scale=_f16(blocks, 0), scale_sub=sc,
                           offset=_f16(blocks, 2), offset_sub=mn, format="Q4_K")


def _q5_k(blocks: np.ndarray, k: int) -> QuantizedWeight:
    rows, nb = blocks.shape[:2]
    sc, mn = _scale_min(blocks, 4)
    codes = _fast_codes("Q5_K", blocks, QK_K)
    if codes is None:
        qh = blocks[..., 16:48].reshape(rows, nb, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
        ql = blocks[..., 48:176].reshape(rows, nb, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
        codes = _int8_codes((ql & 0x0F).reshape(rows, nb, 8, 32) | ((qh & 0x01) << 4))
    return QuantizedWeight(codes=codes, k=k, bits=8, group=32, per_super=8, scale=_f16(blocks, 0),
                           scale_sub=sc, offset=_f16(blocks, 2), offset_sub=mn, format="Q5_K")


def _q6_k(blocks: np.ndarray, k: int) -> QuantizedWeight:
    rows, nb = blocks.shape[:2]
    codes = _fast_codes("Q6_K", blocks, QK_K)
    if codes is None:
        ql = blocks[..., 0:128].reshape(rows, nb, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
        qh = blocks[..., 128:192].reshape(rows, nb, 2, 1, 32) >> \
            np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)
        q = (ql & 0x0F).reshape(rows, nb, 8, 32) | ((qh & 0x03).reshape(rows, nb, 8, 32) << 4)
        codes = _int8_codes(q.astype(np.int16) - 32)
    scales = torch.from_numpy(np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).reshape(rows, -1).copy())
    return QuantizedWeight(codes=codes, k=k, bits=8, group=16, per_super=16, scale=_f16(blocks, 208),
                           scale_sub=scales, format="Q6_K")


_DECODERS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q2_K": _q2_k,
             "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k, "IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs}
_DENSE = {
    "F32": lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)),
    "F16": lambda a: torch.from_numpy(np.ascontiguousarray(a).astype(np.float32)),
    "BF16": lambda a: torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16).float(),
}
