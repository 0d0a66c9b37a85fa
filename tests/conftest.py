import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

os.environ.setdefault("NEURON_LOG_LEVEL", "WARNING")


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def odd_checkpoint(tmp_path_factory):
    from checkpoints import ODD, build_checkpoint

    return build_checkpoint(tmp_path_factory.mktemp("odd"), seed=1, **ODD)


@pytest.fixture(scope="session")
def tied_checkpoint(tmp_path_factory):
    from checkpoints import build_checkpoint

    return build_checkpoint(tmp_path_factory.mktemp("tied"), seed=2)
