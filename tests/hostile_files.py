"""Model files built to break a loader: GGUF files written byte by byte (every count, type and
offset under the test's control), safetensors checkpoints with lying headers, shapes or values,
and configs with every field the models read set out of range.

Each case is a directory (or a .gguf file) plus the --hf-overrides to load it with, the tensor-
parallel size, and a word its refusal must name. `cases(root)` builds them all;
tests/test_hostile_files.py loads each through the offline API in a separate leader process.
"""

from __future__ import annotations

import json
import shutil
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
_PACK = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?", U64: "<Q",
         I64: "<q", F64: "<d"}
GGML_F32, ALIGN = 0, 32


@dataclass
class Case:
    name: str
    model: str  # a directory or a .gguf file
    names: str  # what the refusal must mention (a file, tensor, field or key)
    overrides: dict | str | None = None
    tp: int = 1
    extra: dict = field(default_factory=dict)  # more LLM() arguments


# ---- GGUF, byte by byte ----


def gstr(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def value(kind: int, v) -> bytes:
    """One metadata value's bytes (without its type tag)."""
    if kind == STRING:
        return gstr(v)
    if kind == ARRAY:
        item, items = v
        return struct.pack("<IQ", item, len(items)) + b"".join(value(item, x) for x in items)
    return struct.pack(_PACK[kind], v)


def kv(key: str, kind: int, v) -> bytes:
    return gstr(key) + struct.pack("<I", kind) + value(kind, v)


def gguf_file(path: Path, meta: list[bytes], tensors: list[tuple[str, np.ndarray]], *, tensor_count=None,
              kv_count=None, version=3, magic=b"GGUF", tensor_info=None, tail: bytes = b"") -> Path:
    """A GGUF file of F32 `tensors` (HF [out, in] order) and raw `meta` entries; any count, the
    version, the magic or a tensor's index entry (`tensor_info(name, dims, offset) -> bytes`) may lie."""
    infos, blobs, offset = [], [], 0
    for name, a in tensors:
        dims = list(reversed(a.shape))
        info = (tensor_info or _info)(name, dims, offset)
        infos.append(info)
        data = np.ascontiguousarray(a, dtype=np.float32).tobytes()
        pad = -len(data) % ALIGN
        blobs.append(data + b"\0" * pad)
        offset += len(data) + pad
    head = magic + struct.pack("<IQQ", version, len(tensors) if tensor_count is None else tensor_count,
                               len(meta) if kv_count is None else kv_count)
    body = head + b"".join(meta) + b"".join(infos)
    body += b"\0" * (-len(body) % ALIGN)
    path.write_bytes(body + b"".join(blobs) + tail)
    return path


def _info(name: str, dims: list[int], offset: int, kind: int = GGML_F32) -> bytes:
    return gstr(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims) + \
        struct.pack("<IQ", kind, offset)


GGUF_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
              "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
              "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
              "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
              "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
              "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
              "mlp.down_proj.weight": "ffn_down.weight"}


def gguf_tensors(hf_dir: Path) -> list[tuple[str, np.ndarray]]:
    """A tiny Qwen3 checkpoint's tensors under GGUF names (tied embeddings: no output.weight)."""
    out = []
    for name, t in load_file(hf_dir / "model.safetensors").items():
        if name == "lm_head.weight":
            continue
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            out.append((f"blk.{layer}.{GGUF_NAMES[rest]}", t.numpy()))
        else:
            out.append((GGUF_NAMES[name], t.numpy()))
    return out


def gguf_meta(config: dict, **changes) -> list[bytes]:
    """The metadata of a tiny Qwen3 checkpoint; `changes` replace (or, with None, drop) entries,
    each given as (type, value) under its key without the `qwen3.` prefix."""
    entries = {"general.architecture": (STRING, "qwen3"),
               "qwen3.context_length": (U32, config["max_position_embeddings"]),
               "qwen3.embedding_length": (U32, config["hidden_size"]),
               "qwen3.block_count": (U32, config["num_hidden_layers"]),
               "qwen3.feed_forward_length": (U32, config["intermediate_size"]),
               "qwen3.attention.head_count": (U32, config["num_attention_heads"]),
               "qwen3.attention.head_count_kv": (U32, config["num_key_value_heads"]),
               "qwen3.attention.key_length": (U32, config["head_dim"]),
               "qwen3.attention.layer_norm_rms_epsilon": (F32, config["rms_norm_eps"]),
               "qwen3.rope.freq_base": (F32, 10000.0),
               "qwen3.vocab_size": (U32, config["vocab_size"])}
    for key, change in changes.items():
        key = key if key.startswith(("general.", "tokenizer.")) else f"qwen3.{key}"
        if change is None:
            entries.pop(key, None)
        else:
            entries[key] = change
    return [kv(k, kind, v) for k, (kind, v) in entries.items()]


def gguf_cases(root: Path, hf_dir: Path) -> list[Case]:
    config = json.loads((hf_dir / "config.json").read_text())
    tensors = gguf_tensors(hf_dir)
    d = root / "gguf"
    d.mkdir(parents=True, exist_ok=True)

    def case(name: str, names: str, meta=None, ts=None, **kw) -> Case:
        path = gguf_file(d / f"{name}.gguf", gguf_meta(config) if meta is None else meta,
                         tensors if ts is None else ts, **kw)
        return Case(f"gguf-{name}", str(path), names)

    def nested(depth: int) -> bytes:  # an array of arrays of ... of one u8
        inner = struct.pack("<IQ", U8, 1) + b"\1"
        for _ in range(depth):
            inner = struct.pack("<IQ", ARRAY, 1) + inner
        return gstr("general.nested") + struct.pack("<I", ARRAY) + inner

    return [
        case("block-count-2-32", "num_hidden_layers", gguf_meta(config, block_count=(U32, 2**32 - 1))),
        case("array-2-40-items", "general.junk", gguf_meta(config) + [gstr("general.junk") + struct.pack(
            "<IIQ", ARRAY, U32, 1 << 40) + b"\0\0\0\0"], kv_count=len(gguf_meta(config)) + 1),
        case("million-tokens", "tokenizer.ggml.tokens", gguf_meta(config, **{
            "tokenizer.ggml.model": (STRING, "gpt2"),
            "tokenizer.ggml.tokens": (ARRAY, (STRING, ["a"] * 1_000_000))})),
        case("dims-zero", "token_embd.weight",
             tensor_info=lambda n, dims, off: _info(n, [0, *dims[1:]] if n == "token_embd.weight" else dims, off)),
        case("bad-magic", "GGUF magic", magic=b"GGUX"),
        case("version-9", "version 9", version=9),
        case("big-endian", "big-endian", version=3 << 24),
        case("metadata-count-lies", "metadata-count-lies.gguf", meta=gguf_meta(config),
             kv_count=len(gguf_meta(config)) + 5),
        case("tensor-count-huge", "tensors", tensor_count=1 << 40),
        case("nested-arrays", "general.nested", gguf_meta(config) + [nested(4000)],
             kv_count=len(gguf_meta(config)) + 1),
        case("unknown-value-type", "general.odd", gguf_meta(config) + [gstr("general.odd") + struct.pack("<I", 77)],
             kv_count=len(gguf_meta(config)) + 1),
        case("string-2-60", "general.name", gguf_meta(config) + [gstr("general.name") + struct.pack(
            "<I", STRING) + struct.pack("<Q", 1 << 60)], kv_count=len(gguf_meta(config)) + 1),
        case("architecture-array", "general.architecture",
             gguf_meta(config, **{"general.architecture": (ARRAY, (STRING, ["qwen3"]))})),
        case("architecture-unknown", "architecture", gguf_meta(config, **{"general.architecture": (STRING, "gpt9")})),
        case("zero-heads", "num_attention_heads", gguf_meta(config, **{"attention.head_count": (U32, 0)})),
        case("heads-as-string", "attention.head_count", gguf_meta(config, **{"attention.head_count": (STRING, "4")})),
        case("key-length-2-20", "head_dim", gguf_meta(config, **{"attention.key_length": (U32, 1 << 20)})),
        case("context-1e9", "max_position_embeddings", gguf_meta(config, context_length=(U64, 10**9))),
        case("eps-nan", "rms_norm_eps", gguf_meta(config, **{"attention.layer_norm_rms_epsilon": (F32, float("nan"))})),
        case("rope-base-zero", "rope_theta", gguf_meta(config, **{"rope.freq_base": (F32, 0.0)})),
        case("vocab-2-26", "vocab_size", gguf_meta(config, vocab_size=(U32, 1 << 26))),
        case("unknown-tensor-type", "blk.0.attn_q.weight",
             tensor_info=lambda n, dims, off: _info(n, dims, off, 99 if n == "blk.0.attn_q.weight" else GGML_F32)),
        case("data-past-end", "output_norm.weight",
             tensor_info=lambda n, dims, off: _info(n, dims, off + (1 << 30) if n == "output_norm.weight" else off)),
        case("misaligned-offset", "not aligned",
             tensor_info=lambda n, dims, off: _info(n, dims, off + 4 if n == "output_norm.weight" else off)),
        case("duplicate-key", "appears twice", gguf_meta(config) + [kv("qwen3.block_count", U32, 2)],
             kv_count=len(gguf_meta(config)) + 1),
        case("alignment-zero", "general.alignment", gguf_meta(config) + [kv("general.alignment", U32, 0)],
             kv_count=len(gguf_meta(config)) + 1),
        case("layers-missing", "block_count", gguf_meta(config, block_count=None)),
        case("shape-disagrees", "blk.0.attn_q.weight",
             ts=[(n, a[: a.shape[0] // 2] if n == "blk.0.attn_q.weight" else a) for n, a in tensors]),
        case("tokens-not-strings", "tokenizer", gguf_meta(config, **{
            "tokenizer.ggml.model": (STRING, "gpt2"), "tokenizer.ggml.tokens": (ARRAY, (U32, list(range(256))))})),
    ]


# ---- safetensors checkpoints ----


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, dirs_exist_ok=True)
    return dst


def _rewrite(path: Path, change) -> None:
    tensors = load_file(path / "model.safetensors")
    change(tensors)
    save_file(tensors, path / "model.safetensors")


def _header(path: Path, edit) -> None:
    """Rewrite model.safetensors' JSON header in place through `edit(header) -> header`."""
    f = path / "model.safetensors"
    raw = f.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = edit(json.loads(raw[8:8 + n]))
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    f.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])


def safetensors_cases(root: Path, hf_dir: Path) -> list[Case]:
    d = root / "st"

    def case(name: str, names: str, build, **kw) -> Case:
        path = _copy(hf_dir, d / name)
        build(path)
        return Case(f"st-{name}", str(path), names, **kw)

    def half_q(t):
        t["model.layers.0.self_attn.q_proj.weight"] = t["model.layers.0.self_attn.q_proj.weight"][:32].clone()

    def nan_norm(t):
        t["model.layers.1.input_layernorm.weight"][3] = float("nan")

    def int_norm(t):
        t["model.norm.weight"] = torch.ones_like(t["model.norm.weight"], dtype=torch.int64)

    def past_end(h):
        name = "model.norm.weight"
        h[name]["data_offsets"] = [h[name]["data_offsets"][0], h[name]["data_offsets"][0] + (1 << 40)]
        return h

    def index(weight_map):
        def build(path: Path):
            (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        return build

    return [
        case("q-proj-shape", "model.layers.0.self_attn.q_proj.weight", lambda p: _rewrite(p, half_q)),
        case("q-proj-shape-tp2", "model.layers.0.self_attn.q_proj.weight", lambda p: _rewrite(p, half_q), tp=2),
        case("nan-in-norm", "model.layers.1.input_layernorm.weight", lambda p: _rewrite(p, nan_norm)),
        case("integer-norm", "model.norm.weight", lambda p: _rewrite(p, int_norm)),
        case("header-length-huge", "model.safetensors",
             lambda p: (p / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 60) + b"{}")),
        case("header-not-json", "model.safetensors",
             lambda p: (p / "model.safetensors").write_bytes(struct.pack("<Q", 8) + b"not json" + b"\0" * 64)),
        case("empty-file", "model.safetensors", lambda p: (p / "model.safetensors").write_bytes(b"")),
        case("data-past-end", "model.safetensors", lambda p: _header(p, past_end)),
        case("unknown-dtype", "model.safetensors", lambda p: _header(
            p, lambda h: {**h, "model.norm.weight": {**h["model.norm.weight"], "dtype": "Q9"}})),
        case("index-escapes", "../../../../etc/passwd",
             index({"model.norm.weight": "../../../../etc/passwd"})),
        case("index-absolute", "/etc/passwd", index({"model.norm.weight": "/etc/passwd"})),
        case("index-not-a-map", "weight_map", index(["model.safetensors"])),
        case("tensor-missing", "model.layers.1.mlp.down_proj.weight",
             lambda p: _rewrite(p, lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))),
    ]


# ---- config.json and --hf-overrides ----


def config_cases(root: Path, hf_dir: Path) -> list[Case]:
    d = root / "cfg"

    def file(name: str, names: str, text: str | bytes) -> Case:
        path = _copy(hf_dir, d / name)
        (path / "config.json").write_bytes(text.encode() if isinstance(text, str) else text)
        return Case(f"config-{name}", str(path), names)

    def field_case(key: str, bad, names: str | None = None) -> Case:
        return Case(f"override-{key}={bad!r}", str(hf_dir), names or key.split(".")[-1], {key: bad})

    nan, inf = float("nan"), float("inf")
    cases = [
        file("a-list", "config.json", "[1, 2, 3]"),
        file("not-json", "config.json", "{\"model_type\": "),
        file("deep", "config.json", "[" * 100_000 + "]" * 100_000),
        file("not-utf8", "config.json", b"\xff\xfe{}"),
        file("unsupported", "model_type", json.dumps({"model_type": "gpt9"})),
        Case("override-text-deep", str(hf_dir), "hf_overrides", "[" * 100_000 + "]" * 100_000),
        Case("override-not-json", str(hf_dir), "hf_overrides", "{\"num_attention_heads\": "),
        Case("override-a-list", str(hf_dir), "hf_overrides", [1, 2]),
        Case("override-rope-not-object", str(hf_dir), "rope_scaling", {"rope_scaling": "yarn"}),
        Case("override-rope-factor-nan", str(hf_dir), "factor",
             {"rope_scaling": {"rope_type": "linear", "factor": nan}}),
        Case("override-rope-factor-inf", str(hf_dir), "factor",
             {"rope_scaling": {"rope_type": "linear", "factor": inf}}),
        Case("override-rope-factor-zero", str(hf_dir), "factor",
             {"rope_scaling": {"rope_type": "linear", "factor": 0}}),
        Case("override-yarn-original-zero", str(hf_dir), "original_max_position_embeddings",
             {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 0}}),
        Case("override-llama3-equal-factors", str(hf_dir), "high_freq_factor",
             {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                               "original_max_position_embeddings": 256}}),
        Case("tp-3-on-4-heads", str(hf_dir), "1, 2, 4", tp=3),
        Case("max-model-len-1e9", str(hf_dir), "max_position_embeddings",
             {"max_position_embeddings": 10**9}, extra={"max_model_len": 10**9}),
        Case("plan-beyond-memory", str(hf_dir), "not enough memory",
             {"max_position_embeddings": 1 << 24, "num_hidden_layers": 2, "num_key_value_heads": 4,
              "head_dim": 1024}, extra={"max_model_len": 1 << 24}),
    ]
    for key, bad in [("num_attention_heads", 0), ("num_attention_heads", -4), ("num_attention_heads", "4"),
                     ("num_attention_heads", True), ("num_key_value_heads", 0), ("num_key_value_heads", 3),
                     ("head_dim", 0), ("head_dim", 1 << 20), ("head_dim", 15), ("hidden_size", -1),
                     ("hidden_size", 0), ("num_hidden_layers", 0), ("num_hidden_layers", 2**32 - 1),
                     ("intermediate_size", 0), ("vocab_size", 1 << 26), ("vocab_size", 0), ("rope_theta", 0),
                     ("rope_theta", nan), ("max_position_embeddings", 0), ("max_position_embeddings", -1),
                     ("max_position_embeddings", nan), ("max_position_embeddings", inf),
                     ("max_position_embeddings", 10**9), ("rms_norm_eps", nan), ("rms_norm_eps", inf),
                     ("rms_norm_eps", -1e-6), ("tie_word_embeddings", "yes"), ("eos_token_id", 1 << 40),
                     ("eos_token_id", [1, "x"])]:
        cases.append(field_case(key, bad))
    return cases + generation_cases(root, hf_dir)


def generation_cases(root: Path, hf_dir: Path) -> list[Case]:
    """generation_config.json: the sampling defaults and stop ids every request would meet."""
    d = root / "gen"

    def gen(name: str, names: str, body) -> Case:
        path = _copy(hf_dir, d / name)
        (path / "generation_config.json").write_text(json.dumps(body))
        return Case(f"generation-{name}", str(path), names)

    return [gen("a-list", "generation_config.json", [0.7]),
            gen("temperature-text", "temperature", {"temperature": "hot"}),
            gen("temperature-negative", "temperature", {"temperature": -1}),
            gen("top-p-zero", "top_p", {"top_p": 0}),
            gen("top-k-fraction", "top_k", {"top_k": 1.5}),
            gen("min-p-two", "min_p", {"min_p": 2}),
            gen("penalty-tiny", "repetition_penalty", {"repetition_penalty": 1e-9}),
            gen("max-new-tokens-zero", "max_new_tokens", {"max_new_tokens": 0}),
            gen("eos-outside", "eos_token_id", {"eos_token_id": [1, 1 << 40]})]


# ---- quantized safetensors checkpoints ----


def quant_cases(root: Path, hf_dir: Path) -> list[Case]:
    from quant_checkpoints import awq_checkpoint, compressed_tensors_checkpoint, fp8_checkpoint, gptq_checkpoint

    d = root / "quant"
    q = "model.layers.0.self_attn.q_proj"

    def case(name: str, names: str, make, change=None, config=None) -> Case:
        path, _ = make(hf_dir, d / name)
        if change is not None:
            _rewrite(path, change)
        if config is not None:
            c = json.loads((path / "config.json").read_text())
            c["quantization_config"].update(config)
            (path / "config.json").write_text(json.dumps(c))
        return Case(f"quant-{name}", str(path), names)

    def set_(key, value):
        def change(t):
            t[key] = value(t[key])
        return change

    fp8 = lambda src, dst: fp8_checkpoint(src, dst, block=(32, 32))  # noqa: E731
    awq = lambda src, dst: awq_checkpoint(src, dst, group=32)  # noqa: E731
    gptq = lambda src, dst: gptq_checkpoint(src, dst, group=32)  # noqa: E731
    ct = lambda src, dst: compressed_tensors_checkpoint(src, dst, group=32)  # noqa: E731
    return [
        case("fp8-scale-shape", f"{q}.weight_scale_inv", fp8, set_(f"{q}.weight_scale_inv", lambda s: s[:1].clone())),
        case("fp8-nan-scale", f"{q}.weight", fp8, set_(f"{q}.weight_scale_inv", lambda s: s * float("nan"))),
        case("fp8-block-zero", "weight_block_size", fp8, config={"weight_block_size": [0, 32]}),
        case("awq-short-scales", q, awq, set_(f"{q}.scales", lambda s: s[:, :16].clone())),
        case("gptq-group-past-scales", q, gptq, set_(f"{q}.g_idx", lambda g: g + 99)),
        case("gptq-group-negative", q, gptq, set_(f"{q}.g_idx", lambda g: g - 1)),
        case("compressed-shape-lies", f"{q}.weight_shape", ct,
             set_(f"{q}.weight_shape", lambda s: torch.tensor([64, 64, 64], dtype=s.dtype))),
    ]


def cases(root: Path, hf_dir: Path) -> list[Case]:
    return (gguf_cases(root, hf_dir) + safetensors_cases(root, hf_dir) + config_cases(root, hf_dir)
            + quant_cases(root, hf_dir))
