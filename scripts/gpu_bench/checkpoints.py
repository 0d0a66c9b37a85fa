"""Random-weight Qwen3 checkpoints in the published shapes, drawn on the device."""

from __future__ import annotations

import json
import math
from pathlib import Path

# Published Qwen3 config values; the weights are random.
SHAPES = {
    "0.6b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
               head_dim=128, intermediate_size=12288, vocab_size=151936, tie_word_embeddings=False),
    # --tiny: the default model's 2-layer, hidden-64 shape; 1024 ids cover neuron bench's token-id range.
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, intermediate_size=128, vocab_size=1024, tie_word_embeddings=True),
}
QWEN3 = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_act="silu", attention_bias=False,
             attention_dropout=0.0, rope_theta=1000000.0, rope_scaling=None, rms_norm_eps=1e-6,
             max_position_embeddings=40960, use_cache=True, use_sliding_window=False, sliding_window=None,
             initializer_range=0.02, bos_token_id=None, eos_token_id=None)  # no EOS: every run is full length


def qwen3_config(shape: str, dtype: str) -> dict:
    dims = SHAPES[shape]
    return {**QWEN3, **dims, "max_window_layers": dims["num_hidden_layers"], "torch_dtype": dtype}


def tensor_shapes(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Every weight of a Qwen3 dense checkpoint, in file order."""
    h, i, v, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    out = [("model.embed_tokens.weight", (v, h))]
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,)),
                (p + "self_attn.q_proj.weight", (q, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, q)),
                (p + "self_attn.q_norm.weight", (d,)), (p + "self_attn.k_norm.weight", (d,)),
                (p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h)),
                (p + "mlp.down_proj.weight", (h, i))]
    out.append(("model.norm.weight", (h,)))
    if not cfg["tie_word_embeddings"]:
        out.append(("lm_head.weight", (v, h)))
    return out


def build_checkpoint(path: Path, cfg: dict, device: str, shard_bytes: int,
                     shapes: list[tuple[str, tuple[int, ...]]] | None = None) -> dict:
    """Draw every tensor on `device` and write safetensors, sharded with an index above `shard_bytes`
    (as the published 8B is), one file below it (as the published 0.6B is). `shapes`: the tensors,
    in file order (default: Qwen3 dense's for `cfg`)."""
    import torch
    from safetensors.torch import save_file

    dtype = getattr(torch, cfg["torch_dtype"])
    gen = torch.Generator(device=device).manual_seed(0)
    shapes = tensor_shapes(cfg) if shapes is None else shapes
    numel = [math.prod(s) for _, s in shapes]
    total = sum(numel) * dtype.itemsize
    groups = _shard_groups(numel, dtype.itemsize, shard_bytes)
    path.mkdir(parents=True, exist_ok=True)
    names = _shard_names(len(groups))
    weight_map = {}
    for group, fname in zip(groups, names):
        tensors = {}
        for k in group:
            name, shape = shapes[k]
            t = torch.ones(shape, dtype=dtype, device=device) if name.endswith("norm.weight") else \
                torch.randn(shape, generator=gen, device=device, dtype=dtype) * 0.02
            tensors[name] = t.cpu()
            weight_map[name] = fname
        save_file(tensors, str(path / fname), metadata={"format": "pt"})
        del tensors
    if len(groups) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return {"params": sum(numel), "bytes": total, "files": len(groups)}


def _shard_groups(numel: list[int], itemsize: int, limit: int) -> list[list[int]]:
    """Consecutive tensors in groups of at most `limit` bytes (one group when all fit)."""
    groups, size = [[]], 0
    for k, n in enumerate(numel):
        if groups[-1] and size + n * itemsize > limit:
            groups.append([])
            size = 0
        groups[-1].append(k)
        size += n * itemsize
    return groups


def _shard_names(n: int) -> list[str]:
    if n == 1:
        return ["model.safetensors"]
    return [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]


def weights_read_per_token(shape: str, itemsize: int) -> tuple[int, int]:
    """(parameters, bytes of weights a batch-1 decode step reads): every matrix once, the LM head
    included; an untied embedding table is not read, only one row of it."""
    shapes = dict(tensor_shapes(qwen3_config(shape, "bfloat16")))
    params = sum(math.prod(s) for s in shapes.values())
    unread = 0 if "lm_head.weight" not in shapes else math.prod(shapes["model.embed_tokens.weight"])
    return params, (params - unread) * itemsize

