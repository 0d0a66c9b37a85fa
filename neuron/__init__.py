"""neuron: tensor-parallel LLM inference with an OpenAI-compatible server.

`from neuron import LLM, SamplingParams` is the offline API. Imports are lazy so that the wire
protocol (neuron.rpc) stays usable without torch.
"""

from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "LLM": "neuron.entrypoints.llm",
    "AsyncLLM": "neuron.entrypoints.async_llm",
    "RequestOutputKind": "neuron.engine.sampling_params",
    "RequestOutput": "neuron.entrypoints.llm",
    "CompletionOutput": "neuron.entrypoints.llm",
    "Logprob": "neuron.entrypoints.llm",
    "SamplingParams": "neuron.engine.sampling_params",
    "GuidedDecodingParams": "neuron.engine.sampling_params",
    "PoolingParams": "neuron.engine.pooling",
    "EmbeddingRequestOutput": "neuron.entrypoints.llm",
    "ScoringRequestOutput": "neuron.entrypoints.llm",
    "ClassificationRequestOutput": "neuron.entrypoints.llm",
    "PoolingRequestOutput": "neuron.entrypoints.llm",
    "LoRARequest": "neuron.engine.lora",
    "BeamSearchParams": "neuron.engine.beam_search",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'neuron' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = ["LLM", "AsyncLLM", "RequestOutputKind", "SamplingParams", "GuidedDecodingParams", "PoolingParams", "RequestOutput", "CompletionOutput",
           "Logprob", "EmbeddingRequestOutput", "ScoringRequestOutput",
           "ClassificationRequestOutput", "PoolingRequestOutput",
           "BeamSearchParams",
           "__version__"]
