import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

os.environ.setdefault("NEURON_LOG_LEVEL", "WARNING")


def pytest_collection_modifyitems(config, items):
    """`gpu` tests are skipped, with the reason in the report, where torch sees no CUDA device."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    """NEURON_TEST_INSTAFAIL=1 (scripts/gpu_checklist.sh): a failure's traceback is written as it
    happens, so a run that its time limit cuts short still shows why each failed test failed."""
    if report.failed and os.environ.get("NEURON_TEST_INSTAFAIL"):
        sys.__stderr__.write(f"\n==== {report.nodeid} failed in {report.when}\n{report.longreprtext}\n")
        sys.__stderr__.flush()


@pytest.fixture
def small_prefill_chunks(monkeypatch):
    """16-token prefill chunks, so the longer test prompts take several steps."""
    monkeypatch.setenv("NEURON_PREFILL_CHUNK_TOKENS", "16")


@pytest.fixture
def exact_quantized_products(monkeypatch):
    """Quantized weights multiplied by the exact fp32 kernel (NEURON_QUANT_EXACT, read when a model
    loads): what comparisons with transformers at tight tolerances need. The default integer path
    rounds the activations; tests/test_quant_int.py holds it to its own bound."""
    monkeypatch.setenv("NEURON_QUANT_EXACT", "1")


@pytest.fixture(scope="session")
def default_tokenizer():
    from neuron.engine.tokenizer import Tokenizer
    from neuron.utils.default_checkpoint import default_model_dir

    return Tokenizer.from_dir(default_model_dir())


@pytest.fixture(scope="session")
def odd_checkpoint(tmp_path_factory):
    from checkpoints import ODD, build_checkpoint

    return build_checkpoint(tmp_path_factory.mktemp("odd"), seed=1, **ODD)


@pytest.fixture(scope="session")
def tied_checkpoint(tmp_path_factory):
    from checkpoints import build_checkpoint

    return build_checkpoint(tmp_path_factory.mktemp("tied"), seed=2)
