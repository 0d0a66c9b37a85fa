"""neuron's own C++ kernels: compiled once per machine with the system compiler, loaded through ctypes.

A kernel is one C++ file with `extern "C"` entry points and no torch headers, so it builds in
seconds with whatever `g++`/`c++` the machine has, without ninja or torch's extension machinery.
`-march=native` vectorises it for the CPU it is built on, so the library is cached under
neuron's cache folder by a key over the source, the compiler and the CPU's feature flags: a
different machine sharing the folder (a home directory mounted on several hosts) builds its own.

Several rank processes may start at once: the build runs under a file lock, into a temporary
file renamed into place, so every process loads one complete library. No compiler, or a failed
build, is never fatal: `load` logs one warning naming the reason and returns None, and the
caller keeps its PyTorch reference. No toolchain is ever downloaded.

`python -m neuron.utils.native SOURCE...` builds several at once without importing torch (what
`./run` does after installing, so the first server start finds them built).
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from neuron.config import settings
from neuron.utils.cache_dir import cache_root

log = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c++17")
BUILD_TIMEOUT_S = 300.0
_COMPILERS = ("g++", "c++", "clang++")


class BuildFailed(Exception):
    """Why a kernel library could not be built here, in words for the warning."""


def compiler() -> str | None:
    """The compiler to use: NEURON_CXX as given, else the first of g++, c++, clang++ on PATH."""
    if settings().cxx:
        return settings().cxx
    return next((path for name in _COMPILERS if (path := shutil.which(name))), None)


def library_path(source: Path, cxx: str) -> Path:
    """Where the library built from `source` by `cxx` for this CPU lives in the cache."""
    key = hashlib.sha256()
    key.update(source.read_bytes())
    for header in sorted(source.parent.glob("*.h")):  # what the source may include from its folder
        key.update(header.name.encode() + header.read_bytes())
    key.update(_compiler_identity(cxx).encode())
    key.update(" ".join(FLAGS).encode())
    key.update(_cpu_flags().encode())
    return cache_root() / "kernels" / f"{source.stem}-{key.hexdigest()[:16]}.so"


def _compiler_identity(cxx: str) -> str:
    try:
        done = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BuildFailed(f"compiler {cxx!r} does not run: {exc}") from None
    if done.returncode != 0:
        raise BuildFailed(f"`{cxx} --version` exited {done.returncode}")
    return f"{shutil.which(cxx) or cxx}\n{done.stdout}"


def _cpu_flags() -> str:
    """The CPU's feature flags (what -march=native compiles for); the machine name where /proc lacks them."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return os.uname().machine


def build(source: Path) -> Path:
    """The library built from `source`, compiled now unless the cache holds it; raises BuildFailed."""
    cxx = compiler()
    if cxx is None:
        raise BuildFailed(f"no C++ compiler on PATH (looked for {', '.join(_COMPILERS)}; set NEURON_CXX)")
    target = library_path(source, cxx)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same library
        if not target.is_file():
            _compile(cxx, source, target)
    return target


def _compile(cxx: str, source: Path, target: Path) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{target.stem}.", suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        try:
            done = subprocess.run([cxx, *FLAGS, "-o", tmp, str(source)], capture_output=True, text=True,
                                  timeout=BUILD_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise BuildFailed(f"{cxx} could not compile {source.name}: {exc}") from None
        if done.returncode != 0:
            tail = done.stderr.strip().splitlines()[-3:]
            raise BuildFailed(f"{cxx} failed on {source.name} (exit {done.returncode}): {' | '.join(tail)}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load(source: Path, what: str) -> ctypes.CDLL | None:
    """The library built from `source`, loaded; None, after one warning saying why, when it cannot
    be built or loaded here (`what` names the fallback the caller takes)."""
    try:
        return ctypes.CDLL(str(build(source)))
    except (BuildFailed, OSError) as exc:
        log.warning("%s: %s", what, exc)
        return None


def build_all(sources: list[Path]) -> list[Path | BuildFailed]:
    """Each source's library, or why it failed. The compilers run side by side: each is a process
    of its own, so the threads that wait for them overlap."""

    def attempt(source: Path) -> Path | BuildFailed:
        try:
            return build(source)
        except BuildFailed as exc:
            return exc

    with ThreadPoolExecutor(max(1, len(sources))) as pool:
        return list(pool.map(attempt, sources))


def main(argv: list[str]) -> int:
    """Build each source given; print each library's path, or on stderr why it failed (exit 1)."""
    failed = 0
    for source, built in zip(argv, build_all([Path(a) for a in argv])):
        if isinstance(built, BuildFailed):
            print(f"{source}: {built}", file=sys.stderr)
            failed += 1
        else:
            print(built)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
