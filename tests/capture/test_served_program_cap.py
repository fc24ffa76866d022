"""Past MAX_PROGRAMS a compiled function serves the spec, and says so (once): a silent cap would
hide every kernel lost to it (an 18-layer model once needed 36 programs from one shared table)."""
import importlib
import warnings

import pytest
import torch

import torch_cubridge as tc

compile_mod = importlib.import_module("torch_cubridge.compile")  # the package exports compile(), the function


def scaled(q, k, v, scale: float):
    return ((q @ k.transpose(-1, -2)) * scale).softmax(-1) @ v


def qkv():
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, 2, 8, 16, generator=g) for _ in range(3))


def test_a_program_refused_by_the_cap_warns_once(monkeypatch):
    monkeypatch.setattr(compile_mod, "MAX_PROGRAMS", 2)
    # the CPU interpreter stands in for the kernel, so a served count says who computed each call
    monkeypatch.setattr(compile_mod, "kernel_stage", lambda fn, res, bound: (res.program.run, "interpreted"))
    f = tc.compile(scaled)
    args = qkv()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # under the cap: no warning
        for scale in (0.1, 0.2):  # a Python scalar is a guard: one program per value
            f(*args, scale)
    assert f.served == {"kernel": 2}
    with pytest.warns(RuntimeWarning, match="2 programs were captured already"):
        out = f(*args, 0.3)
    assert torch.allclose(out, scaled(*args, 0.3))
    assert f.served == {"kernel": 2, "spec": 1}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per compiled function
        f(*args, 0.4)
        f(*args, 0.3)
    assert len([e for e in f.entries() if e.result is not None]) == 2


def test_calls_the_spec_computes_past_a_ready_kernel_are_counted_with_why(monkeypatch):
    """A kernel that cannot take one call's inputs (SpecServes: a layout, a table's dtype) hands it to the spec.
    The warning is said once; the entry keeps each reason's count, and the serving report shows it, so a run
    where most calls went to the spec says why."""
    from torch_cubridge.ops.errors import SpecServes

    def picky(*args):
        if args[0].shape[0] > 1:  # stands in for a call the real runner refuses per call
            raise SpecServes("this layout is not one the kernel reads")
        return args[0]

    monkeypatch.setattr(compile_mod, "kernel_stage", lambda fn, res, bound: (picky, "interpreted"))
    f = tc.compile(scaled)
    q, k, v = qkv()
    assert torch.equal(f(q, k, v, 0.5), q)  # the stand-in kernel served it
    wide = tuple(torch.cat([t, t]) for t in (q, k, v))
    with pytest.warns(RuntimeWarning, match="not one the kernel reads"):
        for _ in range(3):
            assert torch.allclose(f(*wide, 0.5), scaled(*wide, 0.5))
    assert f.served == {"kernel": 1, "spec": 3}
    counts = [e.spec_calls for e in f.entries() if e.spec_calls]
    assert counts == [{"the spec computes this call: this layout is not one the kernel reads": 3}]
    assert "the spec computed 3 call(s)" in f.serving_report(*wide, 0.5)
