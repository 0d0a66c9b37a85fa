"""One line per event on stderr; workers prefix theirs with the rank."""

from __future__ import annotations

import logging
import sys

from neuron.config import settings


def setup_logging(prefix: str = "", level: str | None = None) -> None:
    level = level or settings().log_level
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"{prefix}%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger("neuron")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
