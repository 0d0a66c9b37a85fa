"""Model loading progress: a bar on a terminal, a log line per quarter otherwise."""

from __future__ import annotations

import logging
import sys

log = logging.getLogger("neuron.executor")


class LoadProgress:
    """A progress bar on a terminal, a log line per quarter otherwise."""

    def __init__(self, desc: str, total: int):
        self.desc, self.total, self.bar, self._logged = desc, total, None, -1

    def __enter__(self) -> "LoadProgress":
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, desc=self.desc, unit="layer", file=sys.stderr)
        return self

    def update(self, done: int, total: int) -> None:
        if self.bar is not None:
            self.bar.update(done - self.bar.n)
            return
        quarter = done * 4 // max(total, 1)
        if quarter > self._logged:
            self._logged = quarter
            log.info("%s: %d/%d layers", self.desc, done, total)

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()
