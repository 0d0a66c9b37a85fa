"""Which pieces run their fused CUDA kernel and which their PyTorch reference, in this process:
the verdict of the start-up self-check (`kernel_check`), or NEURON_KERNELS. The layers ask
`use_triton(piece)` before launching a kernel."""

from __future__ import annotations

import logging

from neuron.config import settings

log = logging.getLogger("neuron.kernels")

PIECES = ("rms_norm", "add_rms_norm", "norm_rope", "silu_mul", "paged_attention", "quant_linear")

_failed: dict[str, str] = {}  # this process's pieces on their reference, with why
_mode: list[str] = []  # NEURON_KERNELS, read once (the layers ask for every kernel launch)


def _current_mode() -> str:
    if not _mode:
        _mode.append(settings().kernels)
    return _mode[0]


def use_triton(piece: str) -> bool:
    """Whether `piece` runs its Triton kernel (on CUDA tensors, Triton installed; the callers check those)."""
    mode = _current_mode()
    if mode != "auto":
        return mode == "triton"
    return piece not in _failed


def apply(failures: dict[str, str]) -> None:
    """Put the failed pieces on their references (and every other back on its kernel); NEURON_KERNELS
    is read again."""
    _mode.clear()
    _failed.clear()
    _failed.update(failures)
    for piece, why in sorted(failures.items()):
        log.warning("%s runs its PyTorch reference: its kernel failed the self-check (%s)", piece, why)


def verdict() -> dict[str, str]:
    """Each piece and what runs it: `triton`, or `reference: <why>`."""
    mode = _current_mode()
    if mode != "auto":
        return {piece: mode if mode == "triton" else "reference: NEURON_KERNELS=reference" for piece in PIECES}
    return {piece: f"reference: {_failed[piece]}" if piece in _failed else "triton" for piece in PIECES}
