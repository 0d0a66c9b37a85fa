"""The shape each weight must have, as the config implies it, and a reader that checks every read.

A checkpoint whose tensors disagree with its config.json (a q_proj of [64, 64] where the heads make
[128, 64]) used to load: ranks sliced past the end of the short tensor and got fewer rows than
their neighbours, so one rank failed its forward while the others waited in an all-reduce until
the collective timed out, for every request. Each read is now checked as the rank makes it: the
tensor's stored shape against the config's (where the name is one the table knows), and the slice
against the stored extent, refused with the tensor's name, what was found and what was expected.
Every rank checks the same tensors alike, so they fail the load together.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from neuron.errors import ConfigError
from neuron.layers.quantized import QuantizedWeight
from neuron.layers.tensor_parallel import Reader

Shape = tuple[int, ...]
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_VOCAB_ROWS = ("model.embed_tokens.weight", "lm_head.weight")  # may hold padding rows past vocab_size


def expected_shapes(config: dict) -> Callable[[str], Shape | None]:
    """name -> the full shape the config implies for it, or None for a name the table does not
    know (those reads are still checked against the stored extent)."""
    from neuron.models import RECURRENT_MODEL_TYPES, is_encoder, text_config

    if is_encoder(config):
        return _encoder_shapes(config)
    t = text_config(config)
    hidden, heads, layers = t["hidden_size"], t["num_attention_heads"], t["num_hidden_layers"]
    kv = t.get("num_key_value_heads") or heads
    hd = t.get("head_dim") or hidden // heads
    hybrid = config.get("model_type") in RECURRENT_MODEL_TYPES
    q_rows = heads * hd * (2 if hybrid else 1)  # Qwen3.5's q_proj yields a gate per channel too
    inter = t.get("shared_expert_intermediate_size" if "moe" in config.get("model_type", "") and hybrid
                  else "intermediate_size")
    experts = t.get("num_experts") or t.get("num_local_experts")
    moe_inter = t.get("moe_intermediate_size")
    per_layer: dict[str, Shape | None] = {
        "input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (q_rows, hidden), "self_attn.q_proj.bias": (q_rows,),
        "self_attn.k_proj.weight": (kv * hd, hidden), "self_attn.k_proj.bias": (kv * hd,),
        "self_attn.v_proj.weight": (kv * hd, hidden), "self_attn.v_proj.bias": (kv * hd,),
        "self_attn.o_proj.weight": (hidden, heads * hd), "self_attn.o_proj.bias": (hidden,),
        "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,),
    }
    mlp = "mlp.shared_expert" if hybrid and experts else "mlp"
    if inter:
        per_layer.update({f"{mlp}.gate_proj.weight": (inter, hidden), f"{mlp}.up_proj.weight": (inter, hidden),
                          f"{mlp}.down_proj.weight": (hidden, inter), f"{mlp}.gate_proj.bias": (inter,),
                          f"{mlp}.up_proj.bias": (inter,), f"{mlp}.down_proj.bias": (hidden,)})
    if experts and moe_inter:
        per_layer.update({"mlp.gate.weight": (experts, hidden), "mlp.shared_expert_gate.weight": (1, hidden),
                          "mlp.experts.gate_up_proj": (experts, 2 * moe_inter, hidden),
                          "mlp.experts.down_proj": (experts, hidden, moe_inter)})
    if hybrid:
        per_layer.update(_linear_attention(t, hidden))
    top: dict[str, Shape] = {"model.embed_tokens.weight": (t["vocab_size"], hidden),
                             "lm_head.weight": (t["vocab_size"], hidden), "model.norm.weight": (hidden,)}

    def shape(name: str) -> Shape | None:
        name = name.replace("model.language_model.", "model.", 1)
        if name in top:
            return top[name]
        m = _LAYER.fullmatch(name)
        if m is None or int(m.group(1)) >= layers:
            return None
        rest = m.group(2)
        if experts and moe_inter and (e := _EXPERT.fullmatch(rest)) and int(e.group(1)) < experts:
            return (hidden, moe_inter) if e.group(2) == "down_proj" else (moe_inter, hidden)
        return per_layer.get(rest)

    return shape


_ENCODER_PREFIX = r"(?:bert\.|roberta\.|distilbert\.|mpnet\.|model\.)?"
_ENCODER_LAYER = re.compile(_ENCODER_PREFIX + r"(?:encoder|transformer)\.layer\.(\d+)\.(.+)")
_ENCODER_TOP = re.compile(_ENCODER_PREFIX + r"(embeddings\..+|encoder\.relative_attention_bias\.weight)")


_MODERNBERT = re.compile(r"(?:model\.)?(.+)")
_MODERNBERT_LAYER = re.compile(r"layers\.(\d+)\.(.+)")


def _modernbert_shapes(config: dict) -> Callable[[str], Shape | None]:
    """ModernBERT's tensors (models/modernbert.py), bare or under `model.`."""
    from neuron.models.modernbert import ModernBertConfig

    c = ModernBertConfig.from_dict(config)
    h, inter = c.hidden_size, c.intermediate_size
    top: dict[str, Shape] = {"embeddings.tok_embeddings.weight": (c.vocab_size, h)}
    per_layer: dict[str, Shape] = {"attn.Wqkv.weight": (3 * h, h), "attn.Wqkv.bias": (3 * h,),
                                   "attn.Wo.weight": (h, h), "attn.Wo.bias": (h,),
                                   "mlp.Wi.weight": (2 * inter, h), "mlp.Wi.bias": (2 * inter,),
                                   "mlp.Wo.weight": (h, inter), "mlp.Wo.bias": (h,)}
    for norm in ("embeddings.norm", "final_norm"):
        top.update({f"{norm}.weight": (h,), f"{norm}.bias": (h,)})
    for norm in ("attn_norm", "mlp_norm"):
        per_layer.update({f"{norm}.weight": (h,), f"{norm}.bias": (h,)})

    def shape(name: str) -> Shape | None:
        rest = _MODERNBERT.fullmatch(name).group(1)
        if rest in top:
            return top[rest]
        m = _MODERNBERT_LAYER.fullmatch(rest)
        return per_layer.get(m.group(2)) if m is not None and int(m.group(1)) < c.num_layers else None

    return shape


def _encoder_shapes(config: dict) -> Callable[[str], Shape | None]:
    """A BERT-family encoder's tensors (models/bert.py), under any of its prefixes."""
    from neuron.models.bert import BertConfig

    if config.get("model_type") == "modernbert":
        return _modernbert_shapes(config)

    c = BertConfig.from_dict(config)
    hidden, inter, n = c.hidden_size, c.intermediate_size, c.names
    top = {"embeddings.word_embeddings.weight": (c.vocab_size, hidden),
           "embeddings.position_embeddings.weight": (c.max_position_embeddings, hidden),
           "embeddings.token_type_embeddings.weight": (c.type_vocab_size, hidden),
           "embeddings.LayerNorm.weight": (hidden,), "embeddings.LayerNorm.bias": (hidden,),
           "encoder.relative_attention_bias.weight": (int(config.get("relative_attention_num_buckets", 32)),
                                                      c.num_heads)}
    per_layer: dict[str, Shape] = {f"{n.up}.weight": (inter, hidden), f"{n.up}.bias": (inter,),
                                   f"{n.down}.weight": (hidden, inter), f"{n.down}.bias": (hidden,)}
    for p in (*(f"{n.attn}.{q}" for q in n.qkv), n.o):
        per_layer.update({f"{p}.weight": (hidden, hidden), f"{p}.bias": (hidden,)})
    for p in (n.attn_norm, n.out_norm):
        per_layer.update({f"{p}.weight": (hidden,), f"{p}.bias": (hidden,)})

    def shape(name: str) -> Shape | None:
        if (m := _ENCODER_TOP.fullmatch(name)) is not None:
            return top.get(m.group(1))
        m = _ENCODER_LAYER.fullmatch(name)
        return per_layer.get(m.group(2)) if m is not None and int(m.group(1)) < c.num_layers else None

    return shape


def _linear_attention(t: dict, hidden: int) -> dict[str, Shape]:
    """Qwen3.5's Gated DeltaNet projections (transformers' defaults where the config is silent)."""
    nk, nv = t.get("linear_num_key_heads", 16), t.get("linear_num_value_heads", 32)
    dk, dv = t.get("linear_key_head_dim", 128), t.get("linear_value_head_dim", 128)
    conv = 2 * nk * dk + nv * dv
    p = "linear_attn"
    return {f"{p}.in_proj_qkv.weight": (conv, hidden), f"{p}.in_proj_z.weight": (nv * dv, hidden),
            f"{p}.in_proj_b.weight": (nv, hidden), f"{p}.in_proj_a.weight": (nv, hidden),
            f"{p}.conv1d.weight": (conv, 1, t.get("linear_conv_kernel_dim", 4)), f"{p}.A_log": (nv,),
            f"{p}.dt_bias": (nv,), f"{p}.norm.weight": (dv,), f"{p}.out_proj.weight": (hidden, nv * dv)}


class CheckedReader(Reader):
    """A rank's reader that refuses, by name, a tensor whose shape disagrees with the config, a
    slice past its stored extent, a weight that is not floating point, and NaN or infinity in a
    norm's weight or a quantized weight's scales."""

    def __init__(self, inner: Reader, expected: Callable[[str], Shape | None]):
        self.inner, self.expected = inner, expected

    def has(self, name: str) -> bool:
        return self.inner.has(name)

    def shape(self, name: str) -> list[int] | None:
        return self.inner.shape(name)

    def source(self, name: str) -> str:
        return self.inner.source(name)

    def read(self, name: str, dim: int | None = None, start: int = 0, end: int | None = None) -> torch.Tensor:
        end = self._before(name, dim, start, end)
        return self._after(name, self.inner.read(name, dim, start, end), dim, start, end)

    def head_weight(self, w):
        return self.inner.head_weight(w)

    def read_weight(self, name, dim=None, start=0, end=None, vocab=False):
        end = self._before(name, dim, start, end)
        return self._after(name, self.inner.read_weight(name, dim, start, end, vocab), dim, start, end)

    def _fail(self, name: str, what: str) -> ConfigError:
        return ConfigError(f"{self.inner.source(name)}: tensor {name} {what}")

    def _before(self, name: str, dim: int | None, start: int, end: int | None) -> int | None:
        """Check the stored shape against the config's and the slice against it; the slice's end."""
        stored = self.inner.shape(name)
        if stored is None:
            return end
        want = self.expected(name)
        if want is not None and not _agrees(name, list(stored), want):
            raise self._fail(name, f"has shape {list(stored)}, but the config implies {list(want)}")
        if dim is not None:
            end = stored[dim] if end is None else end
            if not 0 <= start <= end <= stored[dim]:
                raise self._fail(name, f"has shape {list(stored)}: this rank's slice [{start}, {end}) of "
                                       f"dimension {dim} lies outside it")
        return end

    def _after(self, name: str, w, dim: int | None, start: int, end: int | None):
        """Check what was read: its shape (formats whose stored shape is packed tell it only here),
        its dtype, and its norms and scales."""
        want = self.expected(name)
        got = list(w.shape)
        if want is not None:
            wanted = list(want)
            if dim is not None and end is not None:
                wanted[dim] = end - start
            if not _agrees(name, got, tuple(wanted)):
                raise self._fail(name, f"reads as shape {got} where the config implies {wanted}"
                                       + (f" (this rank's rows or columns [{start}, {end}))" if dim is not None else ""))
        if isinstance(w, QuantizedWeight):
            for part in (w.scale, w.scale_sub, w.offset, w.offset_sub):
                if part is not None and part.is_floating_point() and not torch.isfinite(part).all():
                    raise self._fail(name, "has NaN or infinite scales")
            return w
        if not w.is_floating_point() and want is not None:
            raise self._fail(name, f"is stored as {w.dtype}, not a floating-point type")
        if name.lower().endswith(("norm.weight", "layer_norm.weight")) and not torch.isfinite(w).all():  # BERT's too
            raise self._fail(name, "holds NaN or infinite values")
        return w

    def close(self) -> None:
        self.inner.close()


def _agrees(name: str, got: list[int], want: Shape) -> bool:
    """Shapes equal; the vocabulary's rows may be padded past vocab_size."""
    vocab = name.replace("model.language_model.", "model.", 1) in _VOCAB_ROWS or \
        name.endswith(("word_embeddings.weight", "tok_embeddings.weight"))
    if vocab and len(got) == len(want) == 2:
        return got[0] >= want[0] and got[1] == want[1]
    return tuple(got) == tuple(want)
