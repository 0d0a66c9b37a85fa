"""GGUF files written from a transformers checkpoint, as llama.cpp's converter lays them out, for the
tests and scripts/bench_quant.py.

The `gguf` package writes the file and quantizes F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1; it
only dequantizes the K-quants and the IQ4 types, so Q2_K to Q6_K, IQ4_NL and IQ4_XS blocks are made
here by plain min/max rounding (valid blocks of the documented layout, not llama.cpp's
error-minimising search: what matters is that the file is read back exactly as `gguf.dequantize`
reads it). Types neither can make (IQ2_XXS, ...) are written as random bytes, for refusals.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.bias": "attn_output.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight", "mlp.gate.weight": "ffn_gate_inp.weight",
}
EXPERTS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}
TOP = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
       "model.norm.weight": "output_norm.weight"}


def _gguf_name(name: str) -> str:
    if name in TOP:
        return TOP[name]
    _, _, layer, rest = name.split(".", 3)
    return f"blk.{layer}.{GGUF_NAMES[rest]}"


def _qwen35_name(name: str, names) -> str:
    """A Qwen3.5 tensor's GGUF name by the `gguf` package's own map (`names`, as the converter names
    them), dt_bias first renamed dt_proj.bias as the converter renames it."""
    if name.endswith(".linear_attn.dt_bias"):
        name = name.removesuffix("dt_bias") + "dt_proj.bias"
    return names.get_name(name, try_suffixes=(".weight", ".bias"))


def _tiled(x: np.ndarray, axis: int, k_heads: int, width: int) -> np.ndarray:
    """Qwen3.5's value heads from transformers' grouped order (by key head) to llama.cpp's tiled one
    along `axis`, `width` values a head."""
    x = np.moveaxis(x, axis, 0)
    per = x.shape[0] // width // k_heads
    x = x.reshape(k_heads, per, width, *x.shape[1:]).swapaxes(0, 1).reshape(x.shape)
    return np.moveaxis(x, 0, axis)


def _qwen35_tensor(name: str, x: np.ndarray, config: dict) -> np.ndarray:
    """A Qwen3.5 tensor as llama.cpp's converter writes it: zero-centred norms plus one, A_log as
    -exp(A_log), the depthwise kernel squeezed, and the value heads tiled."""
    k_heads, dv = config["linear_num_key_heads"], config["linear_value_head_dim"]
    qk = 2 * k_heads * config["linear_key_head_dim"]
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        return x + 1
    leaf = name.rsplit(".linear_attn.", 1)[-1] if ".linear_attn." in name else ""
    if leaf == "A_log":  # torch's exp, as the converter's (numpy's rounds some values an ulp apart)
        import torch

        return _tiled(-torch.exp(torch.from_numpy(x)).numpy(), 0, k_heads, 1)
    if leaf in ("dt_bias", "in_proj_a.weight", "in_proj_b.weight"):
        return _tiled(x, 0, k_heads, 1)
    if leaf == "in_proj_z.weight":
        return _tiled(x, 0, k_heads, dv)
    if leaf in ("in_proj_qkv.weight", "conv1d.weight"):
        x = x.reshape(x.shape[0], -1) if leaf == "conv1d.weight" else x
        return np.concatenate([x[:qk], _tiled(x[qk:], 0, k_heads, dv)])
    if leaf == "out_proj.weight":
        return _tiled(x, 1, k_heads, dv)
    return x


def _qwen35_metadata(w, config: dict) -> None:
    rope = config.get("rope_parameters") or {}
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    sections = list(rope.get("mrope_section", [11, 11, 10]))
    w.add_rope_dimension_sections(sections + [0] * (4 - len(sections)))
    w.add_ssm_conv_kernel(config["linear_conv_kernel_dim"])
    w.add_ssm_state_size(config["linear_key_head_dim"])
    w.add_ssm_group_count(config["linear_num_key_heads"])
    w.add_ssm_time_step_rank(config["linear_num_value_heads"])
    w.add_ssm_inner_size(config["linear_value_head_dim"] * config["linear_num_value_heads"])
    if config.get("layer_types"):
        w.add_array(f"{w.arch}.attention.recurrent_layers", [t == "linear_attention" for t in config["layer_types"]])
    w.add_full_attention_interval(config.get("full_attention_interval", 4))
    w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 0.25)))


def _fp16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _bytes16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(*x.shape, 2)


def _pack_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins per super-block into the K-quants' 12 bytes."""
    out = np.zeros((*sc.shape[:-1], 12), dtype=np.uint8)
    out[..., 0:4] = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
    out[..., 4:8] = (m[..., :4] & 63) | ((m[..., 4:] >> 4) << 6)
    out[..., 8:12] = (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)
    return out


def _affine_k(x: np.ndarray, levels: int, group: int = 32, top: int = 63):
    """Per `group` values: q in 0..levels with x ~ d*sc*q - dmin*m, sc and m in 0..top, d and dmin
    per 256 values."""
    rows, k = x.shape
    g = x.reshape(rows, k // 256, 256 // group, group).astype(np.float32)
    lo = np.minimum(g.min(-1), 0)
    scale = (g.max(-1) - lo) / levels
    d = _fp16(scale.max(-1) / top).astype(np.float32)
    dmin = _fp16(-lo.min(-1) / top).astype(np.float32)
    sc = np.clip(np.round(scale / np.where(d > 0, d, 1)[..., None]), 0, top).astype(np.uint8)
    m = np.clip(np.round(-lo / np.where(dmin > 0, dmin, 1)[..., None]), 0, top).astype(np.uint8)
    s = (d[..., None] * sc)[..., None]
    z = (dmin[..., None] * m)[..., None]
    q = np.clip(np.round((g + z) / np.where(s > 0, s, 1)), 0, levels).astype(np.uint8)
    return d, dmin, sc, m, q


def _symmetric(x: np.ndarray, group: int, most: int):
    """Per `group` values a signed scale s (its extreme value maps to -most) and x / s."""
    g = x.reshape(x.shape[0], -1, group).astype(np.float32)
    extreme = np.take_along_axis(g, np.abs(g).argmax(-1)[..., None], -1)[..., 0]
    s = extreme / -most
    return s, g / np.where(s != 0, s, 1)[..., None]


def _two_bit_bytes(low: np.ndarray) -> np.ndarray:
    """Q2_K's and Q3_K's low two bits of each 256 values (rows, blocks, 256) in 64 bytes: value
    h*128 + j*32 + l at bits 2j of byte h*32 + l."""
    parts = low.reshape(*low.shape[:2], 2, 4, 32).astype(np.uint8)
    return (parts[:, :, :, 0] | (parts[:, :, :, 1] << 2) | (parts[:, :, :, 2] << 4) | (parts[:, :, :, 3] << 6)
            ).reshape(*low.shape[:2], 64)


def _nibble_bytes(q: np.ndarray) -> np.ndarray:
    """Runs of 32 codes 0..15 as 16 bytes each, Q4_0's order (value i low, value i + 16 high)."""
    runs = q.reshape(*q.shape[:-1], -1, 2, 16).astype(np.uint8)
    return (runs[..., 0, :] | (runs[..., 1, :] << 4)).reshape(*q.shape[:-1], -1)


def quantize_q2_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _affine_k(x, 3, group=16, top=15)
    rows, nb = d.shape
    return np.concatenate([sc | (m << 4), _two_bit_bytes(q.reshape(rows, nb, 256)), _bytes16(d), _bytes16(dmin)],
                          axis=-1).reshape(rows, -1)


def quantize_q3_k(x: np.ndarray) -> np.ndarray:
    rows, k = x.shape
    s, _ = _symmetric(x, 16, 4)  # q in -4..3, the sub-scale signed
    s = s.reshape(rows, k // 256, 16)
    d = _fp16(np.abs(s).max(-1) / 32).astype(np.float32)
    sc = np.clip(np.round(s / np.where(d > 0, d, 1)[..., None]), -32, 31).astype(np.int16)
    step = (d[..., None] * sc)[..., None]
    g = x.reshape(rows, k // 256, 16, 16)
    u = (np.clip(np.round(g / np.where(step != 0, step, 1)), -4, 3) + 4).astype(np.uint8).reshape(rows, -1, 256)
    nb = u.shape[1]
    hmask = np.zeros((rows, nb, 32), dtype=np.uint8)  # bit j of byte l: value j*32 + l is not 4 lower
    for j in range(8):
        hmask |= (u[..., j * 32:(j + 1) * 32] >> 2) << j
    six = (sc + 32).astype(np.uint8)  # sixteen 6-bit scales in 12 bytes
    scales = np.zeros((rows, nb, 12), dtype=np.uint8)
    scales[..., 0:8] = (six[..., 0:8] & 15) | ((six[..., 8:16] & 15) << 4)
    for j in range(4):
        scales[..., 8:12] |= (six[..., 4 * j:4 * j + 4] >> 4) << (2 * j)
    return np.concatenate([hmask, _two_bit_bytes(u & 3), scales, _bytes16(d)], axis=-1).reshape(rows, -1)


IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32)


def _nearest_iq4(v: np.ndarray) -> np.ndarray:
    return np.abs(v[..., None] - IQ4_VALUES).argmin(-1).astype(np.uint8)


def quantize_iq4_nl(x: np.ndarray) -> np.ndarray:
    rows = x.shape[0]
    s, v = _symmetric(x, 32, 127)
    d = _fp16(s).astype(np.float32)
    v = x.reshape(rows, -1, 32) / np.where(d != 0, d, 1)[..., None]
    return np.concatenate([_bytes16(d), _nibble_bytes(_nearest_iq4(v))], axis=-1).reshape(rows, -1)


def quantize_iq4_xs(x: np.ndarray) -> np.ndarray:
    rows, k = x.shape
    s, _ = _symmetric(x, 32, 127)
    s = s.reshape(rows, k // 256, 8)
    d = _fp16(np.abs(s).max(-1) / 32).astype(np.float32)
    ls = np.clip(np.round(s / np.where(d > 0, d, 1)[..., None]), -32, 31).astype(np.int16)
    step = (d[..., None] * ls)[..., None]
    v = x.reshape(rows, k // 256, 8, 32) / np.where(step != 0, step, 1)
    six = (ls + 32).astype(np.uint16)
    high = np.zeros(six.shape[:2], dtype=np.uint16)  # the top two bits of scale i at bits 2i
    for i in range(8):
        high |= (six[..., i] >> 4) << (2 * i)
    low = (six & 15).astype(np.uint8).reshape(rows, -1, 4, 2)
    return np.concatenate([_bytes16(d), high[..., None].view(np.uint8), low[..., 0] | (low[..., 1] << 4),
                           _nibble_bytes(_nearest_iq4(v)).reshape(rows, -1, 128)], axis=-1).reshape(rows, -1)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _affine_k(x, 15)
    rows, nb = d.shape
    pairs = q.reshape(rows, nb, 4, 2, 32)
    qs = (pairs[:, :, :, 0] | (pairs[:, :, :, 1] << 4)).reshape(rows, nb, 128)
    return np.concatenate([_bytes16(d), _bytes16(dmin), _pack_scales(sc, m), qs], axis=-1).reshape(rows, -1)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _affine_k(x, 31)
    rows, nb = d.shape
    high = ((q >> 4) & 1).astype(np.uint8)  # [rows, nb, 8, 32]: bit s of qh[i] is sub-block s's
    qh = np.zeros((rows, nb, 32), dtype=np.uint8)
    for s in range(8):
        qh |= high[:, :, s] << s
    low = (q & 15).reshape(rows, nb, 4, 2, 32)
    qs = (low[:, :, :, 0] | (low[:, :, :, 1] << 4)).reshape(rows, nb, 128)
    return np.concatenate([_bytes16(d), _bytes16(dmin), _pack_scales(sc, m), qh, qs], axis=-1).reshape(rows, -1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    rows, k = x.shape
    g = x.reshape(rows, k // 256, 16, 16).astype(np.float32)
    scale = np.abs(g).max(-1) / 31
    d = _fp16(np.abs(scale).max(-1) / 127).astype(np.float32)
    sc = np.clip(np.round(scale / np.where(d > 0, d, 1)[..., None]), -128, 127).astype(np.int8)
    s = (d[..., None] * sc)[..., None]
    q = (np.clip(np.round(g / np.where(s != 0, s, 1)), -32, 31) + 32).astype(np.uint8).reshape(rows, -1, 256)
    nb = q.shape[1]
    halves = q.reshape(rows, nb, 2, 128)
    ql = np.zeros((rows, nb, 2, 64), dtype=np.uint8)
    qh = np.zeros((rows, nb, 2, 32), dtype=np.uint8)
    for nib in range(2):
        ql |= (halves[..., nib * 64:(nib + 1) * 64] & 15) << (4 * nib)
    for part in range(4):
        qh |= ((halves[..., part * 32:(part + 1) * 32] >> 4) & 3) << (2 * part)
    return np.concatenate([ql.reshape(rows, nb, 128), qh.reshape(rows, nb, 64), sc.view(np.uint8),
                           _bytes16(d)], axis=-1).reshape(rows, -1)


QUANTIZERS = {"Q2_K": quantize_q2_k, "Q3_K": quantize_q3_k, "Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k,
              "Q6_K": quantize_q6_k, "IQ4_NL": quantize_iq4_nl, "IQ4_XS": quantize_iq4_xs}
# where each type keeps its fp16 scales in a block, for random_blocks
F16_FIELDS = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q2_K": [80, 82],
              "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "IQ4_NL": [0], "IQ4_XS": [0]}


def random_blocks(kind: str, rows: int, k: int, seed: int = 0) -> np.ndarray:
    """[rows, bytes] of random blocks of `kind`: every code and sub-scale bit pattern is a valid
    block, and the fp16 scales are set to modest finite values."""
    import gguf

    rng = np.random.default_rng(seed)
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    data = rng.integers(0, 256, (rows, k // block, size), dtype=np.uint8)
    for at in F16_FIELDS.get(kind, []):
        data[..., at:at + 2] = _bytes16(rng.standard_normal(data.shape[:2]) * 0.01)
    return data.reshape(rows, -1)


def quantize(x: np.ndarray, kind: str):
    """(data, type) for gguf's writer: the K-quants and IQ4 types here, the rest by gguf itself,
    types neither quantizes as random blocks."""
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    if kind == "F32":
        return x.astype(np.float32), qtype
    rows = x.reshape(-1, x.shape[-1]).astype(np.float32)  # any leading dimensions (stacked experts)
    if kind in QUANTIZERS:
        data = QUANTIZERS[kind](rows)
    elif kind in ("F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        return gguf.quants.quantize(x.astype(np.float32), qtype), qtype
    else:
        data = random_blocks(kind, *rows.shape)
    return data.reshape(*x.shape[:-1], data.shape[-1]), qtype


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's row order for Llama's q and k: the two rotary halves of each head interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _add_tokenizer(writer, hf_dir: Path, vocab_size: int) -> None:
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    special = set()
    for added in tok.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
        if added.get("special"):
            special.add(added["id"])
    # llama.cpp sizes the vocabulary by the token list: pad it to the embedding's rows as its
    # converter does, with unused placeholder tokens
    tokens = [f"[PAD{i}]" for i in range(max(vocab_size, max(vocab.values()) + 1))]
    for text, i in vocab.items():
        tokens[i] = text
    unused = set(range(len(tokens))) - set(vocab.values())
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"].get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in special else 5 if i in unused else 1 for i in range(len(tokens))])
    writer.add_token_merges(merges)
    cfg_file = hf_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
    eos = cfg.get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    if eos in vocab:
        writer.add_eos_token_id(vocab[eos])
    if isinstance(cfg.get("chat_template"), str):
        writer.add_chat_template(cfg["chat_template"])
    jinja = hf_dir / "chat_template.jinja"
    if jinja.is_file():
        writer.add_chat_template(jinja.read_text())


def write_gguf(hf_dir: Path, out: Path, types: str | dict[str, str] = "Q8_0", tokenizer: bool = True,
               pooling: int | str | None = None, ids: dict[str, int] | None = None, split_max_tensors: int = 0,
               reranker: tuple[str, str, str] | None = None) -> Path:
    """`hf_dir`'s Qwen3 or Llama checkpoint as a GGUF file. `types`: one type for every matrix, or a
    map from GGUF tensor names (or their suffixes after the layer, such as "ffn_down.weight") to
    types with "default" for the rest; 1-D tensors are F32 as llama.cpp writes them. `pooling`:
    llama.cpp's pooling type for an embedding model (1 mean, 2 cls, 3 last, 4 rank). `ids`: more
    `tokenizer.ggml.<key>_token_id` entries (eot, eom, ...). `split_max_tensors`: split the file as
    llama.cpp's converter does (OUT-00001-of-0000N.gguf, the metadata in the first); the first
    shard's path is returned. `reranker` (yes token, no token, rerank template): a Qwen3-Reranker as
    the converter writes one, rank pooling, its LM head's two rows as `cls.output` labelled yes and
    no (the head itself left out), the template as its `rerank` chat template."""
    import gguf

    hf_dir = Path(hf_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    arch = {"qwen3": "qwen3", "llama": "llama", "qwen3_moe": "qwen3moe", "qwen2": "qwen2",
            "qwen3_5_text": "qwen35", "qwen3_5_moe_text": "qwen35moe"}[config["model_type"]]
    qwen35 = arch.startswith("qwen35")
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    w = gguf.GGUFWriter(str(out), arch, split_max_tensors=split_max_tensors)
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(config["num_hidden_layers"])
    if "intermediate_size" in config and arch != "qwen35moe":  # the converter writes no dense width for it
        w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(config.get("rms_norm_eps", 1e-6))
    rope = config.get("rope_parameters") or {}
    w.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    w.add_vocab_size(config["vocab_size"])
    if isinstance(pooling, int):
        w.add_pooling_type(gguf.PoolingType(pooling))
    elif pooling is not None:  # a hostile file's: the key holding a string
        w.add_string(f"{arch}.pooling_type", pooling)
    if qwen35:
        _qwen35_metadata(w, config)
    if arch in ("qwen3moe", "qwen35moe"):
        w.add_expert_count(config.get("num_experts") or config["num_local_experts"])
        w.add_expert_used_count(config["num_experts_per_tok"])
        w.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if arch == "qwen35moe":
        w.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    if tokenizer and (hf_dir / "tokenizer.json").is_file():
        _add_tokenizer(w, hf_dir, config["vocab_size"])
    else:  # as llama.cpp's converter marks a checkpoint without one; llama.cpp refuses a file without the key
        w.add_tokenizer_model("none")
    for key, value in (ids or {}).items():
        w.add_uint32(f"tokenizer.ggml.{key}_token_id", value)
    tensors = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        tensors.update(load_file(f))
    if config.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    if reranker is not None:
        yes, no, template = reranker
        vocab = json.loads((hf_dir / "tokenizer.json").read_text())["model"]["vocab"]
        head = tensors.pop("lm_head.weight", None)
        head = tensors["model.embed_tokens.weight"] if head is None else head
        w.add_pooling_type(gguf.PoolingType.RANK)
        w.add_classifier_output_labels(["yes", "no"])
        w.add_chat_template([{"name": "rerank", "template": template}])
        w.add_tensor("cls.output.weight", np.stack([head[vocab[yes]], head[vocab[no]]]).astype(np.float32))
    stacked: dict[str, dict[int, np.ndarray]] = {}
    for name in [n for n in tensors if ".mlp.experts." in n]:  # one [experts, out, in] tensor per projection
        _, _, layer, _, _, e, proj, _ = name.split(".")
        stacked.setdefault(f"blk.{layer}.{EXPERTS[proj]}.weight", {})[int(e)] = tensors.pop(name)
    for gname, experts in stacked.items():
        tensors[gname] = np.stack([experts[e] for e in sorted(experts)])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN35MOE if arch == "qwen35moe" else gguf.MODEL_ARCH.QWEN35,
                                     config["num_hidden_layers"]) if qwen35 else None
    for name, value in tensors.items():
        gname = name if name in stacked else _qwen35_name(name, names) if qwen35 else _gguf_name(name)
        x = value.astype(np.float32)
        if qwen35 and name not in stacked:
            x = np.ascontiguousarray(_qwen35_tensor(name, x, config))
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):
            x = _permute(x, heads if "q_proj" in name else kv_heads)
        if x.ndim == 1 or gname.endswith("ssm_conv1d.weight"):  # the converter keeps these F32
            kind = "F32"
        elif isinstance(types, str):
            kind = types
        else:
            kind = types.get(gname) or types.get(gname.split(".", 2)[-1]) or types.get("default", "Q8_0")
        data, qtype = quantize(x, kind)
        w.add_tensor(gname, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return w.format_shard_names(Path(out))[0]


def write_tensors(out: Path, tensors: dict[str, tuple[np.ndarray, object]], arch: str = "qwen3") -> Path:
    """A GGUF file holding only `tensors` (name: (data, type) as `quantize` returns them)."""
    import gguf

    w = gguf.GGUFWriter(str(out), arch)
    for name, (data, qtype) in tensors.items():
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def write_bert_gguf(hf_dir: Path, out: Path, types: str = "F32", pooling: int | None = 1,
                    vocabulary: str = "bert", spelled: dict[int, str] | None = None) -> Path:
    """`hf_dir`'s BERT or XLM-RoBERTa checkpoint (a bare model, or under `bert.`/`roberta.`) as
    llama.cpp's converter writes an embedding model or a cross-encoder: the `bert` architecture, the
    tensors named by gguf's own name map (the pooler left out, a classification head as `cls` and
    `cls.output` with its labels' names), 1-D tensors F32 and matrices `types`;
    BERT's vocabulary in llama.cpp's spelling (a word's first piece after a phantom space, a
    continuation without its ##, control tokens as they are), XLM-RoBERTa's as its unigram pieces
    and scores (the `t5` model), its position table and context length cut past the padding id; the
    special tokens' ids; `pooling` llama.cpp's pooling type (1 mean, 2 cls). `vocabulary` another
    tokenizer model's name, and `spelled` tokens written otherwise (by id), for refusals."""
    import gguf

    hf_dir = Path(hf_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    xlmr = config["model_type"] == "xlm-roberta"
    cut = config["pad_token_id"] + 1 if xlmr else 0  # XLM-R's positions start past the padding id: rows cut
    w = gguf.GGUFWriter(str(out), "bert")
    w.add_context_length(config["max_position_embeddings"] - cut)
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_layer_norm_eps(config.get("layer_norm_eps", 1e-5 if xlmr else 1e-12))
    w.add_causal_attention(False)
    if pooling is not None:
        w.add_pooling_type(gguf.PoolingType(pooling))
    w.add_token_type_count(config.get("type_vocab_size", 1))
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    if xlmr:
        _add_unigram_vocabulary(w, tok)
    else:
        _add_wordpiece_vocabulary(w, tok, json.loads((hf_dir / "tokenizer_config.json").read_text()), vocabulary,
                                  spelled or {})
    # a sequence-classification checkpoint's head, as the converter keeps it: its labels unless they
    # are two placeholders; BERT's classifier renamed out_proj when it has labels (its pooler left out)
    labels = [v for _, v in sorted(config.get("id2label", {}).items(), key=lambda kv: int(kv[0]))]
    if len(labels) == 2 and labels[0] == "LABEL_0":
        labels = []
    if labels and any(a.endswith("ForSequenceClassification") for a in config.get("architectures", [])):
        w.add_classifier_output_labels(labels)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BERT, config["num_hidden_layers"])
    tensors = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        tensors.update(load_file(f))
    for name, value in tensors.items():
        name = name.removeprefix("bert.").removeprefix("roberta.")
        if name.startswith(("pooler.", "cls.", "lm_head.")) or name.endswith("position_ids"):
            continue
        if labels and name in ("classifier.weight", "classifier.bias"):
            name = name.replace("classifier.", "classifier.out_proj.")
        gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
        x = value.astype(np.float32)
        if gname.startswith("position_embd"):
            x = x[cut:]
        # the position and token-type tables stay F32, as the converter keeps them
        data, qtype = quantize(x, "F32" if x.ndim == 1 or gname.startswith(("position_embd", "token_types")) else types)
        w.add_tensor(gname, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _add_wordpiece_vocabulary(w, tok: dict, named: dict, vocabulary: str, spelled: dict[int, str]) -> None:
    """BERT's vocabulary as the converter writes it: in llama.cpp's spelling, [CLS] the BOS token,
    [SEP] the EOS token and the separator."""
    import gguf

    vocab = dict(tok["model"]["vocab"])
    control = {a["id"] for a in tok.get("added_tokens", []) if a.get("special")}
    tokens = [""] * len(vocab)
    for text, i in vocab.items():
        tokens[i] = text
    kinds = [gguf.TokenType.CONTROL if i in control else gguf.TokenType.NORMAL for i in range(len(tokens))]
    phantom = [t if k == gguf.TokenType.CONTROL else t[2:] if t.startswith("##") else "\u2581" + t
               for t, k in zip(tokens, kinds)]
    for i, text in spelled.items():
        phantom[i] = text
    w.add_tokenizer_model(vocabulary)
    w.add_token_list(phantom)
    w.add_token_types(kinds)
    for key, meta in (("cls_token", "bos_token_id"), ("sep_token", "eos_token_id"), ("unk_token", "unknown_token_id"),
                      ("sep_token", "seperator_token_id"), ("pad_token", "padding_token_id"),
                      ("mask_token", "mask_token_id")):
        if named.get(key) in vocab:
            w.add_uint32(f"tokenizer.ggml.{meta}", vocab[named[key]])
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_bool("tokenizer.ggml.add_eos_token", True)
    w.add_bool("tokenizer.ggml.normalizer.lowercase", tok["normalizer"].get("lowercase", True))


def _add_unigram_vocabulary(w, tok: dict) -> None:
    """XLM-RoBERTa's vocabulary as the converter writes it from a tokenizer.json (its
    `_xlmroberta_set_vocab`): the `t5` model's pieces, scores, types and character map."""
    import base64

    import gguf

    pieces = tok["model"]["vocab"]
    unk = tok["model"].get("unk_id", 3)
    added = {a["id"]: a.get("special", False) for a in tok.get("added_tokens", [])}
    kinds = [gguf.TokenType.UNKNOWN if i == unk else gguf.TokenType.CONTROL if added.get(i) else
             gguf.TokenType.USER_DEFINED if i in added else gguf.TokenType.NORMAL for i in range(len(pieces))]
    w.add_tokenizer_model("t5")
    w.add_tokenizer_pre("default")
    w.add_token_list([p for p, _ in pieces])
    w.add_token_scores([float(x) for _, x in pieces])
    w.add_token_types(kinds)
    w.add_add_space_prefix(True)
    w.add_remove_extra_whitespaces(False)  # as the converter writes a tokenizer.json checkpoint's
    charsmap = (tok.get("normalizer") or {}).get("precompiled_charsmap")
    if charsmap:
        w.add_precompiled_charsmap(base64.b64decode(charsmap))
    vocab = {p: i for i, (p, _) in enumerate(pieces)}
    for meta, text in (("bos_token_id", "<s>"), ("eos_token_id", "</s>"), ("unknown_token_id", "<unk>"),
                       ("seperator_token_id", "</s>"), ("padding_token_id", "<pad>"), ("mask_token_id", "<mask>")):
        if text in vocab:
            w.add_uint32(f"tokenizer.ggml.{meta}", vocab[text])
