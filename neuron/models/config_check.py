"""Every config field the models read, checked once on the leader before any worker starts.

A checkpoint's config.json (or a GGUF file's metadata, or --hf-overrides) is untrusted input: a
zero head count divides by zero in a kernel, a NaN epsilon turns every logit into NaN, a layer
count of 2^32 builds lists of billions of entries. So each field is checked for its type and range
here, with one message shape (`where: field must be ..., got value`), before anything is sized
from it; the limits are generous bounds on real models, not tuning.
"""

from __future__ import annotations

import math
from typing import Any

from neuron.errors import ConfigError

MAX_LAYERS = 1024
MAX_HIDDEN = 1 << 16
MAX_WIDTH = 1 << 20  # MLP and expert widths
MAX_HEADS = 1024
MAX_HEAD_DIM = 1024
MAX_VOCAB = 1 << 19  # the largest real vocabularies hold about 262k tokens
MAX_POSITIONS = 1 << 24
MAX_EXPERTS = 4096
MAX_TP = 1024


class Fields:
    """Typed, bounded access to one config object; every refusal names `where` and the field."""

    def __init__(self, d: Any, where: str):
        if not isinstance(d, dict):
            raise ConfigError(f"{where} must be a JSON object, got {type(d).__name__}")
        self.d, self.where = d, where

    def fail(self, key: str, wanted: str, value: Any) -> ConfigError:
        exc = ConfigError(f"{self.where}: {key} must be {wanted}, got {_shown(value)}")
        exc.field = key  # where the config came from may name it otherwise (a GGUF metadata key)
        return exc

    def int(self, key: str, lo: int, hi: int, default: Any = None, required: bool = False) -> int | None:
        value = self.d.get(key)
        if value is None:
            if required:
                raise ConfigError(f"{self.where}: {key} is required (an integer in {lo}..{hi})")
            return default
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise self.fail(key, f"an integer in {lo}..{hi}", value)
        return value

    def float(self, key: str, lo: float, hi: float, default: Any = None, above: bool = False) -> float | None:
        """A finite number in [lo, hi] ((lo, hi] with `above`)."""
        value = self.d.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or not (value > lo if above else value >= lo) or value > hi:
            raise self.fail(key, f"a finite number in {'(' if above else '['}{lo:g}, {hi:g}]", value)
        return float(value)

    def bool(self, key: str) -> None:
        value = self.d.get(key)
        if value is not None and not isinstance(value, bool):
            raise self.fail(key, "true or false", value)

    def int_list(self, key: str, lo: int, hi: int, max_len: int) -> list[int] | None:
        value = self.d.get(key)
        if value is None:
            return None
        if not isinstance(value, list) or len(value) > max_len or \
                any(isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi for v in value):
            raise self.fail(key, f"a list of at most {max_len} integers in {lo}..{hi}", value)
        return value

    def token_ids(self, key: str, vocab: int) -> None:
        """An id or a list of ids, each in the vocabulary (generation and chat settings)."""
        value = self.d.get(key)
        ids = value if isinstance(value, list) else [value]
        if value is not None and (len(ids) > 1024 or any(isinstance(v, bool) or not isinstance(v, int)
                                                         or not 0 <= v < vocab for v in ids)):
            raise self.fail(key, f"a token id (or a list of them) in 0..{vocab - 1}", value)

    def nested(self, key: str) -> "Fields | None":
        value = self.d.get(key)
        return None if value is None else Fields(value, f"{self.where}: {key}")


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_config(config: Any, where: str) -> None:
    """Refuse a config whose fields the models cannot run (ConfigError naming the field, its value
    and what it takes). `where`: the file it came from, for the message."""
    from neuron.models import ENCODER_MODEL_TYPES, MULTIMODAL_MODEL_TYPES, RECURRENT_MODEL_TYPES

    top = Fields(config, where)
    model_type = config.get("model_type")
    text = top
    if model_type in MULTIMODAL_MODEL_TYPES:
        text = top.nested("text_config")
        if text is None:
            raise ConfigError(f"{where}: a {model_type} config needs its text_config")
        if (vision := top.nested("vision_config")) is not None:
            _check_vision(vision)
    vocab = _check_text(text, rotary=model_type not in ENCODER_MODEL_TYPES or model_type == "modernbert")
    if model_type in ENCODER_MODEL_TYPES:
        _check_encoder(text, vocab)
    if model_type in RECURRENT_MODEL_TYPES:
        _check_hybrid(text)
    if model_type in ("qwen3_moe", "qwen3_5_moe", "qwen3_5_moe_text"):
        _check_experts(text)
    for f in (top, text):
        f.bool("tie_word_embeddings")
        f.token_ids("eos_token_id", vocab)  # stop ids index the logits
        for key in ("bos_token_id", "image_token_id"):  # checked against the vocabulary where they are used
            f.token_ids(key, 1 << 31)


def _check_text(t: Fields, rotary: bool = True) -> int:
    vocab = t.int("vocab_size", 1, MAX_VOCAB, required=True)
    hidden = t.int("hidden_size", 1, MAX_HIDDEN, required=True)
    t.int("num_hidden_layers", 1, MAX_LAYERS, required=True)
    heads = t.int("num_attention_heads", 1, MAX_HEADS, required=True)
    kv = t.int("num_key_value_heads", 1, heads, default=heads)
    if heads % kv:
        raise t.fail("num_key_value_heads", f"a divisor of num_attention_heads ({heads})", kv)
    head_dim = t.int("head_dim", 2, MAX_HEAD_DIM)
    if head_dim is None and hidden // heads < 2:
        raise t.fail("hidden_size", f"at least 2 x num_attention_heads ({heads}) when head_dim is not given", hidden)
    if rotary and (head_dim or hidden // heads) % 2:
        raise t.fail("head_dim", "even (the rotary embedding turns pairs of channels)", head_dim or hidden // heads)
    for key in ("intermediate_size", "shared_expert_intermediate_size", "moe_intermediate_size"):
        t.int(key, 1, MAX_WIDTH)
    t.float("rms_norm_eps", 0.0, 1.0, above=True)
    t.int("max_position_embeddings", 1, MAX_POSITIONS)
    t.int("original_max_position_embeddings", 1, MAX_POSITIONS)
    t.int("sliding_window", 1, MAX_POSITIONS)
    t.float("rope_theta", 0.0, 1e12, above=True)
    t.float("partial_rotary_factor", 0.0, 1.0, above=True)
    for key in ("attention_bias", "mlp_bias", "use_sliding_window", "norm_topk_prob"):
        t.bool(key)
    _check_rope(t)
    return vocab


def _check_rope(t: Fields) -> None:
    """The rope parameters, from `rope_parameters` and `rope_scaling` alike (layers.rope reads both)."""
    from neuron.layers.rope import rope_parameters

    for key in ("rope_parameters", "rope_scaling"):
        if t.d.get(key) is not None and not isinstance(t.d[key], dict):
            raise t.fail(key, "an object", t.d[key])
    p = Fields(rope_parameters(t.d), f"{t.where}: rope parameters")
    for key in ("rope_type", "type"):
        if p.d.get(key) is not None and not isinstance(p.d[key], str):
            raise p.fail(key, "a name such as 'yarn'", p.d[key])
    p.float("rope_theta", 0.0, 1e12, above=True)
    p.float("factor", 0.0, 1e6, above=True)
    p.int("original_max_position_embeddings", 1, MAX_POSITIONS)
    for key in ("low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "attention_factor", "mscale",
                "mscale_all_dim"):
        p.float(key, 0.0, 1e6, above=True)
    p.float("partial_rotary_factor", 0.0, 1.0, above=True)
    low, high = p.d.get("low_freq_factor", 1.0), p.d.get("high_freq_factor", 4.0)
    if p.d.get("rope_type", p.d.get("type")) == "llama3" and not high > low:
        raise p.fail("high_freq_factor", f"greater than low_freq_factor ({low})", high)
    p.int_list("mrope_section", 0, MAX_HEAD_DIM, 8)
    p.bool("truncate")


# fields the encoders read with a default where config.json leaves them out; a null one would build
# transformers' model with None
_ENCODER_DEFAULTED = ("layer_norm_eps", "max_position_embeddings", "type_vocab_size", "hidden_act", "hidden_activation",
                      "position_embedding_type", "norm_eps", "local_attention", "global_attn_every_n_layers",
                      "global_rope_theta", "local_rope_theta", "classifier_pooling", "classifier_activation")


def _check_encoder(t: Fields, vocab: int) -> None:
    """The encoders' own fields: BERT's, RoBERTa's (models/bert.py) and ModernBERT's (modernbert.py)."""
    for key in _ENCODER_DEFAULTED:
        if key in t.d and t.d[key] is None:
            raise t.fail(key, "a value, or left out (null is neither)", None)
    t.float("layer_norm_eps", 0.0, 1.0, above=True)
    t.int("intermediate_size", 1, MAX_WIDTH, required=True)  # the MLP's width: an encoder has no default
    t.int("type_vocab_size", 1, 1024)
    t.int("pad_token_id", 0, vocab - 1)  # RoBERTa counts positions past its padding id
    pad = t.d.get("pad_token_id") if t.d.get("model_type") in ("roberta", "xlm-roberta") else None
    if pad is not None and t.d.get("max_position_embeddings", 512) < pad + 3:
        raise t.fail("max_position_embeddings", f"at least pad_token_id + 3 ({pad + 3}): RoBERTa's positions start "
                     "past its padding id", t.d.get("max_position_embeddings"))
    for key in ("hidden_act", "hidden_activation", "position_embedding_type", "classifier_activation"):
        if t.d.get(key) is not None and not isinstance(t.d[key], str):
            raise t.fail(key, "a name", t.d[key])
    t.int("relative_attention_num_buckets", 32, 1024)  # MPNet's bias table: its buckets reach 31
    t.float("norm_eps", 0.0, 1.0, above=True)  # ModernBERT's
    t.int("local_attention", 2, MAX_POSITIONS)
    t.int("global_attn_every_n_layers", 1, t.d["num_hidden_layers"])
    for key in ("norm_bias", "classifier_bias"):
        t.bool(key)


def _check_hybrid(t: Fields) -> None:
    """Qwen3.5's Gated DeltaNet layers."""
    layers = t.d["num_hidden_layers"]
    t.int("full_attention_interval", 1, layers)
    for key in ("linear_num_key_heads", "linear_num_value_heads"):
        t.int(key, 1, MAX_HEADS)
    for key in ("linear_key_head_dim", "linear_value_head_dim"):
        t.int(key, 1, MAX_HEAD_DIM)
    t.int("linear_conv_kernel_dim", 1, 64)
    types = t.d.get("layer_types")
    if types is not None and (not isinstance(types, list) or len(types) != layers
                              or any(v not in ("linear_attention", "full_attention") for v in types)):
        raise t.fail("layer_types", f"a list of {layers} of 'linear_attention' or 'full_attention'", types)


def is_sparse_layer(layer: int, mlp_only_layers, decoder_sparse_step: int) -> bool:
    """transformers' rule for Qwen's MoE models: a block of experts on every
    `decoder_sparse_step`-th layer, unless the layer is listed dense."""
    return layer not in mlp_only_layers and (layer + 1) % decoder_sparse_step == 0


def sparse_layers(config: dict) -> frozenset[int]:
    """The layers of a text config whose MLP is a block of experts (none for a dense model)."""
    if not (config.get("num_experts") or config.get("num_local_experts")):
        return frozenset()
    dense, step = {int(i) for i in config.get("mlp_only_layers") or ()}, int(config.get("decoder_sparse_step", 1))
    return frozenset(i for i in range(int(config["num_hidden_layers"])) if is_sparse_layer(i, dense, step))


def _check_experts(t: Fields) -> None:
    experts = t.int("num_experts", 1, MAX_EXPERTS) or t.int("num_local_experts", 1, MAX_EXPERTS, required=True)
    t.int("num_experts_per_tok", 1, experts, required=True)
    t.int("moe_intermediate_size", 1, MAX_WIDTH, required=True)
    layers = t.d["num_hidden_layers"]
    t.int("decoder_sparse_step", 1, layers)
    t.int_list("mlp_only_layers", 0, layers - 1, layers)


def _check_vision(v: Fields) -> None:
    hidden = v.int("hidden_size", 1, MAX_HIDDEN)
    heads = v.int("num_heads", 1, MAX_HEADS)
    if hidden is not None and heads is not None and hidden % heads:
        raise v.fail("hidden_size", f"a multiple of num_heads ({heads})", hidden)
    v.int("depth", 1, MAX_LAYERS)
    v.int("intermediate_size", 1, MAX_WIDTH)
    v.int("out_hidden_size", 1, MAX_HIDDEN)
    v.int("patch_size", 1, 1024)
    v.int("temporal_patch_size", 1, 64)
    v.int("spatial_merge_size", 1, 64)
    v.int("num_position_embeddings", 1, 1 << 20)
    v.int("in_channels", 1, 16)
