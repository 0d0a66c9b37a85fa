"""Architectures neuron runs, keyed by config.json's `model_type`."""

from __future__ import annotations

from neuron.errors import UnsupportedModel

SUPPORTED_MODEL_TYPES = ("qwen3",)


def check_supported(config: dict) -> str:
    """Fail early, before any worker starts, for a checkpoint neuron cannot run."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModel(
            f"model_type {model_type!r} is not supported; supported types: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return model_type


def build_model(config: dict, comm, dtype, device):
    """This rank's (unloaded) share of the model named by `config`."""
    model_type = check_supported(config)
    if model_type == "qwen3":
        from neuron.models.qwen3 import Qwen3Config, Qwen3ForCausalLM

        return Qwen3ForCausalLM(Qwen3Config.from_dict(config), comm, dtype, device)
    raise AssertionError(model_type)
