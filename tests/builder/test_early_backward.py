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
from torch_cubridge.build import arch, early
from torch_cubridge.lower.backward import lower_backward
from torch_cubridge.ops import kernel

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
    monkeypatch.setattr(arch, "backward_arch", lambda device: "sm_90a")
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
    key = kernel.backward_key(low, "sm_90a")
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


def test_the_pipeline_starts_it_from_a_first_call_that_wants_gradients(built, monkeypatch):
    """Through tc.compile: the pipeline's stages run with gradients off, and the caller's grad mode is what
    decides (capture/nesting.caller_wants_grad); a call under no_grad builds no backward."""
    from torch_cubridge import pipeline
    monkeypatch.setattr(pipeline, "on_cuda", lambda bound: True)  # a CPU machine: the transfer's own path
    monkeypatch.setattr(early, "build_early", lambda *a: None)    # the forward's early build: not this test's
    keys = []
    for grad, scale in ((True, 0.0512), (False, 0.0513)):
        def spec(q, k, v, scale=scale):
            return torch.softmax(torch.tanh(q @ k.transpose(-1, -2) * scale / 9.0) * 9.0, dim=-1) @ v
        q, k, v = (torch.randn(2, 4, 130, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        with torch.set_grad_enabled(grad), pytest.warns(RuntimeWarning, match="CUDA is not available"):
            tc.compile(spec)(q, k, v)
        low = lower_backward(tc.transfer(spec, q, k, v), "sm_90a", "bfloat16", 64, 64)
        keys.append(kernel.backward_key(low, "sm_90a"))
    for fut in list(early._early.values()):
        fut.result()
    assert [k for k, _ in built] == keys[:1]
    early._early.clear()
