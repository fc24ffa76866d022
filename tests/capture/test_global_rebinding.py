"""A program bakes in what the spec read from its globals and closure: rebinding one of them must
retire every program captured before (as torch.compile's guards on globals do)."""
from __future__ import annotations

import torch

import torch_cubridge as tc
from helpers import serve_through_program

WINDOW = 4
SCALE = 0.5


def _band(s):  # a helper the spec calls: its globals count too
    i = torch.arange(s.shape[-1])
    return s.masked_fill((i[:, None] - i[None, :]).abs() > WINDOW, float("-inf"))


def windowed(q, k, v):
    return torch.softmax(_band(q @ k.transpose(-2, -1) * SCALE), -1) @ v


def _served_program_output(f, q, k, v):
    e = f._find(__import__("torch_cubridge").capture.signature.call_signature((q, k, v), {}), (q, k, v), {})
    assert e is not None and e.result is not None, [x.reason for x in f.entries()]
    return e.result.program.run(q, k, v)


def _ref(q, k, v):
    return windowed(q.double(), k.double(), v.double())


def test_rebinding_a_global_retires_the_programs(monkeypatch):
    global WINDOW, SCALE
    serve_through_program(monkeypatch)  # f's answers are its programs', not the spec's own
    f = tc.compile(windowed, fallback="silent")
    q, k, v = (torch.randn(1, 2, 24, 16) for _ in range(3))
    old = (WINDOW, SCALE)
    try:
        f(q, k, v)
        assert (_served_program_output(f, q, k, v).double() - _ref(q, k, v)).abs().max() < 1e-4
        WINDOW, SCALE = 9, 0.25  # read through the helper, and directly
        out = f(q, k, v)
        assert (out.double() - _ref(q, k, v)).abs().max() < 1e-4
        assert (_served_program_output(f, q, k, v).double() - _ref(q, k, v)).abs().max() < 1e-4
        assert f.served == {"kernel": 2}
    finally:
        WINDOW, SCALE = old


def test_rebinding_a_closure_cell_retires_the_programs(monkeypatch):
    serve_through_program(monkeypatch)
    cap = 10.0

    def softcapped(q, k, v):
        s = q @ k.transpose(-2, -1)
        return torch.softmax(cap * torch.tanh(s / cap), -1) @ v

    f = tc.compile(softcapped, fallback="silent")
    q, k, v = (torch.randn(1, 2, 20, 16) * 3 for _ in range(3))
    f(q, k, v)
    cap = 2.0  # noqa: F841  (rebinds the cell the spec reads)
    ref = softcapped(q.double(), k.double(), v.double())
    assert (f(q, k, v).double() - ref).abs().max() < 1e-4
    assert (_served_program_output(f, q, k, v).double() - ref).abs().max() < 1e-4
    assert f.served == {"kernel": 2}


def test_watch_costs_little_when_nothing_changes():
    f = tc.compile(windowed, fallback="silent")
    q, k, v = (torch.randn(1, 2, 24, 16) for _ in range(3))
    f(q, k, v)
    n = len(f.entries())
    f(q, k, v)
    assert len(f.entries()) == n  # no re-capture while the globals hold
