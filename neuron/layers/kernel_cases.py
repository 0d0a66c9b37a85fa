"""The inputs the kernel self-check (`kernel_check`) runs each fused kernel on, with the reference's
answer: a model's exact widths and dtype, plus the shapes that broke attention kernels before
(a lone decode token, a prefill tile, a chunk after a cached prefix, a block size that does not
divide the chunk, blocks scattered through the pool), and LoRA steps mixing adapters and the base
model."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from neuron.layers import lora, norm, quantized
from neuron.layers.kernels import Kernels
from neuron.layers.paged_attention import build_metadata, paged_attention_reference, paged_attention_triton

_EPS = 1e-6
_ROWS = 7  # not a power of two: the kernels' row masks are part of what is checked


def kernels() -> dict[str, Callable]:
    """Each piece's Triton kernel, called as its case's arguments say."""
    return {"rms_norm": norm.rms_norm_triton, "add_rms_norm": norm.add_rms_norm_triton,
            "norm_rope": norm.norm_rope_triton, "silu_mul": norm.silu_mul_triton,
            "paged_attention": paged_attention_triton, "quant_linear": quantized.linear_triton,
            "lora": lambda pool, y, x, rows: lora.grouped_triton(pool, y.clone(), x, rows)}


def cases(device: str, dtype: torch.dtype, w) -> dict[str, list[tuple[str, tuple, object]]]:
    """Per piece: (name, arguments, the reference's output) for each shape checked."""
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    x, delta, weight = rand(_ROWS, w.hidden), rand(_ROWS, w.hidden), rand(w.hidden)
    gate, up = rand(_ROWS, w.intermediate), rand(_ROWS, w.intermediate)
    out = {
        "rms_norm": [("rms_norm", (x, weight, _EPS), norm.rms_norm_reference(x, weight, _EPS))],
        "add_rms_norm": [("add_rms_norm", (x, delta, weight, _EPS),
                          norm.add_rms_norm_reference(x, delta, weight, _EPS))],
        "silu_mul": [("silu_mul", (gate, up), norm.silu_mul_reference(gate, up))],
        "norm_rope": [_rope_case(rand, heads, w.head_dim, device, dtype, name)
                      for heads, name in ((w.heads, "queries"), (w.kv_heads, "keys"))],
        "paged_attention": _attention_cases(rand, w, device, gen),
        "quant_linear": _quant_cases(rand, w, device, dtype, gen),
        "lora": _lora_cases(rand, w, device, dtype),
    }
    return out


def _quant_cases(rand, w, device: str, dtype: torch.dtype, gen: torch.Generator) -> list:
    """Every layout of quantized weight neuron holds, at the MLP's shapes (gate/up: hidden inputs;
    down: intermediate inputs, rounded up to the layouts' blocks), for a decode step and a prefill tile."""
    def layout(name: str, n: int, k: int):
        codes8 = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=gen)
        codes4 = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
        if name == "fp8":
            codes8 = codes8 & 0xF7  # no NaN bytes (S.1111.111)
        tops = {"int8": (k, 1), "fp8": (128, 1), "4-bit": (32, 1), "two-level": (32, 8)}[name]
        group, per_super = tops
        groups = k // group
        scale = torch.rand(n, groups // per_super, generator=gen) * 0.02
        sub = torch.randint(0, 64, (n, groups), dtype=torch.int8, generator=gen) if per_super > 1 else None
        offset = torch.rand(n, groups // per_super, generator=gen) * 0.05 if name in ("4-bit", "two-level") else None
        four = name in ("4-bit", "two-level")
        return quantized.QuantizedWeight(
            codes=codes4 if four else codes8, k=k, bits=4 if four else 8, group=group, per_super=per_super,
            scale=scale, scale_sub=sub, offset=offset,
            offset_sub=torch.randint(0, 64, (n, groups), dtype=torch.int8, generator=gen) if sub is not None else None,
            format=name, fp8=name == "fp8").to(device)

    out = []
    inter = -(-w.intermediate // 256) * 256
    for name in ("int8", "fp8", "4-bit", "two-level"):
        for rows, (n, k) in ((1, (w.intermediate, -(-w.hidden // 256) * 256)), (_ROWS * 5, (w.hidden, inter))):
            weight = layout(name, n, k)
            x = rand(rows, k)
            reference = torch.nn.functional.linear(x, weight.stored(dtype))
            out.append((f"quantized linear, {name}, {rows} rows", (x, weight), reference))
    return out


# (name, each sequence's adapter slot (-1: the base model), its rows)
_LORA_STEPS = (
    ("decode", [2, -1, 0, 3, 2, -1, 0], [1] * 7),
    ("prefill beside decodes", [1, -1, 3, 1], [70, 3, 1, 2]),  # 72 rows of one adapter: two row tiles
)


def _lora_cases(rand, w, device: str, dtype: torch.dtype) -> list:
    """A pool of 4 adapters on the merged q/k/v projection (three parts, at the model's head
    widths, rank 16) and on the MLP's down projection (rank 8); some adapters of half the rank,
    some leaving a projection out. The rows' starting values (the base output) are of the same
    scale as the adapters' contribution, so a kernel that drops or misplaces one shows."""
    q, kv = w.heads * w.head_dim, w.kv_heads * w.head_dim
    out = []
    for name, in_features, parts, rank in (("q/k/v", w.hidden, [(0, q), (q, kv), (q + kv, kv)], 16),
                                           ("down", w.intermediate, [(0, w.hidden)], 8)):
        pool = lora.LoraPool(4, rank, in_features, parts, dtype, device, Kernels())
        for slot in range(4):
            r = rank if slot % 2 == 0 else rank // 2
            for part, (_, size) in enumerate(parts):
                if (slot + part) % 4 != 3:
                    pool.set(slot, part, rand(r, in_features) / in_features ** 0.5, rand(size, r) / r ** 0.5)
        for step, seq_slots, lengths in _LORA_STEPS:
            rows = lora.LoraRows.build(seq_slots, lengths, 4, device)
            x, y = rand(sum(lengths), in_features), rand(sum(lengths), pool.bt.shape[2])
            out.append((f"LoRA, {name}, {step}", (pool, y, x, rows), pool.add_grouped(y.clone(), x, rows)))
    return out


def _rope_case(rand, heads: int, head_dim: int, device: str, dtype: torch.dtype, name: str):
    q, weight = rand(_ROWS, heads, head_dim), rand(head_dim)
    angles = torch.arange(_ROWS, dtype=torch.float32)[:, None] * torch.linspace(0.01, 1.0, head_dim // 2)
    angles = torch.cat((angles, angles), dim=-1)[:, None, :]
    cos, sin = angles.cos().to(device=device, dtype=dtype), angles.sin().to(device=device, dtype=dtype)
    reference = norm.apply_rotary(norm.rms_norm_reference(q, weight, _EPS), cos, sin)
    return f"norm_rope ({name})", (q, weight, _EPS, cos, sin), reference


# (name, block size, [(cached positions, new tokens) per sequence])
_ATTENTION_SHAPES = (
    ("decode", 16, [(40, 1), (1, 1), (130, 1)]),
    ("prefill", 16, [(0, 37)]),
    ("chunk after a cached prefix", 16, [(32, 20), (0, 5)]),
    ("block size not dividing the chunk", 12, [(7, 30), (50, 1)]),
    ("a lone first token", 16, [(0, 1)]),
)


def _attention_cases(rand, w, device: str, gen: torch.Generator) -> list:
    out = []
    for name, block_size, seqs in _ATTENTION_SHAPES:
        blocks_each = [math.ceil((cached + new) / block_size) for cached, new in seqs]
        pool_blocks = sum(blocks_each) + 3
        order = torch.randperm(pool_blocks, generator=gen).tolist()  # blocks scattered through the pool
        tables, at = [], 0
        for n in blocks_each:
            tables.append(order[at : at + n])
            at += n
        k_pool = rand(w.kv_heads, pool_blocks * block_size, w.head_dim)
        v_pool = rand(w.kv_heads, pool_blocks * block_size, w.head_dim)
        tokens = sum(new for _, new in seqs)
        q = rand(tokens, w.heads, w.head_dim)
        meta = build_metadata(tables, [c for c, _ in seqs], [n for _, n in seqs], block_size, device)
        scale = 1.0 / math.sqrt(w.head_dim)
        reference = paged_attention_reference(q, k_pool, v_pool, meta, scale)
        out.append((f"paged attention, {name}", (q, k_pool, v_pool, meta, scale), reference))
    return out
