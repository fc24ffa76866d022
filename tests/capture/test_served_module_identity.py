"""Module arguments are keyed by identity: a program bakes in what the spec read from its module
(`module.scaling` here), so a new module must never be served by an entry made for another one,
not even one allocated at a dead module's address. Entries hold modules weakly: they die with their
last user reference, and their entries leave the table."""
import gc
import importlib
import warnings
import weakref

import pytest
import torch

import torch_cubridge as tc
compile_mod = importlib.import_module("torch_cubridge.compile")  # the package exports compile(), the function


class Scaled(torch.nn.Module):
    def __init__(self, scaling: float) -> None:
        super().__init__()
        self.scaling = scaling


def scaled_attention(module, q, k, v):
    s = (q @ k.transpose(-1, -2)) * module.scaling
    return s.softmax(-1) @ v


def qkv(S=8):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, 2, S, 16, generator=g) for _ in range(3))


def _quiet(f, *args):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no CUDA here: "the spec computes the result"
        return f(*args)


@pytest.fixture
def interpreted(monkeypatch):
    """The program's CPU interpreter stands in for the GPU kernel, so programs serve calls here: the
    spec, which reads the module at every call, would hide a stale program."""
    monkeypatch.setattr(compile_mod, "kernel_stage", lambda fn, res, bound: (res.program.run, "interpreted"))


def _module_at(address: int, held: list, tries: int = 200_000) -> Scaled | None:
    """A new module allocated at `address` (CPython reuses freed blocks), or None.

    Bare allocations (no __init__, which allocates blocks of its own) until one lands there; `held`
    keeps the misses alive and is made before the old module dies, else it would take the block."""
    for _ in range(tries):
        m = Scaled.__new__(Scaled)
        if id(m) == address:
            m.__init__(4.0)
            return m
        held.append(m)
    return None


def test_new_module_at_a_dead_modules_address_gets_its_own_program(interpreted):
    f = tc.compile(scaled_attention)
    args = qkv()
    a = Scaled(0.25)
    _quiet(f, a, *args)
    assert f.entries()[0].result is not None  # a program with a = 0.25 baked in
    address, held = id(a), []
    del a
    gc.collect()
    b = _module_at(address, held)
    if b is None:
        pytest.skip("the allocator did not reuse the dead module's address")
    out = _quiet(f, b, *args)
    assert torch.allclose(out, scaled_attention(b, *args), atol=1e-6)
    assert not torch.allclose(out, scaled_attention(Scaled(0.25), *args), atol=1e-3)
    assert f.served == {"kernel": 2}


def test_entries_do_not_keep_the_calls_module_and_tensors_alive():
    f = tc.compile(scaled_attention)
    m, args = Scaled(0.25), qkv()
    _quiet(f, m, *args)
    assert f.entries()[0].result is not None
    refs = [weakref.ref(x) for x in (m, *args)]
    del m, args
    gc.collect()
    assert [r() for r in refs] == [None] * 4


def test_dead_modules_entries_leave_room_under_the_cap(monkeypatch):
    monkeypatch.setattr(compile_mod, "MAX_PROGRAMS", 3)
    f = tc.compile(scaled_attention)
    args = qkv()
    for i in range(5):  # one module per call, each dead before the next: never more than one live entry
        _quiet(f, Scaled(0.1 * (i + 1)), *args)
        gc.collect()
    m = Scaled(0.6)
    out = _quiet(f, m, *args)
    assert torch.allclose(out, scaled_attention(m, *args), atol=1e-6)
    assert all(e.result is not None for e in f.entries()), [e.reason for e in f.entries()]
    assert len(f.entries()) <= 3
