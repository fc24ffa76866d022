"""Each rule of ir/derivative.py against torch.autograd of the interpreter's own evaluation, in float64.

For every op of the table an expression puts the op on a path from s (the q.k dot) and from a load of a
learnable table; d/ds and d/d(table element) evaluated from the derived Exprs must equal autograd's."""
import pytest
import torch

from torch_cubridge.ir.derivative import RULES, NotDifferentiable, derivative, load_sites
from torch_cubridge.ir.expr import call, const, load, var, where
from torch_cubridge.ir.interpreter import evaluate

S, T = var("s"), load("t", var("kv"))  # s and one learnable element per key
POS = call("add", call("mul", S, S), call("mul", T, T))  # > 0 where a rule needs it
POS = call("add", POS, const(0.5))
MIX = call("add", call("mul", S, const(0.7)), T)  # any sign


def _binary(op):
    return call(op, MIX, call("add", call("mul", S, T), const(0.3)))


CASES = {
    "add": _binary("add"), "sub": _binary("sub"), "mul": _binary("mul"),
    "div": call("div", MIX, POS), "pow": call("pow", POS, T),
    "max": _binary("max"), "min": _binary("min"), "neg": call("neg", MIX), "abs": call("abs", MIX),
    "tanh": call("mul", call("tanh", call("div", MIX, const(3.0))), const(3.0)),
    "exp": call("exp", MIX), "exp2": call("exp2", MIX), "expm1": call("expm1", MIX),
    "log": call("log", POS), "log2": call("log2", POS), "log1p": call("log1p", POS),
    "sqrt": call("sqrt", POS), "rsqrt": call("rsqrt", POS), "reciprocal": call("reciprocal", POS),
    "sigmoid": call("sigmoid", MIX), "sin": call("sin", MIX), "cos": call("cos", MIX),
    "to_float": call("mul", MIX, call("to_float", call("sub", var("kv"), var("q")))),
    "where": where(call("gt", S, T), call("mul", S, const(2.0)), call("mul", T, S)),
}
# booleans pick a branch: their own derivative is zero, the branches' flows
for op in ("eq", "ne", "lt", "le", "gt", "ge"):
    CASES[op] = where(call(op, S, T), call("exp", MIX), call("mul", MIX, const(-2.0)))
for op in ("and", "or"):
    CASES[op] = where(call(op, call("gt", S, const(0.0)), call("lt", T, const(0.5))), call("sin", MIX), MIX)
CASES["not"] = where(call("not", call("gt", S, T)), call("sin", MIX), MIX)
# step functions of indices alone: zero, and the score's other terms keep theirs
_IDX = call("sub", var("kv"), var("q"))
for op, e in {"floor": call("floor", call("div", _IDX, const(3.0))), "sign": call("sign", _IDX),
              "to_int": call("to_int", call("div", _IDX, const(2.0))), "floordiv": call("floordiv", _IDX, const(3)),
              "mod": call("mod", _IDX, const(3)), "to_bool": call("to_bool", _IDX)}.items():
    CASES[op] = call("add", call("mul", MIX, call("to_float", e)), MIX)


def test_every_rule_has_a_case():
    assert set(RULES) == set(CASES)


def _env(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(3, 7, generator=g, dtype=torch.float64).requires_grad_()
    t = torch.randn(7, generator=g, dtype=torch.float64).requires_grad_()
    return {"s": s, "@t": t, "q": torch.arange(3).view(3, 1), "kv": torch.arange(7).view(1, 7)}


@pytest.mark.parametrize("op", sorted(CASES))
def test_rule_matches_autograd(op):
    e = CASES[op]
    for seed in range(5):
        env = _env(seed)
        y = torch.as_tensor(evaluate(e, env, torch.float64)).expand(3, 7)
        g_s, g_t = torch.autograd.grad(y.sum(), (env["s"], env["@t"]), allow_unused=True)
        d_s = torch.as_tensor(evaluate(derivative(e, S), env, torch.float64), dtype=torch.float64).expand(3, 7)
        torch.testing.assert_close(d_s, g_s if g_s is not None else torch.zeros_like(d_s), rtol=1e-12, atol=1e-12)
        sites = load_sites(e, {"t"})
        assert sites == (T,)
        d_t = torch.as_tensor(evaluate(derivative(e, T), env, torch.float64), dtype=torch.float64).expand(3, 7)
        got = torch.zeros(7, dtype=torch.float64).index_add_(0, torch.arange(7), d_t.sum(0))
        torch.testing.assert_close(got, g_t if g_t is not None else torch.zeros_like(got), rtol=1e-12, atol=1e-12)


def test_trivial_terms_fold():
    assert derivative(call("mul", S, const(0.125)), S) == const(0.125)  # a scale gives the scale
    assert derivative(call("add", S, T), S) == const(1.0)  # a bias gives identity
    assert derivative(call("add", S, T), T) == const(1.0)
    capped = call("mul", call("tanh", call("div", S, const(30.0))), const(30.0))
    d = derivative(capped, S)  # softcap: 30 * (1 - tanh^2) / 30, with nothing of d(30) left
    assert str(d) == f"(((1.0 - (tanh((s / 30.0)) * tanh((s / 30.0)))) * {1 / 30.0!r}) * 30.0)", str(d)
    assert derivative(call("mul", S, var("kv")), T) == const(0.0)


@pytest.mark.parametrize("op", ["floor", "sign", "to_int", "to_bool", "mod", "floordiv"])
def test_step_function_of_the_score_is_refused(op):
    e = call(op, S) if op in ("floor", "sign", "to_int", "to_bool") else call(op, S, const(2.0))
    with pytest.raises(NotDifferentiable, match=op):
        derivative(call("add", S, call("to_float", e)), S)


def test_conditions_and_indices_are_not_sites():
    # a table read in a where's condition or as another load's index carries no gradient
    e = where(call("gt", load("t", var("q")), const(0.0)), S, load("u", call("to_int", load("t", var("kv")))))
    assert load_sites(e, {"t", "u"}) == (load("u", call("to_int", load("t", var("kv")))),)
