"""The interpreter's float dtypes. Continuous maths in a float64 run is float64 with exact constants (a verdict
that rounded them to float32 would hide errors of ~1e-8 behind the spec's own). Float maths that feeds a
jump (floor, to_int, a comparison, a where's condition, a load's index) runs in float32, as the kernel runs
it: at a boundary float32 and float64 can give different integers, and the verdict must judge the kernel's."""
import math

import torch

from torch_cubridge.ir.expr import Expr
from torch_cubridge.ir.interpreter import evaluate


def const(v):
    return Expr("const", attr=v)


S = Expr("var", attr="s")
KV = Expr("var", attr="kv")


def test_continuous_maths_use_exact_float64_constants():
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


def _t5_bucket_maths() -> Expr:
    """log(kv / 8) / log(128 / 8) * 8: T5's log-spaced relative position, exactly 26 at kv = 65536."""
    ratio = Expr("div", (Expr("to_float", (KV,)), const(8.0)))
    return Expr("mul", (Expr("div", (Expr("log", (ratio,)), const(math.log(16.0)))), const(8.0)))


def _float32_floor(n: torch.Tensor) -> torch.Tensor:
    f = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    return torch.floor(torch.log(n.float() / f(8.0)) / f(math.log(16.0)) * f(8.0))


def test_floor_of_float_maths_is_evaluated_in_float32():
    n = torch.tensor([65536, 65535, 70000, 1000])
    f32 = _float32_floor(n)
    f64 = torch.floor(torch.log(n.double() / 8.0) / math.log(16.0) * 8.0)
    assert f32[0].item() == 25.0 and f64[0].item() == 26.0  # the boundary where the two disagree
    for op in ("floor", "to_int"):
        got = evaluate(Expr(op, (_t5_bucket_maths(),)), {"kv": n}, torch.float64)
        assert got.double().tolist() == f32.double().tolist(), op


def test_comparison_and_where_condition_of_float_maths_are_evaluated_in_float32():
    n = torch.tensor([65536, 1000])
    lt = Expr("lt", (_t5_bucket_maths(), const(26.0)))
    assert evaluate(lt, {"kv": n}, torch.float64).tolist() == [True, True]  # float64 says 26 < 26 is False
    w = Expr("where", (lt, const(1.0), const(2.0)))
    assert evaluate(w, {"kv": n}, torch.float64).tolist() == [1.0, 1.0]
    # the continuous value itself stays float64
    assert evaluate(_t5_bucket_maths(), {"kv": n}, torch.float64)[0].item() == 26.0


def test_a_constant_meeting_a_float64_tensor_keeps_its_own_value():
    """The kernel compares a float64 tensor in double, against the constant's double: 64.0000001 is not 64."""
    t = torch.tensor([64.0], dtype=torch.float64)
    e = Expr("lt", (Expr("load", (const(0),), attr="t"), const(64.0000001)))
    assert evaluate(e, {"@t": t}, torch.float64).item() is True
