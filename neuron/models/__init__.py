"""Architectures neuron runs, keyed by config.json's `model_type`."""

from __future__ import annotations

from neuron.errors import UnsupportedModel

DENSE_MODEL_TYPES = ("qwen3", "llama", "mistral", "qwen2")  # one decoder (qwen3.py), switches per family
# Encoders (bert.py): embedding and classification models, which attend both ways and generate nothing.
ENCODER_MODEL_TYPES = ("bert", "roberta", "xlm-roberta", "distilbert", "mpnet", "modernbert")
SUPPORTED_MODEL_TYPES = (*DENSE_MODEL_TYPES, "qwen3_moe", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text",
                         *ENCODER_MODEL_TYPES)
# Multimodal layouts: the language model's settings nested in `text_config`, a vision tower beside it.
MULTIMODAL_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")
# Hybrid models whose linear-attention layers keep recurrent state per slot.
RECURRENT_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")


def check_supported(config: dict) -> str:
    """Fail early, before any worker starts, for a checkpoint neuron cannot run."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModel(
            f"model_type {model_type!r} is not supported; supported types: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return model_type


def standard_config(config: dict) -> dict:
    """`config` with the standard field names where its family names them otherwise (DistilBERT's
    `dim` is `hidden_size`, ...), so that every check and every size reads one set."""
    if config.get("model_type") not in ENCODER_MODEL_TYPES:
        return config
    from neuron.models.bert import standard_config as encoder

    return encoder(config)


def merged(base: dict, overrides: dict) -> dict:
    """`base` with `overrides` laid over it: an object over an object merges key by key, anything
    else replaces (a null removes nothing: it sets the key to null, as in config.json)."""
    out = dict(base)
    for key, value in overrides.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def supports_prefix_caching(config: dict) -> bool:
    """Whether a cached prefix's KV blocks restore a sequence's whole state. Not for models with
    recurrent (linear-attention) layers, whose per-slot state the blocks do not hold, nor for
    encoders, which keep nothing."""
    return config.get("model_type") not in (*RECURRENT_MODEL_TYPES, *ENCODER_MODEL_TYPES)


def is_encoder(config: dict) -> bool:
    """Whether the model is an encoder (bert.py): each input runs whole in one step, nothing is generated."""
    return config.get("model_type") in ENCODER_MODEL_TYPES


def text_config(config: dict) -> dict:
    """The language model's settings (vocabulary, context length): nested in multimodal configs."""
    nested = config.get("text_config")
    return nested if isinstance(nested, dict) else config


def context_length(config: dict) -> int:
    """The longest context the model runs: max_position_embeddings, stretched by its rope scaling."""
    from neuron.layers.rope import RopeScaling

    t = text_config(config)
    if is_encoder(t):
        from neuron.models.bert import position_offset

        return int(t.get("max_position_embeddings", 512)) - position_offset(t)
    return RopeScaling.from_config(t).max_len(int(t.get("max_position_embeddings", 2048)))


def _architecture(config: dict) -> tuple[type, type]:
    """The model class of `config`'s architecture and the class parsing its config."""
    model_type = check_supported(config)
    if model_type == "modernbert":
        from neuron.models.modernbert import ModernBertConfig, ModernBertModel

        return ModernBertModel, ModernBertConfig
    if model_type in ENCODER_MODEL_TYPES:
        from neuron.models.bert import BertConfig, BertModel

        return BertModel, BertConfig
    if model_type in DENSE_MODEL_TYPES:
        from neuron.models.qwen3 import Qwen3Config, Qwen3ForCausalLM

        return Qwen3ForCausalLM, Qwen3Config
    if model_type == "qwen3_moe":
        from neuron.models.qwen3_moe import Qwen3MoeConfig, Qwen3MoeForCausalLM

        return Qwen3MoeForCausalLM, Qwen3MoeConfig
    if model_type in ("qwen3_5", "qwen3_5_text"):
        from neuron.models.qwen3_5 import Qwen35Config, Qwen35ForCausalLM

        return Qwen35ForCausalLM, Qwen35Config
    from neuron.models.qwen3_5_moe import Qwen35MoeConfig, Qwen35MoeForCausalLM

    return Qwen35MoeForCausalLM, Qwen35MoeConfig


def parse_config(config: dict):
    """The typed config of `config`'s architecture (what its parser refuses, refused)."""
    return _architecture(config)[1].from_dict(config)


def valid_tp_sizes(config: dict, up_to: int = 64) -> list[int]:
    """The tensor-parallel sizes up to `up_to` that the model's heads and widths split into."""
    from neuron.errors import ConfigError
    from neuron.layers.tensor_parallel import Shard

    model, parser = _architecture(config)
    typed = parser.from_dict(config)
    sizes = []
    for tp in range(1, up_to + 1):
        try:
            model.check_split(typed, Shard(0, tp))
        except ConfigError:
            continue
        sizes.append(tp)
    return sizes


def check_tp(config: dict, tp: int) -> None:
    """Refuse, before any worker starts, a tensor-parallel size the model does not split into,
    listing the sizes it does."""
    from neuron.errors import ConfigError
    from neuron.layers.tensor_parallel import Shard

    model, parser = _architecture(config)
    try:
        model.check_split(parser.from_dict(config), Shard(0, tp))
    except ConfigError as exc:
        sizes = ", ".join(map(str, valid_tp_sizes(config)))
        raise ConfigError(f"tensor-parallel size {tp} does not fit this model: {exc}; sizes that do: {sizes}") from None


def build_model(config: dict, comm, dtype, device, kernels, vision=None):
    """This rank's (unloaded) share of the model named by `config`, whose layers run the kernels
    `kernels` (a `neuron.layers.kernels.Kernels`) chooses; `vision`: how it takes images
    (multimodal.image.VisionSpec), None for text only."""
    model, parser = _architecture(config)
    typed = parser.from_dict(config)
    if config.get("model_type") not in MULTIMODAL_MODEL_TYPES:
        return model(typed, comm, dtype, device, kernels)
    return model(typed, comm, dtype, device, kernels, vision, config.get("vision_config"))
