"""GGUF files written from a transformers checkpoint, as llama.cpp's converter lays them out, for the
tests and scripts/bench_quant.py.

The `gguf` package writes the file and quantizes F16, BF16, Q8_0 and Q4_0; it only dequantizes the
K-quants, so Q4_K, Q5_K and Q6_K blocks are made here by plain min/max rounding (valid blocks of the
documented layout, not llama.cpp's error-minimising search: what matters is that the file is read
back exactly as `gguf.dequantize` reads it).
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


def _affine_k(x: np.ndarray, levels: int):
    """Per 32 values: q in 0..levels with x ~ d*sc*q - dmin*m, d and dmin per 256 values."""
    rows, k = x.shape
    g = x.reshape(rows, k // 256, 8, 32).astype(np.float32)
    lo = np.minimum(g.min(-1), 0)
    scale = (g.max(-1) - lo) / levels
    d = _fp16(scale.max(-1) / 63).astype(np.float32)
    dmin = _fp16(-lo.min(-1) / 63).astype(np.float32)
    sc = np.clip(np.round(scale / np.where(d > 0, d, 1)[..., None]), 0, 63).astype(np.uint8)
    m = np.clip(np.round(-lo / np.where(dmin > 0, dmin, 1)[..., None]), 0, 63).astype(np.uint8)
    s = (d[..., None] * sc)[..., None]
    z = (dmin[..., None] * m)[..., None]
    q = np.clip(np.round((g + z) / np.where(s > 0, s, 1)), 0, levels).astype(np.uint8)
    return d, dmin, sc, m, q


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


K_QUANTIZERS = {"Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}


def quantize(x: np.ndarray, kind: str):
    """(data, type) for gguf's writer: the K-quants here, the rest by gguf itself."""
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    if kind == "F32":
        return x.astype(np.float32), qtype
    if kind in K_QUANTIZERS:  # any leading dimensions (stacked experts): rows of the last one
        rows = K_QUANTIZERS[kind](x.reshape(-1, x.shape[-1]).astype(np.float32))
        return rows.reshape(*x.shape[:-1], rows.shape[-1]), qtype
    return gguf.quants.quantize(x.astype(np.float32), qtype), qtype


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


def write_gguf(hf_dir: Path, out: Path, types: str | dict[str, str] = "Q8_0", tokenizer: bool = True) -> Path:
    """`hf_dir`'s Qwen3 or Llama checkpoint as a GGUF file. `types`: one type for every matrix, or a
    map from GGUF tensor names (or their suffixes after the layer, such as "ffn_down.weight") to
    types with "default" for the rest; 1-D tensors are F32 as llama.cpp writes them."""
    import gguf

    hf_dir = Path(hf_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    arch = {"qwen3": "qwen3", "llama": "llama", "qwen3_moe": "qwen3moe", "qwen2": "qwen2"}[config["model_type"]]
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    w = gguf.GGUFWriter(str(out), arch)
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(config.get("rms_norm_eps", 1e-6))
    rope = config.get("rope_parameters") or {}
    w.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    w.add_vocab_size(config["vocab_size"])
    if arch == "qwen3moe":
        w.add_expert_count(config.get("num_experts") or config["num_local_experts"])
        w.add_expert_used_count(config["num_experts_per_tok"])
        w.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if tokenizer and (hf_dir / "tokenizer.json").is_file():
        _add_tokenizer(w, hf_dir, config["vocab_size"])
    tensors = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        tensors.update(load_file(f))
    if config.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    stacked: dict[str, dict[int, np.ndarray]] = {}
    for name in [n for n in tensors if ".mlp.experts." in n]:  # one [experts, out, in] tensor per projection
        _, _, layer, _, _, e, proj, _ = name.split(".")
        stacked.setdefault(f"blk.{layer}.{EXPERTS[proj]}.weight", {})[int(e)] = tensors.pop(name)
    for gname, experts in stacked.items():
        tensors[gname] = np.stack([experts[e] for e in sorted(experts)])
    for name, value in tensors.items():
        gname = name if name in stacked else _gguf_name(name)
        x = value.astype(np.float32)
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            x = _permute(x, heads if "q_proj" in name else kv_heads)
        if x.ndim == 1:
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
    return out
