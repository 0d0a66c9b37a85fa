"""A fresh neuron cache for a test that needs one of its own (its own default checkpoint, kernel
checks, a server's files) without rebuilding the C++ kernels, about 12 s of CPU each time.

The cache the suite started with (`./run install` builds the kernels there) lends its libraries:
the new cache's `kernels/` holds links to them. A library is keyed by its source, the compiler and
the CPU, so a test that changes any of those still builds its own. tests/test_native_build.py,
which tests the build itself, does not use this.
"""

from __future__ import annotations

from pathlib import Path

from neuron.utils.cache_dir import cache_root

BUILT = cache_root() / "kernels"  # read once, at collection, before any test points the cache elsewhere


def fresh_cache(path: Path) -> Path:
    """`path`, made an empty neuron cache but for links to the kernel libraries already built."""
    kernels = path / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    for lib in BUILT.glob("*.so") if BUILT.is_dir() else ():
        link = kernels / lib.name
        if not link.exists():
            link.symlink_to(lib)
    return path
