"""A model's layers are modules of one class that differ in attributes their attention never reads
(layer_idx): their traces are one graph, and where a layer's own transfer gives the program (guards
included) that another layer's passed verification with, that verdict serves; an attribute the trace
reads keeps the verifications apart."""
from __future__ import annotations

import pytest
import torch

from helpers import rel_err
from torch_cubridge.capture.trace import bind_example
from torch_cubridge.ir.guards import bound_failing
from torch_cubridge.pipeline import transfer_stage

SHARED = "same trace and guards"


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """Verdicts of this test only: tests in other processes (xdist) share a trace with these layers."""
    monkeypatch.setenv("CUBRIDGE_CACHE_DIR", str(tmp_path / "cache"))


class Layer(torch.nn.Module):
    def __init__(self, layer_idx: int, window: int = 1 << 20, scaling: float = 0.125) -> None:
        super().__init__()
        self.layer_idx, self.window, self.scaling = layer_idx, window, scaling


def banded_when_long(module, q, k, v):
    """Plain attention up to the module's window, a causal band past it: a branch on an attribute."""
    s = (q @ k.transpose(-1, -2)) * module.scaling
    S = q.shape[-2]
    if S > module.window:
        i = torch.arange(S)
        s = s.masked_fill((i[None, :] > i[:, None]) | (i[:, None] - i[None, :] >= module.window), float("-inf"))
    return s.softmax(-1) @ v


def _qkv(S: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, 3, S, 16, generator=g) for _ in range(3))


def _transfer(mod, S: int):
    args = (mod,) + _qkv(S)
    return transfer_stage(banded_when_long, bind_example(banded_when_long, args, {}))


def test_layers_differing_in_an_unread_attribute_share_one_verification():
    first = _transfer(Layer(7001), 40)
    again = _transfer(Layer(7002), 40)
    assert SHARED not in first.report.reason and SHARED in again.report.reason
    assert again.key == first.key  # the kernel's GPU verdict is looked up under the first layer's key
    args = (Layer(7002),) + _qkv(40, 1)
    assert rel_err(again.program.run(*args), banded_when_long(*(a.double() if isinstance(a, torch.Tensor) else a
                                                                  for a in args))) < 1e-6


def test_an_attribute_the_trace_reads_is_verified_apart():
    _transfer(Layer(7101, scaling=0.125), 40)
    other = _transfer(Layer(7102, scaling=0.25), 40)
    assert SHARED not in other.report.reason


def test_a_branch_on_an_attribute_keeps_each_layers_guards():
    """Both layers trace the plain branch at 40 keys; past 50 the second takes the band. Whatever
    program serves it, at any length its guards admit it equals its own spec."""
    _transfer(Layer(7201, window=100), 40)
    mod = Layer(7202, window=50)
    res = _transfer(mod, 40)
    for S in (45, 70, 99):
        args = (mod,) + _qkv(S, S)
        if bound_failing(res.program.guards, bind_example(banded_when_long, args, {})) is None:
            want = banded_when_long(mod, *(a.double() for a in args[1:]))
            assert rel_err(res.program.run(*args), want) < 1e-6, S
