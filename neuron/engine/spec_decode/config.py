"""Speculative decoding's settings (`--speculative-config`, `LLM(speculative_config=...)`), with
vLLM's key names, and the shape of the verifying steps they imply."""

from __future__ import annotations

from dataclasses import dataclass

from neuron.config import parse_bytes
from neuron.engine.engine_config import json_object
from neuron.errors import ConfigError
from neuron.step import VerifyShape

METHODS = ("ngram", "suffix", "draft")
_ALIASES = {"draft_model": "draft", "[ngram]": "ngram"}
# The keys every method reads, and each method's own (--speculative-config's help lists them all).
COMMON_KEYS = ("method", "num_speculative_tokens", "disable_by_batch_size")
METHOD_KEYS = {
    "ngram": ("prompt_lookup_min", "prompt_lookup_max"),
    "suffix": ("suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
               "suffix_decoding_max_cache_bytes", "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob"),
    "draft": ("model", "draft_tensor_parallel_size"),
}


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 3  # with the last token, 4 rows: the CPU's streaming kernel (cpu_ops)
    disable_by_batch_size: int = 8
    # ngram
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    # suffix (vLLM's names)
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # the shared index of outputs, in bytes (a number, or with a unit: "64MiB"): about 80 outputs of
    # 2,000 tokens that repeat nothing (0.75 MB each at depth 24), many more where they repeat each other
    suffix_decoding_max_cache_bytes: int = 64 * 2**20
    # draft
    model: str | None = None
    draft_tensor_parallel_size: int = 1

    @classmethod
    def parse(cls, value: dict | str | None) -> "SpeculativeConfig | None":
        """From `--speculative-config` (JSON text) or `LLM(speculative_config=...)` (a dict); None: off."""
        if value is None or value == "":
            return None
        value = json_object(value, "speculative_config")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"speculative_config: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        fields = dict(value)
        method = fields["method"] = _ALIASES.get(fields.get("method", "ngram"), fields.get("method", "ngram"))
        if method not in METHODS:
            raise ConfigError(f"speculative_config: method {method!r} is not available "
                              f"(available: {', '.join(METHODS)})")
        if "model" in fields and method != "draft":
            raise ConfigError(f"speculative_config: model names a draft checkpoint, for method draft, not {method!r}")
        try:
            cfg = cls(**{k: _typed(k, v) for k, v in fields.items()})
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"speculative_config: {exc}") from None
        cfg._check()
        return cfg

    def summary(self) -> dict:
        """The keys this method reads, with their values: what /health and the start-up log show."""
        return {key: getattr(self, key) for key in COMMON_KEYS + METHOD_KEYS[self.method]}

    @property
    def verify_shape(self) -> VerifyShape:
        """Its verifying steps: the last token and the proposals after it, for at most
        `disable_by_batch_size` sequences at once."""
        return VerifyShape(tokens=1 + self.num_speculative_tokens, batch=self.disable_by_batch_size)

    def _check(self) -> None:
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ConfigError("speculative_config: num_speculative_tokens must be in 1..16")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError("speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.disable_by_batch_size < 1:
            raise ConfigError("speculative_config: disable_by_batch_size must be at least 1")
        if not 2 <= self.suffix_decoding_max_tree_depth <= 256:
            raise ConfigError("speculative_config: suffix_decoding_max_tree_depth must be in 2..256")
        if self.suffix_decoding_max_cached_requests < 0:
            raise ConfigError("speculative_config: suffix_decoding_max_cached_requests must be at least 0")
        if self.suffix_decoding_max_spec_factor <= 0:
            raise ConfigError("speculative_config: suffix_decoding_max_spec_factor must be positive")
        if not 0.0 <= self.suffix_decoding_min_token_prob <= 1.0:
            raise ConfigError("speculative_config: suffix_decoding_min_token_prob must be in [0, 1]")
        if self.suffix_decoding_max_cache_bytes < 1:
            raise ConfigError("speculative_config: suffix_decoding_max_cache_bytes must be at least 1 "
                              "(suffix_decoding_max_cached_requests 0 turns the shared index off)")
        if self.method == "draft" and not self.model:
            raise ConfigError("speculative_config: method draft needs model, the draft checkpoint "
                              "(a smaller model with the target's vocabulary)")
        if self.draft_tensor_parallel_size != 1:
            raise ConfigError("speculative_config: draft_tensor_parallel_size must be 1: the draft runs "
                              "whole on rank 0's device")


def _typed(key: str, value):
    if key in ("method", "model"):
        if not isinstance(value, str):
            raise ValueError(f"{key} must be a string, got {value!r:.80}")
        return value
    if key == "suffix_decoding_max_cache_bytes" and isinstance(value, str):
        try:
            return parse_bytes(value, key)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
    kind = float if key in ("suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob") else int
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
        raise ValueError(f"{key} must be {'a number' if kind is float else 'an integer'}, got {value!r:.80}")
    return kind(value)
