"""Where neuron keeps what it builds once per machine (the default checkpoint, compiled kernels)."""

from __future__ import annotations

import os
from pathlib import Path

from neuron.config import settings


def cache_root() -> Path:
    """neuron's cache: $NEURON_CACHE_DIR, else $XDG_CACHE_HOME/neuron, else ~/.cache/neuron."""
    if settings().cache_dir:
        return Path(settings().cache_dir).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "neuron"
    return Path.home() / ".cache" / "neuron"
