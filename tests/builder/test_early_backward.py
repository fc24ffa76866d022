"""build/early.py's backward build: a call that wants gradients starts the backward kernel's build on the
helper, under the key the backward then asks for (ops/backward_gpu.GpuBackward), so its first backward takes it.
The compiler is stood in for here (a CPU machine builds no cubin for a device it lacks): what is checked is
which source is built, when, and that the backward's own request takes that build."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import torch_cubridge as tc
from torch_cubridge.build import early
from torch_cubridge.lower.backward import lower_backward
from torch_cubridge.ops import backward_runner, kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from zoo import CASES  # noqa: E402


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """The (key, kernel name) of each cubin built, on a device that is sm_90a."""
    calls: list[tuple[str, str]] = []

    def fake(key: str, source: str, arch: str, name: str) -> tuple[bytes, dict]:
        calls.append((key, name))
        return b"cubin:" + key.encode(), {"key": key, "built": True}
    monkeypatch.setattr(kernel, "cached_cubin", fake)
    monkeypatch.setattr(backward_runner, "backward_arch", lambda device: "sm_90a")
    return calls


def _call(name: str, grad: bool, dtype=torch.bfloat16):
    c = next(c for c in CASES if c.name == name)
    args = c.make(2, 4, 4, 130, 64, torch.float32)
    p = tc.transfer(c.fn, *args)
    bound = dict(zip(p.signature, [a.to(dtype) if a.dim() == 4 else a for a in args]))
    if grad:
        bound["q"].requires_grad_()
        for a in bound.values():
            if a.is_floating_point() and a.dim() < 4:
                a.requires_grad_()
    return p, bound


@pytest.mark.parametrize("name", ["softcap_causal", "rel_bias_table"])
def test_a_call_that_wants_gradients_builds_the_backward_the_runner_asks_for(built, name):
    p, bound = _call(name, grad=True)
    early.build_backward_early(p, bound, torch.device("cpu"))
    learn = tuple(x.name for x in p.extras if x.dtype.startswith("float"))
    low = lower_backward(p, "sm_90a", "bfloat16", 64, 64, learnable=learn)
    key = kernel.source_key("bwd", low.source, "sm_90a")
    early._early[key].result()
    assert built == [(key, "cubridge_bwd")]
    # the backward's own request: the early build's cubin, not a second build
    cubin, info = early.backward_cubin(key, low.source, "sm_90a", "cubridge_bwd")
    assert cubin == b"cubin:" + key.encode() and info["early"] and len(built) == 1
    assert key not in early._early


def test_no_gradients_wanted_no_backward_built(built):
    p, bound = _call("softcap_causal", grad=False)
    early.build_backward_early(p, bound, torch.device("cpu"))
    with torch.no_grad():
        p, bound = _call("softcap_causal", grad=True)
        early.build_backward_early(p, bound, torch.device("cpu"))
    p, bound = _call("softcap_causal", grad=True, dtype=torch.float32)  # no backward kernel for float32
    early.build_backward_early(p, bound, torch.device("cpu"))
    assert built == []
