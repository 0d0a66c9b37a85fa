"""Which fused CUDA kernels run: each is trusted only once it matched its PyTorch reference on the
card it runs on.

The Triton kernels (the fused norms, rotary and SiLU in `norm.py`, paged attention, quantized
linears, LoRA adapters' grouped product) were written and tested without a GPU. A kernel that
fails to compile, or computes wrong, on a user's card would fail or corrupt every forward, so at
start-up each one runs at the model's own widths and dtype against its reference (`check`). A
piece that raises, differs or returns NaN is switched to its reference alone, with the reason in
the log, in /health and in `neuron doctor`.

The check runs in a subprocess (a kernel that faults leaves the GPU context unusable; it must not
be the server's), once per GPU, driver, library versions, dtype and widths: the verdict is kept
in neuron's cache folder. Every rank checks its own card and the leader tells all ranks the union
of the failures, so every rank runs the same kernels. `NEURON_KERNELS=reference` or `triton`
overrides the verdict.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from neuron.layers.kernels import PIECES

CHECK_TIMEOUT_S = 300.0
_TOLERANCE = {torch.float32: 2e-3, torch.bfloat16: 3e-2, torch.float16: 5e-3}  # relative to the reference's scale


@dataclass(frozen=True, slots=True)
class Widths:
    """The shapes a model runs the kernels at, on one rank."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int

    @classmethod
    def of(cls, config: dict, world_size: int) -> Widths:
        text = config.get("text_config", config)
        hidden, heads = int(text["hidden_size"]), int(text["num_attention_heads"])
        kv = int(text.get("num_key_value_heads") or heads)
        return cls(hidden, max(heads // world_size, 1), max(kv // world_size, 1),
                   int(text.get("head_dim") or hidden // heads), max(int(text["intermediate_size"]) // world_size, 1))


# ---- the check itself (in the subprocess) ----


def check(device: str, dtype: torch.dtype, widths: Widths,
          kernels: dict[str, Callable] | None = None) -> dict[str, str]:
    """Run every piece's kernel against its reference; the pieces that failed, with why. `kernels`
    replaces the real ones (tests give fakes)."""
    from neuron.layers import kernel_cases

    cases = kernel_cases.cases(device, dtype, widths)
    kernels = kernels or kernel_cases.kernels()
    failures = {}
    for piece in PIECES:
        why = _compare(piece, kernels[piece], cases[piece], dtype)
        if why is not None:
            failures[piece] = why
    return failures


def _compare(piece: str, kernel: Callable, case_list: list, dtype: torch.dtype) -> str | None:
    for name, args, reference in case_list:
        try:
            got = kernel(*args)
        except Exception as exc:  # noqa: BLE001 - a kernel that cannot run here is exactly what this finds
            return f"{name}: {type(exc).__name__}: {_first_line(str(exc))}"
        for out, want in zip(_tensors(got), _tensors(reference)):
            if out.shape != want.shape:
                return f"{name}: shape {tuple(out.shape)}, the reference's {tuple(want.shape)}"
            if not torch.isfinite(out.float()).all():
                return f"{name}: NaN or inf in the output"
            scale = want.float().abs().max().item() or 1.0
            error = (out.float() - want.float()).abs().max().item() / scale
            if error > _TOLERANCE[dtype]:
                return f"{name}: differs from the reference by {error:.2e} of its largest value"
    return None


def _tensors(x) -> tuple[torch.Tensor, ...]:
    return x if isinstance(x, tuple) else (x,)


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0][:300] if text.strip() else ""


# ---- once per card, in a subprocess, cached ----


def fingerprint(device: str, dtype: str, widths: Widths) -> str:
    """What a verdict depends on: the card, its driver, the libraries, neuron, the shapes."""
    import neuron

    parts = {"device": device, "dtype": dtype, "widths": asdict(widths), "torch": torch.__version__,
             "cuda": torch.version.cuda, "neuron": neuron.__version__, "triton": package_version("triton"),
             "cupy": package_version("cupy")}
    if torch.cuda.is_available():
        index = torch.device(device).index or 0
        parts |= {"gpu": torch.cuda.get_device_name(index), "capability": torch.cuda.get_device_capability(index),
                  "driver": torch._C._cuda_getDriverVersion() if hasattr(torch._C, "_cuda_getDriverVersion") else None}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]


def package_version(module: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    for name in (module, f"{module}-cuda12x", f"{module}-cuda13x"):
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return None


def self_check(device: str, dtype: str, widths: Widths, runner: Callable[[list[str]], str] | None = None) -> dict[str, str]:
    """The pieces that fail on this card, from the cache or from a fresh check in a subprocess.
    A check process that dies fails every piece (not cached: it may be a passing fault)."""
    from neuron.utils.cache_dir import cache_root

    path = cache_root() / "kernel-checks" / f"{fingerprint(device, dtype, widths)}.json"
    if path.is_file():
        return json.loads(path.read_text())
    args = [sys.executable, "-m", "neuron.layers.kernel_check", "--device", device, "--dtype", dtype,
            "--widths", json.dumps(asdict(widths))]
    try:
        failures = json.loads((runner or run_check_process)(args))
    except (subprocess.SubprocessError, OSError, ValueError) as exc:
        why = f"the self-check process failed: {_first_line(str(exc)) or type(exc).__name__}"
        return dict.fromkeys(PIECES, why)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{id(failures)}.tmp")
    tmp.write_text(json.dumps(failures))
    tmp.replace(path)
    return failures


def run_check_process(args: list[str]) -> str:
    done = subprocess.run(args, capture_output=True, text=True, timeout=CHECK_TIMEOUT_S, check=False)
    if done.returncode != 0:
        raise subprocess.SubprocessError(f"exit {done.returncode}: {_first_line(done.stderr[-2000:])}")
    return done.stdout.strip().splitlines()[-1]


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description="check neuron's fused kernels against their references; prints "
                                             "the failures as one JSON line")
    ap.add_argument("--device", required=True)
    ap.add_argument("--dtype", required=True, choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--widths", required=True, help="JSON: hidden, heads, kv_heads, head_dim, intermediate")
    a = ap.parse_args(argv)
    failures = check(a.device, getattr(torch, a.dtype), Widths(**json.loads(a.widths)))
    print(json.dumps(failures))


if __name__ == "__main__":
    main()
