"""bench_train's float64 check of our gradients, on the CPU with the interpreter behind the op: both of its
references (the spec's autograd, and past SPEC_AUTOGRAD_MAX_S the program's own float64 backward on the op's
operands, ALiBi's constant slopes included), a spoiled dK row caught, and the bound it allows dK for the
rounding of delta from a bf16 O covering that rounding key by key."""
from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

import torch_cubridge as tc
from interpreted_op import serve_by_op
from torch_cubridge.verify.judge import delta_rounding, key_delta_rounding_allowance

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("bench_train_mod", ROOT / "benchmarks" / "bench_train.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _inputs(S: int = 40, D: int = 16, H: int = 2):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(2, H, S, D, generator=g).bfloat16().float() for _ in range(4)]


@pytest.mark.parametrize("path", ["spec-autograd", "program-backward"])
@pytest.mark.parametrize("spoil", [False, True], ids=["exact", "dK-row-spoiled"])
def test_the_bench_check_passes_exact_gradients_and_catches_a_wrong_row(monkeypatch, path, spoil):
    bench = _bench()
    if path == "program-backward":
        monkeypatch.setattr(bench, "SPEC_AUTOGRAD_MAX_S", 0)
    serve_by_op(monkeypatch)
    spec = bench.SPECS["alibi_causal"]
    f = tc.compile(spec)
    q, k, v, do = _inputs()
    with torch.no_grad():
        o = f(q, k, v)
    one = [t.double().requires_grad_() for t in (q, k, v)]
    exact = [g.float() for g in torch.autograd.grad(spec(*one), one, do.double())]
    if spoil:
        exact[1][0, 0, 7] *= 1.5
    got = bench.grads_vs_fp64(spec, f.kernels()[-1], exact, q, k, v, do, (), o)
    assert got["grads_match_fp64"] is not spoil, got
    assert got["dk_ok"] is not spoil


def test_the_dk_allowance_covers_the_rounding_of_delta_key_by_key():
    """dK of a backward whose delta reads O rounded to bf16, against float64's: the error is -g sum_i P_ij
    eps_i q_i (eps_i the row's error in delta), within key_delta_rounding_allowance at every key."""
    q, k, v, do = (t.double() for t in _inputs(S=96, D=16, H=4))
    S, D = q.shape[2], q.shape[3]
    s = (q @ k.transpose(-1, -2)) / math.sqrt(D)
    s = s.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    p = s.softmax(-1)
    o = p @ v
    ob = o.bfloat16()
    eps = (do * (ob.double() - o)).sum(-1)  # delta from the rounded O, less float64's
    err = (-(p * eps.unsqueeze(-1)).transpose(-1, -2) @ q / math.sqrt(D)).abs().amax(-1)
    p_t = p.transpose(-1, -2) @ delta_rounding(ob, do).unsqueeze(-1)  # what the bench takes as a backward's dV
    allow = key_delta_rounding_allowance(p_t[..., 0], q, D ** -0.5)
    assert (err <= allow).all(), float((err / allow).max())
    assert float((err / allow).max()) > 1e-3  # the bound is of the error's order, not vacuous


def test_the_bench_takes_p_transposed_from_the_specs_dv_alone():
    """P^T x per key (what the dK allowance reads) as the dV of the spec's float64 autograd handed x as every
    column of dO, with the softmax's backward left out: against P formed directly."""
    bench = _bench()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 30, 16, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3))
    x = torch.rand(1, 2, 30, generator=g, dtype=torch.float64)
    dq, dk, dv = bench.fp64_backward(bench.SPECS["causal"], None, [q, k, v], (),
                                     x.unsqueeze(-1).expand(1, 2, 30, 16).contiguous(), v_alone=True)
    s = (q @ k.transpose(-1, -2) / 4).masked_fill(torch.ones(30, 30, dtype=torch.bool).triu(1), float("-inf"))
    want = (s.softmax(-1).transpose(-1, -2) @ x.unsqueeze(-1))[..., 0]
    assert dq is None and dk is None
    torch.testing.assert_close(dv[..., 0], want.detach(), rtol=1e-12, atol=1e-12)
