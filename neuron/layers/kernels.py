"""Which implementation each fused piece of a model runs: an object built once, at load, from the
settings and the start-up self-check's verdict (`kernel_check`), and handed to the model, whose
layers hold it and ask it before each launch. Each model has its own, so two models in one process
(rank 0 and a speculative draft share the leader's) can run different choices, and tests build
one directly instead of switching process-wide state.

What is process state stays so: whether the CPU libraries could be built here
(`cpu_ops.library()`, `cpu_attention.library()`) is a fact of the machine, not a choice."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from neuron.config import settings

log = logging.getLogger("neuron.kernels")

PIECES = ("rms_norm", "add_rms_norm", "norm_rope", "silu_mul", "paged_attention", "quant_linear", "lora")


@dataclass(frozen=True, slots=True)
class Kernels:
    """`failed`: the fused CUDA pieces that run their PyTorch reference, with why (the union of
    every rank's self-check); `forced`: NEURON_KERNELS (`auto` follows the verdict, `triton` or
    `reference` overrides it); `cpu_ops`, `quant_kernels`, `onednn`: the CPU kernels that are not
    switched off (NEURON_NO_CPU_OPS, NEURON_NO_QUANT_KERNELS, NEURON_NO_ONEDNN); `paged`: attention
    reads KV blocks in place (NEURON_ATTENTION=paged) rather than gathering them (the reference);
    `quant_exact`: the CPU quantized kernel multiplies in fp32 rather than rounding the activations
    to int8 (NEURON_QUANT_EXACT); `fused_layers`: a CPU fp32 step's dense decoder layers run in one
    C++ call (cpu_decoder.py), where `cpu_ops` and `paged` hold too (NEURON_NO_FUSED_LAYERS)."""

    failed: Mapping[str, str] = field(default_factory=dict)
    forced: str = "auto"
    cpu_ops: bool = True
    quant_kernels: bool = True
    onednn: bool = True
    paged: bool = True
    quant_exact: bool = False
    fused_layers: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "failed", MappingProxyType(dict(self.failed)))

    @classmethod
    def from_settings(cls, failed: Mapping[str, str] | None = None) -> Kernels:
        """The choice the NEURON_* settings make, over the self-check's `failed` pieces."""
        s = settings()
        return cls(failed or {}, s.kernels, not s.no_cpu_ops, not s.no_quant_kernels, not s.no_onednn,
                   s.attention == "paged", s.quant_exact, not s.no_fused_layers)

    def triton(self, piece: str) -> bool:
        """Whether `piece` runs its Triton kernel (on CUDA tensors, Triton installed: the callers check those)."""
        if self.forced != "auto":
            return self.forced == "triton"
        return piece not in self.failed

    def verdict(self) -> dict[str, str]:
        """Each fused piece and what runs it: `triton`, or `reference: <why>`."""
        if self.forced != "auto":
            return {piece: self.forced if self.forced == "triton" else "reference: NEURON_KERNELS=reference"
                    for piece in PIECES}
        return {piece: f"reference: {self.failed[piece]}" if piece in self.failed else "triton" for piece in PIECES}

    def log_failures(self) -> None:
        for piece, why in sorted(self.failed.items()):
            log.warning("%s runs its PyTorch reference: its kernel failed the self-check (%s)", piece, why)
