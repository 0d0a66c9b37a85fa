"""Quantized safetensors checkpoints written from a transformers one, each in its format's documented
layout: FP8 block-wise, AutoAWQ GEMM, GPTQ v1 (act-order too) and compressed-tensors pack-quantized.

Every writer returns (quantized checkpoint, dense weights): the dense tensors are the format's
dequantization of what was written, computed here from the integers and scales before packing, so
a test can compare both what neuron holds and what it generates against them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _linear_names(tensors: dict) -> list[str]:
    return [n for n in tensors if n.endswith(".weight") and n.split(".")[-2] in LINEAR]


def _copy_config(src: Path, dst: Path, quantization_config: dict) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config, indent=2))


def _asymmetric(w: torch.Tensor, bits: int, group_of: torch.Tensor, groups: int):
    """Per (row, group) min/max rounding: integer codes q, zeros z, fp16 scales s with w ~ (q - z) s."""
    top = (1 << bits) - 1
    n = w.shape[0]
    lo = torch.full((n, groups), float("inf")).scatter_reduce(1, group_of.expand(n, -1), w, "amin")
    hi = torch.full((n, groups), float("-inf")).scatter_reduce(1, group_of.expand(n, -1), w, "amax")
    lo, hi = lo.clamp(max=0), hi.clamp(min=0)
    s = ((hi - lo) / top).clamp(min=1e-8).half()
    z = torch.round(-lo / s.float()).clamp(0, top).to(torch.int32)
    q = torch.round(w / s.float()[:, group_of] + z[:, group_of]).clamp(0, top).to(torch.int32)
    dense = (q - z[:, group_of]).float() * s.float()[:, group_of]
    return q, z, s, dense


def _pack_cols(values: torch.Tensor, bits: int, order=None) -> torch.Tensor:
    """[r, c] ints -> int32 [r, c * bits / 32], packed along the columns (word j holds columns
    per*j + order[i] in bits i*bits..)."""
    per = 32 // bits
    v = values.reshape(values.shape[0], -1, per).to(torch.int64)
    order = order or tuple(range(per))
    out = torch.zeros(v.shape[:2], dtype=torch.int64)
    for i, col in enumerate(order):
        out |= v[:, :, col] << (bits * i)
    return _to_int32(out)


def _to_int32(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def _pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    return _pack_cols(values.T.contiguous(), bits).T.contiguous()


def fp8_checkpoint(src: Path, dst: Path, block=(128, 128), scale_dtype=torch.float32):
    tensors = load_file(src / "model.safetensors")
    dense = {}
    bm, bk = block
    for name in _linear_names(tensors):
        w = tensors[name].float()
        n, k = w.shape
        blocks = w.reshape(n // bm, bm, k // bk, bk)
        scale = (blocks.abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12).to(scale_dtype)
        q = (blocks / scale.float()[:, None, :, None]).reshape(n, k).to(torch.float8_e4m3fn)
        tensors[name] = q
        tensors[f"{name}_scale_inv"] = scale
        dense[name] = (q.float().reshape(n // bm, bm, k // bk, bk) * scale.float()[:, None, :, None]).reshape(n, k)
    _copy_config(src, dst, {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": list(block), "modules_to_not_convert": ["lm_head"]})
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst, dense


def awq_checkpoint(src: Path, dst: Path, group: int = 128):
    tensors = load_file(src / "model.safetensors")
    dense = {}
    for name in _linear_names(tensors):
        w = tensors.pop(name).float()
        n, k = w.shape
        q, z, s, dense[name] = _asymmetric(w, 4, torch.arange(k) // group, k // group)
        prefix = name.removesuffix(".weight")
        tensors[f"{prefix}.qweight"] = _pack_cols(q.T.contiguous(), 4, _AWQ_ORDER)  # [in, out / 8]
        tensors[f"{prefix}.qzeros"] = _pack_cols(z.T.contiguous(), 4, _AWQ_ORDER)  # [groups, out / 8]
        tensors[f"{prefix}.scales"] = s.T.contiguous()  # [groups, out]
    _copy_config(src, dst, {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                            "version": "gemm"})
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst, dense


def gptq_checkpoint(src: Path, dst: Path, bits: int = 4, group: int = 128, act_order: bool = False, seed: int = 0):
    tensors = load_file(src / "model.safetensors")
    dense = {}
    g = torch.Generator().manual_seed(seed)
    for name in _linear_names(tensors):
        w = tensors.pop(name).float()
        n, k = w.shape
        rank = torch.randperm(k, generator=g) if act_order else torch.arange(k)  # position in activation order
        g_idx = (rank // group).to(torch.int32)
        q, z, s, dense[name] = _asymmetric(w, bits, g_idx.long(), k // group)
        prefix = name.removesuffix(".weight")
        tensors[f"{prefix}.qweight"] = _pack_rows(q.T.contiguous(), bits)  # [in * bits / 32, out]
        tensors[f"{prefix}.qzeros"] = _pack_cols((z.T - 1) & ((1 << bits) - 1), bits)  # v1 stores z - 1
        tensors[f"{prefix}.scales"] = s.T.contiguous()
        tensors[f"{prefix}.g_idx"] = g_idx
    _copy_config(src, dst, {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order,
                            "sym": False, "checkpoint_format": "gptq"})
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst, dense


def compressed_tensors_checkpoint(src: Path, dst: Path, bits: int = 4, group: int = 128, symmetric: bool = True):
    """W4A16 / W8A16 pack-quantized, packed by compressed-tensors' own pack_to_int32."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    tensors = load_file(src / "model.safetensors")
    dense = {}
    half = 1 << (bits - 1)
    for name in _linear_names(tensors):
        w = tensors.pop(name).float()
        n, k = w.shape
        group_of = torch.arange(k) // group
        prefix = name.removesuffix(".weight")
        if symmetric:
            amax = w.abs().reshape(n, k // group, group).amax(-1)
            s = (amax / (half - 1)).clamp(min=1e-8).to(torch.bfloat16)
            q = torch.round(w / s.float()[:, group_of]).clamp(-half, half - 1).to(torch.int8)
            dense[name] = q.float() * s.float()[:, group_of]
        else:
            qu, z, s16, _ = _asymmetric(w, bits, group_of, k // group)
            s = s16.to(torch.bfloat16)
            q = (qu - half).to(torch.int8)
            zp = (z - half).to(torch.int8)
            dense[name] = (q.float() - zp.float()[:, group_of]) * s.float()[:, group_of]
            tensors[f"{prefix}.weight_zero_point"] = pack_to_int32(zp, bits, packed_dim=0)
        tensors[f"{prefix}.weight_packed"] = pack_to_int32(q, bits)
        tensors[f"{prefix}.weight_scale"] = s
        tensors[f"{prefix}.weight_shape"] = torch.tensor([n, k])
    scheme = {"weights": {"num_bits": bits, "type": "int", "symmetric": symmetric, "strategy": "group",
                          "group_size": group, "dynamic": False, "observer": "minmax"},
              "targets": ["Linear"], "input_activations": None, "output_activations": None,
              "format": "pack-quantized"}
    _copy_config(src, dst, {"quant_method": "compressed-tensors", "format": "pack-quantized",
                            "quantization_status": "compressed", "config_groups": {"group_0": scheme},
                            "ignore": ["lm_head"]})
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst, dense


def dense_checkpoint(src: Path, dst: Path, dense: dict) -> Path:
    """`src` with its linear weights replaced by `dense` (a format's dequantization), unquantized:
    what transformers runs as the reference."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    tensors = load_file(src / "model.safetensors")
    tensors.update({k: v.contiguous() for k, v in dense.items()})
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst
