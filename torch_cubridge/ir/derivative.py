"""Derivatives of CuIR expressions, by one table of rules.

The backward of a score hook is derived here, never written per variant: `derivative(e, wrt)` is the Expr of
d e / d wrt, where `wrt` is `var("s")` (the raw q.k dot product), `var("lse")` (a row scale's log-sum-exp) or
a `load` node (one element of an extra tensor at that index: a learnable table's gradient flows into the
element the score reads). Forward mode: each rule builds its result from its operands' derivatives, and the
smart constructors below fold the trivial terms, so a softcap gives `1 - tanh^2`, a scale gives the scale
and a bias gives nothing at all.

Conditions of `where` and the indices of `load` are never differentiated: they are integer or boolean, and
a mask's pairs have probability zero. Ops that are piecewise constant (floor, mod, sign, casts to int or
bool) have derivative zero where their operand does not move with `wrt`; where it does, the score is a
step function of it, which has no gradient to give, and `NotDifferentiable` names the op.
"""
from __future__ import annotations

import math
from typing import Callable

from ..errors import UnsupportedSpec
from .expr import COMPARE, Expr, call, const, where

ZERO = const(0.0)
ONE = const(1.0)


class NotDifferentiable(UnsupportedSpec):
    """The score moves with q.k (or a learnable tensor) through an op with no derivative there."""


# -- smart constructors: fold constants and the identities of 0 and 1 ----------------------------------------
def _is(e: Expr, v: float) -> bool:
    return e.op == "const" and not isinstance(e.attr, bool) and isinstance(e.attr, (int, float)) and e.attr == v


def _both_const(x: Expr, y: Expr) -> bool:
    num = (int, float)
    return all(e.op == "const" and isinstance(e.attr, num) and not isinstance(e.attr, bool) for e in (x, y))


def add(x: Expr, y: Expr) -> Expr:
    if _is(x, 0):
        return y
    if _is(y, 0):
        return x
    return const(x.attr + y.attr) if _both_const(x, y) else call("add", x, y)


def sub(x: Expr, y: Expr) -> Expr:
    if _is(y, 0):
        return x
    if _is(x, 0):
        return neg(y)
    return const(x.attr - y.attr) if _both_const(x, y) else call("sub", x, y)


def mul(x: Expr, y: Expr) -> Expr:
    if _is(x, 0) or _is(y, 0):
        return ZERO
    if _is(x, 1):
        return y
    if _is(y, 1):
        return x
    return const(x.attr * y.attr) if _both_const(x, y) else call("mul", x, y)


def div(x: Expr, y: Expr) -> Expr:
    if _is(x, 0):
        return ZERO
    if _is(y, 1):
        return x
    return const(x.attr / y.attr) if _both_const(x, y) and not _is(y, 0) else call("div", x, y)


def neg(x: Expr) -> Expr:
    if x.op == "const" and isinstance(x.attr, (int, float)) and not isinstance(x.attr, bool):
        return const(-x.attr)
    return x.args[0] if x.op == "neg" else call("neg", x)


def pick(c: Expr, x: Expr, y: Expr) -> Expr:
    return x if x == y else where(c, x, y)


# -- the table ---------------------------------------------------------------------------------------------
# Each rule: (node, its operands' derivatives) -> the node's derivative. Operands are e.args.
Rule = Callable[[Expr, tuple[Expr, ...]], Expr]


def _chain(f: Callable[[Expr], Expr]) -> Rule:
    """A unary op whose derivative is f(x): d = f(x) * dx."""
    return lambda e, d: ZERO if _is(d[0], 0) else mul(f(e.args[0]), d[0])


def _piecewise_constant(e: Expr, d: tuple[Expr, ...]) -> Expr:
    if any(not _is(x, 0) for x in d):
        raise NotDifferentiable(f"the score moves with a differentiated value through {e.op}, a step "
                                "function: it has no gradient there", op=e.op)
    return ZERO


def _max_min(e: Expr, d: tuple[Expr, ...]) -> Expr:
    # the larger (smaller) operand's derivative; a tie splits it evenly, as torch.maximum's backward does
    x, y = e.args
    first = call("gt" if e.op == "max" else "lt", x, y)
    tie = call("eq", x, y)
    return pick(first, d[0], pick(tie, mul(const(0.5), add(d[0], d[1])), d[1]))


def _div(e: Expr, d: tuple[Expr, ...]) -> Expr:
    x, y = e.args
    return sub(div(d[0], y), div(mul(e, d[1]), y))


def _pow(e: Expr, d: tuple[Expr, ...]) -> Expr:
    x, y = e.args
    dx = mul(mul(y, call("pow", x, sub(y, ONE))), d[0]) if not _is(d[0], 0) else ZERO
    dy = mul(mul(e, call("log", x)), d[1]) if not _is(d[1], 0) else ZERO
    return add(dx, dy)


def _abs(e: Expr, d: tuple[Expr, ...]) -> Expr:
    return ZERO if _is(d[0], 0) else mul(call("sign", e.args[0]), d[0])


LN2 = math.log(2.0)
RULES: dict[str, Rule] = {
    "add": lambda e, d: add(d[0], d[1]),
    "sub": lambda e, d: sub(d[0], d[1]),
    "mul": lambda e, d: add(mul(d[0], e.args[1]), mul(e.args[0], d[1])),
    "div": _div,
    "neg": lambda e, d: neg(d[0]),
    "abs": _abs,
    "max": _max_min,
    "min": _max_min,
    "pow": _pow,
    "tanh": lambda e, d: _chain(lambda x: sub(ONE, mul(e, e)))(e, d),
    "exp": lambda e, d: _chain(lambda x: e)(e, d),
    "exp2": lambda e, d: _chain(lambda x: mul(e, const(LN2)))(e, d),
    "expm1": lambda e, d: _chain(lambda x: call("exp", x))(e, d),
    "log": _chain(lambda x: call("reciprocal", x)),
    "log2": _chain(lambda x: call("reciprocal", mul(x, const(LN2)))),
    "log1p": _chain(lambda x: call("reciprocal", add(ONE, x))),
    "sqrt": lambda e, d: _chain(lambda x: div(const(0.5), e))(e, d),
    "rsqrt": lambda e, d: _chain(lambda x: mul(const(-0.5), call("pow", e, const(3.0))))(e, d),
    "reciprocal": lambda e, d: _chain(lambda x: neg(mul(e, e)))(e, d),
    "sigmoid": lambda e, d: _chain(lambda x: mul(e, sub(ONE, e)))(e, d),
    "sin": _chain(lambda x: call("cos", x)),
    "cos": _chain(lambda x: neg(call("sin", x))),
    "to_float": lambda e, d: d[0],
    # `where`: the condition is not differentiated (see the module's note); d[0] is its ZERO placeholder
    "where": lambda e, d: pick(e.args[0], d[1], d[2]),
    # booleans: a compare's or a boolean op's result is constant almost everywhere
    **{op: (lambda e, d: ZERO) for op in COMPARE | {"and", "or", "not"}},
    **{op: _piecewise_constant for op in ("floor", "sign", "to_int", "to_bool", "floordiv", "mod")},
}
# leaves: constants, scalars (runtime Python numbers) and index variables do not move
_LEAVES = {"const", "scalar", "var", "dim", "arg", "load"}
# operands never differentiated: a where's condition, a load's indices
_NOT_DIFFERENTIATED = {"where": (0,)}


def derivative(e: Expr, wrt: Expr) -> Expr:
    """d e / d wrt, simplified; `wrt` is a `var` or a `load` node, matched by equality."""
    memo: dict[Expr, Expr] = {}

    def d(n: Expr) -> Expr:
        if n == wrt:
            return ONE
        if n in memo:
            return memo[n]
        if n.op in _LEAVES:
            out = ZERO  # another variable, or another element: a load's indices are integers
        else:
            skip = _NOT_DIFFERENTIATED.get(n.op, ())
            parts = tuple(ZERO if i in skip else d(a) for i, a in enumerate(n.args))
            rule = RULES.get(n.op)
            if rule is None:
                raise NotDifferentiable(f"no derivative rule for {n.op}", op=n.op)
            out = rule(n, parts)
        memo[n] = out
        return out

    return d(e)


def load_sites(e: Expr, floating: set[str]) -> tuple[Expr, ...]:
    """The distinct `load` nodes of floating tensors that e reads as values (not in a where's condition
    or another load's index): each is one element a gradient flows into, in order of appearance."""
    found: list[Expr] = []

    def visit(n: Expr) -> None:
        if n.op == "load":
            if n.attr in floating and n not in found:
                found.append(n)
            return  # its indices are integers
        skip = _NOT_DIFFERENTIATED.get(n.op, ())
        for i, a in enumerate(n.args):
            if i not in skip:
                visit(a)

    visit(e)
    return tuple(found)
