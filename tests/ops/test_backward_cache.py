"""The backward kernel goes through the disk cache as the forward does: processes that race for a new
variant's backward (a training job's ranks) build it once between them, and a later process builds nothing.
Real processes, the real compiler and the real cache and its file lock; no GPU is needed to build."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from racing import race
from test_lower import needs_nvcc

ARCH = "sm_90"


def _build_backward(directory: str, barrier, out) -> None:
    os.environ["CUBRIDGE_CACHE_DIR"] = directory
    import torch_cubridge as tc
    from torch_cubridge.ops.backward_gpu import GpuBackward
    from zoo import CASES
    case = next(c for c in CASES if c.name == "softcap_causal")
    program = tc.transfer(case.fn, *case.make(1, 2, 2, 40, 64, torch.float32))
    barrier.wait()  # both at the cache at once
    kernel = GpuBackward(program, ARCH, torch.bfloat16, 64)
    out.put((kernel.info["built"], kernel.info["key"], kernel.info["sha256"]))


def _run(directory: Path, n: int) -> list[tuple]:
    return race(_build_backward, (str(directory),), n, timeout=600)


@needs_nvcc
def test_racing_processes_build_a_backward_kernel_once_and_a_later_one_loads_it(tmp_path: Path) -> None:
    raced = _run(tmp_path / "cache", 2)
    assert sorted(built for built, _, _ in raced) == [False, True], raced  # one built, the other waited
    assert len({(key, sha) for _, key, sha in raced}) == 1 and raced[0][1].startswith("bwd-")
    (built, key, sha), = _run(tmp_path / "cache", 1)
    assert not built and (key, sha) == raced[0][1:]
