"""`cubridge build`: a spec verified and its kernels built into the cache ahead of time, with no GPU;
a later process finds them under the keys it computes itself."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
needs_compiler = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs a CUDA compiler")


def _cli(tmp_path, *args):
    env = dict(os.environ, CUBRIDGE_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "torch_cubridge", *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=600)


@needs_compiler
@pytest.mark.parametrize("queries", [0, 1])
def test_build_puts_the_serving_kernels_in_the_cache(tmp_path, monkeypatch, queries):
    r = _cli(tmp_path, "build", "tests/zoo.py:causal_bottom_right", "--arch", "sm_90a", "--shape", "1,4,96,64",
             "--kv-heads", "4", *(["--queries", str(queries)] if queries else []))
    assert r.returncode == 0, r.stderr
    assert "cubridge: building" in r.stderr  # progress on stderr
    key = r.stdout.split()[0]
    assert ("cubridge_decode" if queries else "cubridge_fwd") in r.stdout
    # a serving process computes the same key for the same spec, arch and dtype, and finds the cubin
    monkeypatch.setenv("CUBRIDGE_CACHE_DIR", str(tmp_path / "cache"))
    import torch_cubridge as tc
    from torch_cubridge import cache as cache_mod
    from torch_cubridge.lower import lower
    from torch_cubridge.ops.kernel import kernel_key
    from zoo import causal_bottom_right
    q = torch.randn(1, 4, queries or 96, 64, dtype=torch.bfloat16)
    k, v = (torch.randn(1, 4, 96, 64, dtype=torch.bfloat16) for _ in range(2))
    p = tc.transfer(causal_bottom_right, q, k, v)
    low = lower(p, "sm_90a", "bfloat16", 64, decode=bool(queries))
    assert kernel_key(low, "sm_90a") == key
    assert cache_mod.default_cache().get(key) is not None
    listed = _cli(tmp_path, "cache", "list")
    assert key in listed.stdout


def test_build_refuses_a_spec_it_cannot_compile(tmp_path):
    r = _cli(tmp_path, "build", "tests/test_errors.py:erf_scores", "--arch", "sm_90a", "--shape", "1,2,64,64")
    assert r.returncode == 2 and "refused" in r.stderr and "torch.erf" in r.stderr
