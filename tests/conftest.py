import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_sessionstart(session):
    # the tests' kernels and verdicts go to a private cache, never the user's (records written by
    # one test are read by later ones only within this session)
    if "CUBRIDGE_CACHE_DIR" not in os.environ:
        import tempfile
        os.environ["CUBRIDGE_CACHE_DIR"] = tempfile.mkdtemp(prefix="cubridge-tests-")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
