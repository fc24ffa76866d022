import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "support"))
from paths import SEARCH  # noqa: E402  (support/ first: it says where the rest is)

# the test folders import each other's helpers by module name
sys.path[:0] = [str(p) for p in SEARCH if str(p) not in sys.path]
import skip_budget  # noqa: E402

# One intra-op thread for the CPU suite (and the subprocesses it starts): its tensors are small, and with two
# threads on a 2-core machine OpenMP spins waiting for the busy core (the transfer tests took 2.2x the CPU
# time). An OMP_NUM_THREADS set by the caller stands; a CUDA machine keeps torch's default for its big
# float64 references on the host.
if "OMP_NUM_THREADS" not in os.environ and not torch.cuda.is_available():
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


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


def pytest_runtest_logreport(report):
    skip_budget.record(report)


def pytest_terminal_summary(terminalreporter):
    skip_budget.summary(terminalreporter.write_line)


def pytest_sessionfinish(session, exitstatus):
    if skip_budget.over_budget() and exitstatus == 0:
        session.exitstatus = 1
