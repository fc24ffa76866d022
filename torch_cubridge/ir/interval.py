"""Interval analysis over CuIR expressions: the basis of block classification.

`interval(e, env)` bounds an expression over boxes of index values. Booleans
are intervals over {0, 1}: (1, 1) always true, (0, 0) always false. Loads are
data, hence unbounded; a mask that reads them needs the runtime pre-pass.
"""
from __future__ import annotations

import math
from typing import Mapping

from .expr import Expr

Interval = tuple[float, float]
UNKNOWN: Interval = (-math.inf, math.inf)
BOOL_UNKNOWN: Interval = (0.0, 1.0)
_BOOL_OPS = {"eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not", "to_bool"}


def _floor(x: float) -> float:
    """floor that keeps an unbounded end unbounded (math.floor(inf) raises)."""
    return x if math.isinf(x) else float(math.floor(x))


def _trunc(x: float) -> float:
    return x if math.isinf(x) else float(math.trunc(x))


def _mul(a: Interval, b: Interval) -> Interval:
    prods = [x * y for x in a for y in b if not (math.isinf(x) and y == 0 or math.isinf(y) and x == 0)]
    return (min(prods), max(prods)) if prods else UNKNOWN


def interval(e: Expr, env: Mapping[str, Interval]) -> Interval:
    op, a = e.op, e.args
    if op == "const":
        v = float(e.attr)
        return (v, v)
    if op in ("var", "scalar"):
        return env.get(e.attr, UNKNOWN)
    if op == "load":
        return UNKNOWN
    if op == "where":
        c = interval(a[0], env)
        if c == (1.0, 1.0):
            return interval(a[1], env)
        if c == (0.0, 0.0):
            return interval(a[2], env)
        x, y = interval(a[1], env), interval(a[2], env)
        return (min(x[0], y[0]), max(x[1], y[1]))
    xs = [interval(x, env) for x in a]
    if op in ("neg",):
        return (-xs[0][1], -xs[0][0])
    if op == "not":
        return (1 - xs[0][1], 1 - xs[0][0])
    if op in ("tanh", "exp", "sigmoid", "floor", "to_float", "to_int", "sqrt", "log", "exp2", "log2",
              "log1p", "expm1", "sign"):  # monotone non-decreasing: the ends map to the ends
        f = {"tanh": math.tanh, "exp": _exp, "sigmoid": _sigmoid, "floor": _floor,
             "to_float": float, "to_int": _trunc, "sqrt": _sqrt, "log": _log, "exp2": _exp2,
             "log2": lambda v: _log(v) / math.log(2) if v > 0 else -math.inf,
             "log1p": lambda v: _log(1 + v), "expm1": lambda v: _exp(v) - 1,
             "sign": lambda v: float((v > 0) - (v < 0))}[op]
        return (f(xs[0][0]), f(xs[0][1]))
    if op in ("sin", "cos"):
        return (-1.0, 1.0)
    if op == "reciprocal":
        lo, hi = xs[0]
        return (1 / hi, 1 / lo) if lo > 0 or hi < 0 else UNKNOWN
    if op == "to_bool":
        lo, hi = xs[0]
        if lo > 0 or hi < 0:
            return (1.0, 1.0)
        return (0.0, 0.0) if lo == hi == 0 else BOOL_UNKNOWN
    if op == "abs":
        lo, hi = xs[0]
        if lo >= 0:
            return (lo, hi)
        if hi <= 0:
            return (-hi, -lo)
        return (0.0, max(-lo, hi))
    x, y = xs[0], xs[1] if len(xs) > 1 else None
    if op == "add":
        return (x[0] + y[0], x[1] + y[1])
    if op == "sub":
        return (x[0] - y[1], x[1] - y[0])
    if op == "mul":
        return _mul(x, y)
    if op == "div":
        if y[0] > 0 or y[1] < 0:
            return _mul(x, (1 / y[1], 1 / y[0]))
        return UNKNOWN
    if op == "floordiv":
        if y[0] == y[1] and y[0] > 0:
            return (_floor(x[0] / y[0]), _floor(x[1] / y[0]))
        return UNKNOWN
    if op == "mod":
        if y[0] == y[1] and y[0] > 0 and not math.isinf(x[0]) and not math.isinf(x[1]):
            m = y[0]
            if math.floor(x[0] / m) == math.floor(x[1] / m):
                return (x[0] % m, x[1] % m)
            return (0.0, m - 1)
        return UNKNOWN
    if op == "max":
        return (max(x[0], y[0]), max(x[1], y[1]))
    if op == "min":
        return (min(x[0], y[0]), min(x[1], y[1]))
    if op in ("lt", "le", "gt", "ge"):
        if op in ("gt", "ge"):
            x, y, op = y, x, {"gt": "lt", "ge": "le"}[op]
        if (x[1] < y[0]) if op == "lt" else (x[1] <= y[0]):
            return (1.0, 1.0)
        if (x[0] >= y[1]) if op == "lt" else (x[0] > y[1]):
            return (0.0, 0.0)
        return BOOL_UNKNOWN
    if op in ("eq", "ne"):
        if x[0] == x[1] == y[0] == y[1]:
            r = (1.0, 1.0)
        elif x[1] < y[0] or y[1] < x[0]:
            r = (0.0, 0.0)
        else:
            return BOOL_UNKNOWN
        return r if op == "eq" else (1 - r[1], 1 - r[0])
    if op == "and":
        return (min(x[0], y[0]), min(x[1], y[1]))
    if op == "or":
        return (max(x[0], y[0]), max(x[1], y[1]))
    return UNKNOWN


def _exp(v: float) -> float:
    try:
        return math.exp(v)
    except OverflowError:
        return math.inf


def _exp2(v: float) -> float:
    try:
        return 2.0 ** v
    except OverflowError:
        return math.inf


def _sigmoid(v: float) -> float:
    return 1 / (1 + _exp(-v))


def _sqrt(v: float) -> float:
    return math.sqrt(v) if v >= 0 else 0.0


def _log(v: float) -> float:
    return math.log(v) if v > 0 else -math.inf


def classify_tile(mask: Expr, env: Mapping[str, Interval]) -> int:
    """0 empty, 1 partial, 2 full: the same classes as the kernel's block_class hook."""
    lo, hi = interval(mask, env)
    if hi <= 0:
        return 0
    if lo >= 1:
        return 2
    return 1
