"""Typed errors users and callers can act on."""

from __future__ import annotations


class NeuronError(Exception):
    """Base class for errors neuron raises on purpose."""


class ConfigError(NeuronError):
    """A checkpoint, setting or argument that neuron cannot use; the message says what to change."""


class UnsupportedModel(ConfigError):
    """The checkpoint's architecture is not one neuron implements."""


class ModelNotFound(ConfigError):
    """A model path or repo id that resolves to nothing on this machine."""


class WorkerError(NeuronError):
    """A worker rank failed an operation: it replied with an error, exited, or missed a deadline."""

    def __init__(self, rank: int, kind: str, message: str):
        super().__init__(f"rank {rank}: {kind}: {message}")
        self.rank = rank
        self.kind = kind
        self.message = message


class PoolBroken(NeuronError):
    """The worker pool can no longer run steps (a rank died or a collective failed)."""
