"""`neuron doctor`: what this machine offers neuron and which of neuron's kernels it can trust, in
one report to paste into a bug report.

It prints the environment (Python, torch and its CUDA, each GPU with its compute capability and
driver, Triton, CuPy and NCCL, the C++ compiler, neuron) and then checks the fused CUDA kernels of
every GPU against their PyTorch references at the widths given (the self-check `neuron serve`
runs at start-up, here fresh, not from the cache), and whether the CPU attention kernel builds.
Without a GPU it says so and what it would check there.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys

_DESCRIPTION = __doc__.split("\n\n")[0].replace("\n", " ")


def add_parser(sub) -> None:
    ap = sub.add_parser("doctor", help="print the environment and check neuron's kernels on this machine",
                        description=_DESCRIPTION)
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"),
                    help="dtype the GPU kernels are checked in (default: bfloat16)")
    ap.add_argument("--widths", default='{"hidden": 4096, "heads": 32, "kv_heads": 8, "head_dim": 128, '
                                        '"intermediate": 12288}',
                    help="JSON widths to check at (default: a Qwen3-8B rank at tp 1)")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of text")
    ap.set_defaults(run=run)


def environment() -> dict:
    import torch

    from neuron import __version__
    from neuron.layers.kernel_check import package_version
    from neuron.utils import native

    env = {"neuron": __version__, "python": sys.version.split()[0], "platform": platform.platform(),
           "torch": torch.__version__, "torch_cuda": torch.version.cuda, "triton": package_version("triton"),
           "cupy": package_version("cupy"), "nccl": _nccl_version(), "cxx": native.compiler(), "gpus": []}
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            env["gpus"].append({"index": i, "name": p.name, "capability": f"{p.major}.{p.minor}",
                                "memory_gib": round(p.total_memory / 2**30, 1)})
        env["driver"] = _driver_version()
    return env


def _nccl_version() -> str | None:
    try:
        from cupy.cuda import nccl

        return str(nccl.get_version())
    except Exception:  # noqa: BLE001 - no CuPy, or one built without NCCL: reported as absent
        return None


def _driver_version() -> str | None:
    try:
        import torch

        version = torch._C._cuda_getDriverVersion()
        return f"{version // 1000}.{version % 1000 // 10}"
    except Exception:  # noqa: BLE001 - reported as unknown
        return None


def checks(dtype: str, widths_json: str) -> dict:
    """Each GPU's failing kernels (fresh checks, in subprocesses), and the CPU kernels."""
    import torch

    from neuron.layers import cpu_attention, cpu_ops
    from neuron.layers.kernel_check import CHECK_TIMEOUT_S, Widths, run_check_process

    Widths(**json.loads(widths_json))  # malformed widths are refused before any check runs
    out: dict = {name: "built" if lib is not None else "not built (see the warning)"
                 for name, lib in (("cpu_attention", cpu_attention.library()), ("cpu_ops", cpu_ops.library()))}
    if not torch.cuda.is_available():
        out["gpu"] = ("no CUDA device: on a GPU this checks rms_norm, add_rms_norm, norm_rope, silu_mul and "
                      "paged_attention against their PyTorch references")
        return out
    for i in range(torch.cuda.device_count()):
        args = [sys.executable, "-m", "neuron.layers.kernel_check", "--device", f"cuda:{i}", "--dtype", dtype,
                "--widths", widths_json]
        try:
            out[f"cuda:{i}"] = json.loads(run_check_process(args)) or "every kernel matches its reference"
        except Exception as exc:  # noqa: BLE001 - the report says what went wrong
            out[f"cuda:{i}"] = f"the check failed: {exc}"
    out["timeout_s"] = CHECK_TIMEOUT_S
    return out


def run(args: argparse.Namespace) -> int:
    report = {"environment": environment(), "kernels": checks(args.dtype, args.widths)}
    if args.json:
        print(json.dumps(report, indent=2, default=str))
        return 0
    for section, values in report.items():
        print(f"== {section}")
        for key, value in values.items():
            print(f"{key:>14}: {json.dumps(value, default=str) if isinstance(value, (dict, list)) else value}")
    return 0
