"""The Qwen3.5 vision tower, replicated whole on every rank: patches in, one embedding per merged
2x2 block of patches out, ready to replace the prompt's image placeholders.

Every rank runs it on the same pixels (each preprocesses the same image bytes) and gets the same
embeddings, so no collective runs and nothing is broadcast. Attention is bidirectional within an
image and never across images.
"""

from __future__ import annotations

import hashlib

import torch
import torch.nn.functional as F

from neuron.errors import ConfigError
from neuron.layers.tensor_parallel import Reader
from neuron.utils.lru import SizedLRU


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


_ACTS = {"gelu_pytorch_tanh": _gelu_tanh, "gelu": F.gelu, "silu": F.silu}


class _Linear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight, self.bias = weight, bias

    @classmethod
    def load(cls, r: Reader, name: str, dtype, device) -> "_Linear":
        bias = r.read(f"{name}.bias").to(device=device, dtype=dtype) if r.has(f"{name}.bias") else None
        return cls(r.read(f"{name}.weight").to(device=device, dtype=dtype).contiguous(), bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class _LayerNorm:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-6):
        self.weight, self.bias, self.eps = weight, bias, eps

    @classmethod
    def load(cls, r: Reader, name: str, dtype, device) -> "_LayerNorm":
        return cls(r.read(f"{name}.weight").to(device=device, dtype=dtype),
                   r.read(f"{name}.bias").to(device=device, dtype=dtype))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class _Block:
    def __init__(self, r: Reader, p: str, heads: int, act, dtype, device):
        self.norm1 = _LayerNorm.load(r, f"{p}.norm1", dtype, device)
        self.norm2 = _LayerNorm.load(r, f"{p}.norm2", dtype, device)
        self.qkv = _Linear.load(r, f"{p}.attn.qkv", dtype, device)
        self.proj = _Linear.load(r, f"{p}.attn.proj", dtype, device)
        self.fc1 = _Linear.load(r, f"{p}.mlp.linear_fc1", dtype, device)
        self.fc2 = _Linear.load(r, f"{p}.mlp.linear_fc2", dtype, device)
        self.heads, self.act = heads, act

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(self.norm1(x)).view(n, 3, self.heads, -1).unbind(1)  # [n, heads, d] each
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        # [1, heads, n, d]: SDPA's memory-efficient (flash) kernels take 4-D inputs only; a 3-D call
        # takes the math path, whose heads x n x n scores are gigabytes for one large image.
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        outs = [F.scaled_dot_product_attention(qi, ki, vi)
                for qi, ki, vi in zip(q.split(lengths, 2), k.split(lengths, 2), v.split(lengths, 2))]
        o = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
        x = x + self.proj(o[0].transpose(0, 1).reshape(n, -1))
        return x + self.fc2(self.act(self.fc1(self.norm2(x))))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in float32 (as the reference), back to the input's dtype."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


class EmbeddingCache:
    """The vision tower's output for the images seen last, up to `max_bytes`, keyed by a digest of
    each image's URI. A request's `n` samples carry the same image, each in a sequence of its own
    (in one step or in several), so without it the tower would run once per sample. Every rank
    sees the same steps, so every rank's cache holds the same images."""

    def __init__(self, max_bytes: int = 64 * 2**20):
        self.max_bytes = max_bytes
        self._entries: SizedLRU[bytes, tuple[tuple[int, int, int], torch.Tensor]] = SizedLRU(max_bytes)

    @staticmethod
    def key(uri: str) -> bytes:
        return hashlib.sha256(uri.encode()).digest()

    def get(self, key: bytes):
        return self._entries.get(key)

    def put(self, key: bytes, grid: tuple[int, int, int], embeds: torch.Tensor) -> None:
        size = embeds.numel() * embeds.element_size()
        if size > self.max_bytes // 4 or key in self._entries:
            return
        self._entries.put(key, (grid, embeds), size)


class VisionTower:
    """Patch embedding, a learned position grid resampled to each image, 2D rotary attention
    blocks, and the merger that folds each merge x merge block of patches into one token."""

    def __init__(self, vision_config: dict, dtype: torch.dtype, device: torch.device):
        v = vision_config
        self.hidden = int(v.get("hidden_size", 1152))
        self.heads = int(v.get("num_heads", 16))
        self.depth = int(v.get("depth", 27))
        self.merge = int(v.get("spatial_merge_size", 2))
        self.num_positions = int(v.get("num_position_embeddings", 2304))
        self.side = int(self.num_positions ** 0.5)
        act = v.get("hidden_act", "gelu_pytorch_tanh")
        if act not in _ACTS:
            raise ConfigError(f"vision hidden_act {act!r} is not supported (supported: {', '.join(_ACTS)})")
        if self.side * self.side != self.num_positions:
            raise ConfigError(f"vision num_position_embeddings {self.num_positions} is not a square grid")
        if self.hidden % self.heads:
            raise ConfigError(f"vision hidden_size {self.hidden} does not divide by num_heads {self.heads}")
        rope = v.get("rope_parameters") or {}
        self.theta = float(rope.get("rope_theta", 10000.0))
        self.act = _ACTS[act]
        self.dtype, self.device = dtype, device
        self.embeddings = EmbeddingCache()

    def load(self, r: Reader, prefix: str = "model.visual") -> None:
        dt, dev = self.dtype, self.device
        w = r.read(f"{prefix}.patch_embed.proj.weight")  # Conv3d with stride = kernel: a matmul per patch
        self.patch_embed = _Linear(w.reshape(w.shape[0], -1).to(device=dev, dtype=dt).contiguous(),
                                   r.read(f"{prefix}.patch_embed.proj.bias").to(device=dev, dtype=dt))
        self.pos_embed = r.read(f"{prefix}.pos_embed.weight").to(device=dev, dtype=dt)
        self.blocks = [_Block(r, f"{prefix}.blocks.{i}", self.heads, self.act, dt, dev) for i in range(self.depth)]
        self.merger_norm = _LayerNorm.load(r, f"{prefix}.merger.norm", dt, dev)
        self.merger_fc1 = _Linear.load(r, f"{prefix}.merger.linear_fc1", dt, dev)
        self.merger_fc2 = _Linear.load(r, f"{prefix}.merger.linear_fc2", dt, dev)
        head_dim = self.hidden // self.heads
        spatial = head_dim // 2
        self.inv_freq = 1.0 / (self.theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))

    def tensors(self) -> list[torch.Tensor]:
        out = [self.patch_embed.weight, self.pos_embed, self.merger_fc1.weight, self.merger_fc2.weight]
        for b in self.blocks:
            out += [b.qkv.weight, b.proj.weight, b.fc1.weight, b.fc2.weight]
        return out

    @torch.inference_mode()
    def __call__(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """Embeddings [sum of merged tokens, out_hidden] for the patches of `grids`' images, in order."""
        x = self.patch_embed(pixels.to(device=self.device, dtype=self.dtype))
        x = x + torch.cat([self._positions(h, w).repeat(t, 1) for t, h, w in grids]).to(x.dtype)
        cos, sin = self._rotary(grids)
        lengths = [h * w for t, h, w in grids for _ in range(t)]
        for block in self.blocks:
            x = block(x, cos, sin, lengths)
        x = self.merger_norm(x).view(-1, self.hidden * self.merge * self.merge)
        return self.merger_fc2(F.gelu(self.merger_fc1(x)))

    def _positions(self, h: int, w: int) -> torch.Tensor:
        """The learned square position grid resampled (bilinear, corners aligned) to h x w patches,
        in merge-block order."""
        grid = self.pos_embed.float().view(self.side, self.side, -1).permute(2, 0, 1)[None]
        resampled = F.interpolate(grid, size=(h, w), mode="bilinear", align_corners=True)[0]  # [E, h, w]
        m = self.merge
        blocks = resampled.permute(1, 2, 0).reshape(h // m, m, w // m, m, -1).transpose(1, 2)
        return blocks.reshape(h * w, -1)

    def _rotary(self, grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [patches, 1, head_dim] of each patch's (row, column), in merge-block order."""
        m = self.merge
        rows, cols = [], []
        for t, h, w in grids:
            r, c = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
            rows.append(r.reshape(h // m, m, w // m, m).transpose(1, 2).reshape(-1).repeat(t))
            cols.append(c.reshape(h // m, m, w // m, m).transpose(1, 2).reshape(-1).repeat(t))
        fr = torch.cat(rows)[:, None].float() * self.inv_freq
        fc = torch.cat(cols)[:, None].float() * self.inv_freq
        angles = torch.cat((fr, fc, fr, fc), dim=-1)[:, None, :].to(self.device)
        return angles.cos(), angles.sin()
