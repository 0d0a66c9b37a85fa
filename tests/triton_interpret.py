"""Imported by the Triton kernel tests before anything can load Triton: without a GPU the kernels
run in Triton's interpreter on CPU tensors, which Triton reads from TRITON_INTERPRET once, when it
is first imported, for the whole process. neuron imports Triton only when a kernel module is
first used, so setting it here is in time unless something imported Triton earlier, which
`require_triton` turns into a failure rather than a confusing one later."""

import os
import subprocess
import sys

import pytest
import torch

IMPORTED_EARLY = "triton" in sys.modules
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETING = DEVICE == "cpu"
if INTERPRETING:
    os.environ["TRITON_INTERPRET"] = "1"


def require_triton() -> None:
    """Skip without Triton; fail where it was imported before the interpreter could be set."""
    from neuron.layers.paged_attention import HAS_TRITON

    if not HAS_TRITON:
        pytest.skip("triton is not installed (pip install triton)")
    if INTERPRETING and IMPORTED_EARLY:
        pytest.fail("triton was imported before TRITON_INTERPRET=1 was set; set it in the environment of the "
                    "test run instead")


def compile_in_a_fresh_process(script: str, timeout: int) -> subprocess.CompletedProcess:
    """Run a compile script in a new Python without Triton's interpreter mode (this process has it
    on): the interpreter runs Python, which accepts code the GPU compiler refuses. Skipped where
    Triton is not installed, failed with its stderr where the script fails."""
    from neuron.layers.paged_attention import HAS_TRITON

    if not HAS_TRITON:
        pytest.skip("triton is not installed (pip install triton)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stderr[-3000:]
    return run
