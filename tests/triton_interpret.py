"""Imported by the Triton kernel tests before anything can load Triton: without a GPU the kernels
run in Triton's interpreter on CPU tensors, which Triton reads from TRITON_INTERPRET once, when it
is first imported, for the whole process. neuron imports Triton only when a kernel module is
first used, so setting it here is in time unless something imported Triton earlier, which
`require_triton` turns into a failure rather than a confusing one later."""

import os
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
