"""The interpreter in float64 computes with float64 constants: a float64 verdict that rounded the program's
constants to float32 would hide errors of a few 1e-8 (a scale, a softcap's cap) behind the spec's own."""
import math

import torch

from torch_cubridge.ir.expr import Expr
from torch_cubridge.ir.interpreter import evaluate


def const(v):
    return Expr("const", attr=v)


S = Expr("var", attr="s")


def test_constants_stay_float64():
    s = torch.linspace(-40.0, 40.0, 101, dtype=torch.float64)
    softcap = Expr("mul", (const(30.0 / 7.0), Expr("tanh", (Expr("mul", (S, const(0.1 / 3.0))),))))
    got = evaluate(softcap, {"s": s}, torch.float64)
    want = (30.0 / 7.0) * torch.tanh(s * (0.1 / 3.0))
    assert got.dtype == torch.float64
    assert (got - want).abs().max().item() < 1e-14  # float32 constants give ~1e-7


def test_a_unary_of_a_constant_and_a_where_of_constants_stay_float64():
    s = torch.zeros(3, dtype=torch.float64)
    e = Expr("add", (S, Expr("exp", (const(0.1),))))
    assert abs(evaluate(e, {"s": s}, torch.float64)[0].item() - math.exp(0.1)) < 1e-15
    w = Expr("where", (Expr("lt", (S, const(1.0))), const(0.1), const(0.2)))
    assert abs(evaluate(w, {"s": s}, torch.float64)[0].item() - 0.1) < 1e-17
