"""Architectures neuron runs, keyed by config.json's `model_type`."""

from __future__ import annotations

from neuron.errors import UnsupportedModel

DENSE_MODEL_TYPES = ("qwen3", "llama", "mistral", "qwen2")  # one decoder (qwen3.py), switches per family
SUPPORTED_MODEL_TYPES = (*DENSE_MODEL_TYPES, "qwen3_moe", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
# Multimodal layouts: the language model's settings nested in `text_config`, a vision tower beside it.
MULTIMODAL_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")
# Hybrid models whose linear-attention layers keep recurrent state per slot.
RECURRENT_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")


def check_supported(config: dict) -> str:
    """Fail early, before any worker starts, for a checkpoint neuron cannot run."""
    from neuron.models.quant_formats import checkpoint_quantization

    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModel(
            f"model_type {model_type!r} is not supported; supported types: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    checkpoint_quantization(config)  # a quantized checkpoint neuron cannot read is refused here, by name
    return model_type


def load_config(model_dir, overrides: dict | None = None) -> dict:
    """A checkpoint's config.json with `overrides` merged in (nested objects key by key), refused at
    once when neuron cannot run its architecture."""
    from pathlib import Path

    from neuron.models.gguf import find_gguf, open_file
    from neuron.models.loader import read_json

    gguf = find_gguf(Path(model_dir))
    base = open_file(gguf).config() if gguf is not None else read_json(Path(model_dir) / "config.json")
    config = merged(base, overrides or {})
    check_supported(config)
    return config


def merged(base: dict, overrides: dict) -> dict:
    """`base` with `overrides` laid over it: an object over an object merges key by key, anything
    else replaces (a null removes nothing: it sets the key to null, as in config.json)."""
    out = dict(base)
    for key, value in overrides.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def supports_prefix_caching(config: dict) -> bool:
    """Whether a cached prefix's KV blocks restore a sequence's whole state. Not for models with
    recurrent (linear-attention) layers, whose per-slot state the blocks do not hold."""
    return config.get("model_type") not in RECURRENT_MODEL_TYPES


def text_config(config: dict) -> dict:
    """The language model's settings (vocabulary, context length): nested in multimodal configs."""
    nested = config.get("text_config")
    return nested if isinstance(nested, dict) else config


def context_length(config: dict) -> int:
    """The longest context the model runs: max_position_embeddings, stretched by its rope scaling."""
    from neuron.layers.rope import RopeScaling

    t = text_config(config)
    return RopeScaling.from_config(t).max_len(int(t.get("max_position_embeddings", 2048)))


def build_model(config: dict, comm, dtype, device, model_dir=None):
    """This rank's (unloaded) share of the model named by `config` (read from `model_dir`)."""
    model_type = check_supported(config)
    if model_type in DENSE_MODEL_TYPES:
        from neuron.models.qwen3 import Qwen3Config, Qwen3ForCausalLM

        return Qwen3ForCausalLM(Qwen3Config.from_dict(config), comm, dtype, device)
    if model_type == "qwen3_moe":
        from neuron.models.qwen3_moe import Qwen3MoeConfig, Qwen3MoeForCausalLM

        return Qwen3MoeForCausalLM(Qwen3MoeConfig.from_dict(config), comm, dtype, device)
    vision = None
    if model_type in MULTIMODAL_MODEL_TYPES:
        from neuron.multimodal.image import VisionSpec

        vision = VisionSpec.from_checkpoint(config, model_dir)
    if model_type in ("qwen3_5", "qwen3_5_text"):
        from neuron.models.qwen3_5 import Qwen35Config, Qwen35ForCausalLM

        return Qwen35ForCausalLM(Qwen35Config.from_dict(config), comm, dtype, device, vision,
                                 config.get("vision_config"))
    if model_type in ("qwen3_5_moe", "qwen3_5_moe_text"):
        from neuron.models.qwen3_5_moe import Qwen35MoeConfig, Qwen35MoeForCausalLM

        return Qwen35MoeForCausalLM(Qwen35MoeConfig.from_dict(config), comm, dtype, device, vision,
                                    config.get("vision_config"))
    raise AssertionError(model_type)
