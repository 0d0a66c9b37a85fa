"""The versions, devices and commit a report names."""

from __future__ import annotations

import os
import platform
import subprocess
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def device_environment(device: str, dtype: str) -> dict:
    import torch

    env = {"device": device, "dtype": dtype, "torch": torch.__version__, "cuda": torch.version.cuda or "none",
           "transformers": _package_version("transformers"), "gpu": "none", "driver": "none"}
    if device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name(torch.device(device))
        env["driver"] = _nvidia_smi("driver_version")
    env["cupy"], env["nccl"] = _cupy_versions()
    return env


def _package_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def _nvidia_smi(query: str) -> str:
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown (nvidia-smi not found or hung)"


def _cupy_versions() -> tuple[str, str]:
    try:
        import cupy
    except Exception as exc:  # absent, or built for another CUDA: say which
        return f"not usable ({type(exc).__name__})", "n/a"
    try:
        from cupy.cuda import nccl

        return cupy.__version__, str(nccl.get_version())
    except Exception as exc:
        return cupy.__version__, f"not usable ({type(exc).__name__})"


def host_environment() -> dict:
    return {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "host": platform.node(),
            "python": platform.python_version(), "cpus": os.cpu_count(), "neuron commit": neuron_commit()}


def neuron_commit() -> str:
    def git(*argv: str) -> str:
        # --no-optional-locks: reading the status must not take the index lock from anyone else's git.
        out = subprocess.run(["git", "--no-optional-locks", "-C", str(ROOT), *argv], capture_output=True, text=True,
                             timeout=30)
        return out.stdout.strip() if out.returncode == 0 else ""

    try:
        head = git("rev-parse", "--short=12", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.TimeoutExpired):
        return "unknown (git not available)"
    return (head or "unknown (not a git checkout)") + (" with uncommitted changes" if dirty else "")
