"""Safetensors checkpoints stored quantized: FP8 block-wise, AWQ, GPTQ and compressed-tensors.

The checkpoint's quantization config names the method; `stored_format` checks it before any worker
starts, refusing what neuron does not read by name. `PrequantizedReader` then hands each
linear layer its slice of the stored codes and scales as a QuantizedWeight (neuron/layers/quantized.py)
holding the same values the format's own dequantization gives:

- FP8 (`quant_method: fp8`, e4m3 weights with `weight_scale_inv` per block of
  `weight_block_size` [rows, inputs]): the e4m3 bytes kept as they are, one scale per row and
  group of inputs, each group within one block (a rank's share may cut blocks, see `_fp8`).
- AWQ (AutoAWQ's GEMM layout): `qweight` int32 [inputs, outputs / 8] with each word's eight
  nibbles in the order 0, 2, 4, 6, 1, 3, 5, 7; `qzeros` likewise [groups, outputs / 8]; `scales`
  [groups, outputs]. W = (q - z) s.
- GPTQ (v1 checkpoints): `qweight` int32 [inputs * bits / 32, outputs] packed along the inputs,
  `qzeros` [groups, outputs * bits / 32] holding z - 1, `scales`, and `g_idx` (each input's group;
  out of order under act-order, `desc_act`).
- compressed-tensors `pack-quantized` (W4A16, W8A16): `weight_packed` int32 [outputs,
  inputs * bits / 32] of signed values offset by 2^(bits-1), `weight_scale` [outputs, groups],
  an optional `weight_zero_point` packed along the outputs, an optional `weight_g_idx`.

Groups that are runs of consecutive inputs map straight onto the kernel's layout. Groups that are
not (act-order, or a rank's share of the inputs cutting through groups) are gathered: the stored
columns are each group's inputs, padded to a common length, and the layer gathers its input into
that order first (QuantizedWeight.input_index).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from neuron.errors import ConfigError
from neuron.layers.quantized import QuantizedWeight, pack_nibbles
from neuron.layers.tensor_parallel import Reader

METHODS = ("fp8", "awq", "gptq", "compressed-tensors")
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds output column 8c + _AWQ_ORDER[i]


def stored_format(q: dict | None) -> dict | None:
    """A checkpoint's quantization config (config.json's `quantization_config`, which the model's
    configuration reads) as the format readers here take it, or None for none; ConfigError for
    what neuron does not read, saying what it is."""
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ConfigError(f"quantization_config must be an object, got {str(q)[:80]!r}")
    method = q.get("quant_method")
    if method not in METHODS:
        raise ConfigError(f"checkpoint quantization {method!r} is not supported (supported: {', '.join(METHODS)}, "
                          "and GGUF files)")
    if method == "fp8":
        block = q.get("weight_block_size")
        if not (isinstance(block, list) and len(block) == 2
                and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise ConfigError("fp8 checkpoints are read with block-wise scales (weight_block_size [128, 128]); "
                              f"this one has weight_block_size {block!r}")
        if q.get("fmt", "e4m3") != "e4m3":
            raise ConfigError(f"fp8 format {q.get('fmt')!r} is not supported (e4m3 is)")
        return {"method": "fp8", "block": [int(b) for b in block], "skip": list(q.get("modules_to_not_convert") or [])}
    if method in ("awq", "gptq"):
        bits, group = int(q.get("bits", q.get("w_bit", 4))), int(q.get("group_size", q.get("q_group_size", 128)))
        if method == "awq" and (bits != 4 or str(q.get("version", "gemm")).lower() != "gemm"):
            raise ConfigError(f"AWQ is read in AutoAWQ's GEMM layout at 4 bits; this checkpoint has version "
                              f"{q.get('version')!r}, {bits} bits")
        if method == "gptq" and bits not in (4, 8):
            raise ConfigError(f"GPTQ is read at 4 or 8 bits; this checkpoint has {bits}")
        if method == "gptq" and str(q.get("checkpoint_format", "gptq")) != "gptq":
            raise ConfigError(f"GPTQ checkpoint_format {q.get('checkpoint_format')!r} is not supported "
                              "(gptq, the v1 layout, is)")
        if method == "awq" and not q.get("zero_point", True):
            raise ConfigError("AWQ without zero points is not supported")
        return {"method": method, "bits": bits, "group": group, "skip": list(q.get("modules_to_not_convert") or [])}
    return _compressed_tensors(q)


def _compressed_tensors(q: dict) -> dict:
    fmt = q.get("format")
    groups = q.get("config_groups") or {}
    if len(groups) != 1:
        raise ConfigError(f"compressed-tensors with {len(groups)} config groups is not supported (one is)")
    scheme = next(iter(groups.values()))
    w = scheme.get("weights") or {}
    fmt = scheme.get("format") or fmt
    if fmt != "pack-quantized" or scheme.get("input_activations"):
        raise ConfigError(f"compressed-tensors format {fmt!r} with activations "
                          f"{'quantized' if scheme.get('input_activations') else 'unquantized'} is not supported "
                          "(pack-quantized weight-only, W4A16 and W8A16, is)")
    if w.get("type", "int") != "int" or int(w.get("num_bits", 0)) not in (4, 8) \
            or w.get("strategy") not in ("group", "channel"):
        raise ConfigError(f"compressed-tensors weights {w.get('type')} {w.get('num_bits')} bits by "
                          f"{w.get('strategy')} are not supported (int 4 or 8 bits by group or channel are)")
    return {"method": "compressed-tensors", "bits": int(w["num_bits"]),
            "group": int(w["group_size"]) if w.get("strategy") == "group" else 0,
            "symmetric": bool(w.get("symmetric", True)), "skip": list(q.get("ignore") or [])}


# ---- integer codes to QuantizedWeight --------------------------------------------------------------


def _grouped(q: torch.Tensor, bits: int, group_of: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
             fmt: str, name: str) -> QuantizedWeight:
    """Codes q [n, k] (unsigned, 0..2^bits-1) whose input j belongs to group group_of[j], with
    W = (q - z) s per group (scales, zeros [n, groups], zeros None meaning 2^(bits-1)).
    Runs of consecutive inputs of one common length (a multiple of 32) store as they are; anything
    else is gathered into padded runs (input_index). Scales, zeros and group indices that do not
    cover the codes are refused naming the weight (`name`)."""
    n, k = q.shape
    _check_groups(name, n, k, group_of, scales, zeros)
    align = 32
    order = torch.argsort(group_of, stable=True)
    ids, counts = torch.unique_consecutive(group_of[order], return_counts=True)
    length = -(-int(counts.max()) // align) * align
    regular = bool((counts == length).all()) and torch.equal(order, torch.arange(k))
    if regular:
        codes, index = q, None
    else:
        index = torch.full((len(ids) * length,), k, dtype=torch.long)
        starts = torch.cumsum(counts, 0) - counts
        slot = torch.arange(k) - torch.repeat_interleave(starts, counts)  # place within its group
        index[torch.repeat_interleave(torch.arange(len(ids)), counts) * length + slot] = order
        codes = torch.nn.functional.pad(q, (0, 1))[:, index]  # padding: code 0, input 0
    s = scales[:, ids].float()
    z = torch.full_like(s, float(1 << (bits - 1))) if zeros is None else zeros[:, ids].float()
    if bits == 4:
        stored, offset = pack_nibbles(codes), s * z
    else:  # 8-bit codes held as int8: q - 128, with the 128 moved into the offset
        stored = (codes - 128).to(torch.int8).view(torch.uint8)
        offset = s * (z - 128)
    return QuantizedWeight(codes=stored.contiguous(), k=codes.shape[1], bits=bits, group=length, scale=s.contiguous(),
                           offset=offset.contiguous(), format=fmt, input_index=index, inputs=k if index is not None else 0)


def _check_groups(name: str, n: int, k: int, group_of: torch.Tensor, scales: torch.Tensor,
                  zeros: torch.Tensor | None) -> None:
    """A short scales or zeros tensor, or a group index past them, would index out of range (or, for
    a negative index, silently wrap): refused here, naming the weight."""
    if len(group_of) != k:
        raise ConfigError(f"{name}: its group index covers {len(group_of)} inputs, not the weight's {k}")
    groups = int(group_of.max()) + 1 if k else 0
    if k and int(group_of.min()) < 0:
        raise ConfigError(f"{name}: its group index holds {int(group_of.min())}, below 0")
    for what, t in (("scales", scales), ("zeros", zeros)):
        if t is not None and (t.dim() != 2 or t.shape[0] != n or t.shape[1] < groups):
            raise ConfigError(f"{name}: its {what} read as {list(t.shape)}, too few for {n} outputs in {groups} groups")


def _unpack_rows(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 words [r, c] packed along the rows (element 32/bits * r + i in bits i*bits..) -> [r * 32/bits, c]."""
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int32) * bits
    out = (words.unsqueeze(1) >> shifts.view(1, per, 1)) & ((1 << bits) - 1)
    return out.reshape(-1, words.shape[1])


def _unpack_cols(words: torch.Tensor, bits: int, order=None) -> torch.Tensor:
    """int32 words [r, c] packed along the columns -> [r, c * 32/bits]; `order`: which column each nibble holds."""
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int32) * bits
    out = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [r, c, per], nibble i
    if order is not None:
        out = out[..., list(np.argsort(order))]  # column position p holds nibble order.index(p)
    return out.reshape(words.shape[0], -1)


def _ranges(dim: int | None, start: int, end: int | None, n: int, k: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The output rows and input columns of a read of [n, k] sliced along `dim` (None: whole)."""
    rows = (start, n if end is None else end) if dim == 0 else (0, n)
    cols = (start, k if end is None else end) if dim == 1 else (0, k)
    return rows, cols


class PrequantizedReader(Reader):
    """Linear weights of a quantized safetensors checkpoint as QuantizedWeight slices; everything
    else as the inner reader gives it."""

    def __init__(self, inner, spec: dict):
        self.inner = inner
        self.spec = spec

    def has(self, name: str) -> bool:
        prefix = name.removesuffix(".weight")
        return self.inner.has(name) or any(self.inner.has(f"{prefix}.{p}") for p in ("qweight", "weight_packed"))

    def shape(self, name: str) -> list[int] | None:
        """Stored as is (FP8 codes, unquantized tensors); packed formats tell their shape when read."""
        return self.inner.shape(name) if self.inner.has(name) else None

    def source(self, name: str) -> str:
        return self.inner.source(name)

    def read(self, name, dim=None, start=0, end=None) -> torch.Tensor:
        w = self.read_weight(name, dim, start, end)
        return w.dequantize() if isinstance(w, QuantizedWeight) else w

    def head_weight(self, w):
        return self.inner.head_weight(w)

    def read_weight(self, name, dim=None, start=0, end=None, vocab=False):
        prefix, method = name.removesuffix(".weight"), self.spec["method"]
        if not name.endswith(".weight"):
            return self.inner.read_weight(name, dim, start, end, vocab)
        if method == "fp8" and self.inner.has(f"{name}_scale_inv"):
            return self._fp8(name, dim, start, end)
        if method in ("awq", "gptq") and self.inner.has(f"{prefix}.qweight"):
            return self._awq(prefix, dim, start, end) if method == "awq" else self._gptq(prefix, dim, start, end)
        if method == "compressed-tensors" and self.inner.has(f"{prefix}.weight_packed"):
            return self._compressed(prefix, dim, start, end)
        return self.inner.read_weight(name, dim, start, end, vocab)

    def _shape(self, name: str) -> list[int]:
        return self.inner.shape(name)

    # FP8 ---------------------------------------------------------------------------------------

    def _fp8(self, name, dim, start, end) -> QuantizedWeight:
        n, k = self._shape(name)
        bm, bk = self.spec["block"]
        rows, cols = _ranges(dim, start, end, n, k)
        scale = self.inner.read(f"{name}_scale_inv").float()
        grid = (-(-n // bm), -(-k // bk))
        if tuple(scale.shape) != grid:
            raise ConfigError(f"{name}_scale_inv has shape {list(scale.shape)}; an fp8 weight of {n} x {k} in blocks "
                              f"of {bm} x {bk} needs {list(grid)} (config.json's weight_block_size must be the "
                              "file's)")
        # A rank's share may cut blocks (Qwen3-30B-A3B's 768-wide experts at tp 4: 192 rows or inputs
        # a rank against 128-wide blocks). Rows need nothing: each takes its block row's scales. The
        # inputs [start, end) are held in groups of gcd(bk, start, end), each inside one block and
        # taking its scale: the kernels' plain layout, without gathered inputs or padding (groups of
        # 64 there). A group under 16 (a rank's width not a multiple of 16) stays correct but leaves
        # the CPU kernel for the reference.
        group = math.gcd(bk, *cols)
        per_row = scale[torch.arange(*rows) // bm]
        per_group = per_row[:, torch.arange(*cols, group) // bk]
        w = self.inner.read(name, dim, start, end)
        return QuantizedWeight(codes=w.view(torch.uint8).contiguous(), k=cols[1] - cols[0], bits=8, group=group,
                               scale=per_group.contiguous(), format="fp8", fp8=True)

    # AWQ ---------------------------------------------------------------------------------------

    def _awq(self, prefix, dim, start, end) -> QuantizedWeight:
        group = self.spec["group"]
        k, n8 = self._shape(f"{prefix}.qweight")
        n = n8 * 8
        rows, cols = _ranges(dim, start, end, n, k)
        w0, w1 = rows[0] // 8, -(-rows[1] // 8)
        qweight = self.inner.read(f"{prefix}.qweight", 0, *cols)[:, w0:w1]
        q = _unpack_cols(qweight, 4, _AWQ_ORDER).T[rows[0] - 8 * w0: rows[1] - 8 * w0]  # [out, in]
        zeros = _unpack_cols(self.inner.read(f"{prefix}.qzeros")[:, w0:w1], 4, _AWQ_ORDER).T
        zeros = zeros[rows[0] - 8 * w0: rows[1] - 8 * w0]
        scales = self.inner.read(f"{prefix}.scales")[:, rows[0]:rows[1]].T
        group = group if group > 0 else k
        return _grouped(q, 4, torch.arange(*cols) // group, scales, zeros, "awq", prefix)

    # GPTQ --------------------------------------------------------------------------------------

    def _gptq(self, prefix, dim, start, end) -> QuantizedWeight:
        bits, group = self.spec["bits"], self.spec["group"]
        per = 32 // bits
        k8, n = self._shape(f"{prefix}.qweight")
        k = k8 * per
        rows, cols = _ranges(dim, start, end, n, k)
        r0, r1 = cols[0] // per, -(-cols[1] // per)
        qweight = self.inner.read(f"{prefix}.qweight", 0, r0, r1)[:, rows[0]:rows[1]]
        q = _unpack_rows(qweight, bits)[cols[0] - per * r0: cols[1] - per * r0].T  # [out, in]
        zeros = _unpack_cols(self.inner.read(f"{prefix}.qzeros"), bits)[:, rows[0]:rows[1]].T + 1  # v1: z - 1
        scales = self.inner.read(f"{prefix}.scales")[:, rows[0]:rows[1]].T
        if self.inner.has(f"{prefix}.g_idx"):
            group_of = self.inner.read(f"{prefix}.g_idx").long()[cols[0]:cols[1]]
        else:
            group_of = torch.arange(*cols) // (group if group > 0 else k)
        return _grouped(q, bits, group_of, scales, zeros & ((1 << bits) - 1), "gptq", prefix)

    # compressed-tensors ----------------------------------------------------------------------

    def _compressed(self, prefix, dim, start, end) -> QuantizedWeight:
        bits, group = self.spec["bits"], self.spec["group"]
        per = 32 // bits
        shape = self.inner.read(f"{prefix}.weight_shape")
        if tuple(shape.shape) != (2,) or shape.is_floating_point() or not bool((shape > 0).all()):
            raise ConfigError(f"{prefix}.weight_shape must hold two positive sizes, got {str(shape.tolist())[:80]}")
        n, k = (int(v) for v in shape.tolist())
        rows, cols = _ranges(dim, start, end, n, k)
        c0, c1 = cols[0] // per, -(-cols[1] // per)
        packed = self.inner.read(f"{prefix}.weight_packed", 0, *rows)[:, c0:c1]
        q = _unpack_cols(packed, bits)[:, cols[0] - per * c0: cols[1] - per * c0]  # unsigned: value + 2^(bits-1)
        scales = self.inner.read(f"{prefix}.weight_scale", 0, *rows)
        zeros = None
        if self.inner.has(f"{prefix}.weight_zero_point"):
            zp = _unpack_rows(self.inner.read(f"{prefix}.weight_zero_point"), bits)[:n]  # [n, groups], offset
            zeros = zp[rows[0]:rows[1]]
        if self.inner.has(f"{prefix}.weight_g_idx"):
            group_of = self.inner.read(f"{prefix}.weight_g_idx").long()[cols[0]:cols[1]]
        else:
            group_of = torch.arange(*cols) // (group if group > 0 else k)
        return _grouped(q, bits, group_of, scales, zeros, "compressed-tensors", prefix)

    def close(self) -> None:
        self.inner.close()
