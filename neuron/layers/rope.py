"""Rotary position embeddings for the dense families: the inverse frequencies of each rope type a
checkpoint may carry (`default`, `linear`, `llama3`, `yarn`), the context length they stretch the
model to, and the per-position cos/sin tables the attention layers index.

The parameters come from transformers 5's `rope_parameters` or the older `rope_scaling` (beside a
top-level `rope_theta`). Each type's frequencies are computed the way transformers computes them,
in float32 and in the same order, so that positions past the pretraining length match it too.
`dynamic` (NTK) is refused: transformers recomputes its frequencies as a sequence grows, so keys
already cached carry older ones, which tables per position cannot reproduce."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from neuron.errors import ConfigError

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# What each type needs beyond `factor`; a missing one is refused by name.
_REQUIRED = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
             "yarn": ("factor",)}
_WHY_NOT = {
    "dynamic": "its frequencies change as a sequence grows (transformers recomputes them per step), which "
               "per-position tables cannot match",
    "longrope": "it is Phi-3's, and no family neuron runs uses it",
}


@dataclass(frozen=True, slots=True)
class RopeScaling:
    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    original_max_position_embeddings: int | None = None  # the pretraining length (llama3, yarn)
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn: scales cos and sin; derived from factor and mscale if None
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn: round the correction range outwards

    @classmethod
    def from_config(cls, d: dict) -> RopeScaling:
        """The rope of a (text) config dict; an unknown or inexact type is refused naming it."""
        params = rope_parameters(d)
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            why = _WHY_NOT.get(rope_type, "neuron does not implement it")
            raise ConfigError(f"rope type {rope_type!r} is not supported ({why}); supported: {', '.join(ROPE_TYPES)}. "
                              "Remove the rope scaling from config.json (or override it with --hf-overrides) to run "
                              "at the native context length")
        missing = [k for k in _REQUIRED.get(rope_type, ()) if params.get(k) is None]
        if missing:
            raise ConfigError(f"rope type {rope_type!r} needs {', '.join(missing)} in the config's rope parameters")
        theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
        original = d.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
        if rope_type in ("llama3", "yarn"):
            original = original or d.get("max_position_embeddings")
            if original is None:
                raise ConfigError(f"rope type {rope_type!r} needs original_max_position_embeddings")
        try:
            return cls(rope_type, float(theta), float(params.get("factor") or 1.0),
                       None if original is None else int(original),
                       low_freq_factor=float(params.get("low_freq_factor", 1.0)),
                       high_freq_factor=float(params.get("high_freq_factor", 4.0)),
                       beta_fast=float(params.get("beta_fast") or 32.0),
                       beta_slow=float(params.get("beta_slow") or 1.0),
                       attention_factor=_optional_float(params.get("attention_factor")),
                       mscale=_optional_float(params.get("mscale")),
                       mscale_all_dim=_optional_float(params.get("mscale_all_dim")),
                       truncate=bool(params.get("truncate", True)))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"rope parameters {params!r} are malformed: {exc}") from None

    def max_len(self, max_position_embeddings: int) -> int:
        """The context the scaling stretches the model to: what `max_model_len` defaults to and may
        reach. llama3 checkpoints already state the stretched length; yarn stretches its original."""
        if self.rope_type == "linear":
            return int(max_position_embeddings * self.factor)
        if self.rope_type == "yarn":
            return max(max_position_embeddings, int(self.original_max_position_embeddings * self.factor))
        return max_position_embeddings

    def inv_freq(self, dim: int) -> tuple[torch.Tensor, float]:
        """The inverse frequencies of a `dim`-wide rotary embedding and the factor on cos and sin."""
        base = 1.0 / (self.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        if self.rope_type == "linear":
            return base / self.factor, 1.0
        if self.rope_type == "llama3":
            return self._llama3(base), 1.0
        if self.rope_type == "yarn":
            return self._yarn(dim)
        return base, 1.0

    def _llama3(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """Wavelengths longer than the pretraining length / low_freq_factor are stretched by
        `factor`, shorter than it / high_freq_factor kept, and those between blended smoothly."""
        old = self.original_max_position_embeddings
        low_wavelen, high_wavelen = old / self.low_freq_factor, old / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (old / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        blended = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, blended, scaled)

    def _yarn(self, dim: int) -> tuple[torch.Tensor, float]:
        """Dimensions that turn many times over the pretraining length keep their frequency, those
        that turn less than once are interpolated by `factor`, a linear ramp between; cos and sin are
        scaled by the attention factor (0.1 ln(factor) + 1 unless the config says otherwise)."""
        pos_freqs = self.theta ** (torch.arange(0, dim, 2).float() / dim)
        extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (self.factor * pos_freqs)
        low, high = self._correction_range(dim)
        if low == high:
            high += 0.001  # a ramp of zero width
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        keep = 1 - ramp
        return interpolation * (1 - keep) + extrapolation * keep, self._attention_factor()

    def _correction_range(self, dim: int) -> tuple[float, float]:
        def dim_of(rotations: float) -> float:
            turns = self.original_max_position_embeddings / (rotations * 2 * math.pi)
            return dim * math.log(turns) / (2 * math.log(self.theta))

        low, high = dim_of(self.beta_fast), dim_of(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        return max(low, 0), min(high, dim - 1)

    def _attention_factor(self) -> float:
        if self.attention_factor is not None:
            return self.attention_factor

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return float(mscale(self.factor, self.mscale) / mscale(self.factor, self.mscale_all_dim))
        return mscale(self.factor)


def rope_parameters(d: dict) -> dict:
    """transformers 5's `rope_parameters` with the older `rope_scaling` laid over it (an override
    given as `rope_scaling` then wins), each's `type` read as `rope_type`. Every model reads its
    rope through this, so an override is never seen by one part and missed by another."""
    out: dict = {}
    for source in (d.get("rope_parameters"), d.get("rope_scaling")):
        if isinstance(source, dict):
            source = dict(source)
            if "type" in source:
                source.setdefault("rope_type", source.pop("type"))
            out.update(source)
    return out


def _optional_float(value) -> float | None:
    return None if value is None else float(value)


class Rotary:
    """cos and sin for every position up to the model length, indexed per token."""

    def __init__(self, head_dim: int, scaling: RopeScaling, max_len: int, dtype, device):
        inv_freq, attention_factor = scaling.inv_freq(head_dim)
        freqs = torch.arange(max_len, dtype=torch.float)[:, None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * attention_factor).to(device=device, dtype=dtype)
        self.sin = (emb.sin() * attention_factor).to(device=device, dtype=dtype)

    def tables(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for this step's positions, shaped to broadcast over heads."""
        return self.cos[pos].unsqueeze(1), self.sin[pos].unsqueeze(1)
