"""Algebraic simplification of index arithmetic, with ranges of the index atoms.

Reshapes and head grouping produce index expressions such as
`(h // 4) * 4 + h % 4`; these rules fold them back to `h` so the layout
checks see plain variables.
"""
from __future__ import annotations

import math
import operator
from typing import Mapping

from ...ir.expr import Expr, call, const, rewrite
from ...ir.interval import Interval, interval

_FOLD = {"add": operator.add, "sub": operator.sub, "mul": operator.mul, "floordiv": operator.floordiv,
         "mod": operator.mod, "max": max, "min": min}


_NEGATE = {"lt": "ge", "ge": "lt", "le": "gt", "gt": "le", "eq": "ne", "ne": "eq"}


def _is_c(e: Expr, v: float | None = None) -> bool:
    return e.op == "const" and not isinstance(e.attr, bool) and (v is None or e.attr == v)


def simplify(e: Expr, ranges: Mapping[str, Interval]) -> Expr:
    def rule(n: Expr) -> Expr | None:
        a = n.args
        if n.op in _FOLD and all(_is_c(x) for x in a):
            try:
                return const(_FOLD[n.op](a[0].attr, a[1].attr))
            except ZeroDivisionError:
                return None
        if n.op == "not" and a[0].op == "not":
            return a[0].args[0]
        if n.op == "not" and a[0].op in _NEGATE:
            return call(_NEGATE[a[0].op], *a[0].args)
        if n.op == "not" and a[0].op == "const" and isinstance(a[0].attr, bool):
            return const(not a[0].attr)
        if n.op == "where" and a[1].op == "const" and a[2].op == "const" and isinstance(a[1].attr, bool) \
                and isinstance(a[2].attr, bool):
            if a[1].attr and not a[2].attr:
                return a[0]
            if a[2].attr and not a[1].attr:
                return call("not", a[0])
        if n.op == "where" and a[0].op == "const":
            return a[1] if a[0].attr else a[2]
        if n.op in ("and", "or") and any(x.op == "const" and isinstance(x.attr, bool) for x in a):
            c, other = (a[0], a[1]) if a[0].op == "const" else (a[1], a[0])
            if n.op == "and":
                return other if c.attr else const(False)
            return const(True) if c.attr else other
        if n.op == "to_bool" and a[0].op in ("eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not"):
            return a[0]
        if n.op == "neg" and _is_c(a[0]):
            return const(-a[0].attr)
        if n.op == "add":
            if _is_c(a[0], 0) and isinstance(a[0].attr, int):
                return a[1]
            if _is_c(a[1], 0) and isinstance(a[1].attr, int):
                return a[0]
            # (x // n) * n + x % n -> x
            x, y = a
            for p, r in ((x, y), (y, x)):
                if (p.op == "mul" and p.args[0].op == "floordiv" and r.op == "mod" and _is_c(p.args[1])
                        and p.args[0].args[0] == r.args[0] and p.args[0].args[1] == r.args[1] == p.args[1]):
                    return r.args[0]
        if n.op == "sub" and _is_c(a[1], 0) and isinstance(a[1].attr, int):
            return a[0]
        if n.op == "mul":
            for p, r in ((a[0], a[1]), (a[1], a[0])):
                if _is_c(p, 1) and isinstance(p.attr, int):
                    return r
        if n.op in ("floordiv", "mod") and _is_c(a[1]) and isinstance(a[1].attr, int) and a[1].attr > 0:
            d = a[1].attr
            if d == 1:
                return a[0] if n.op == "floordiv" else const(0)
            lo, hi = interval(a[0], ranges)
            if 0 <= lo and hi < d:
                return const(0) if n.op == "floordiv" else a[0]
            x = a[0]
            if x.op == "add":  # (u * d + w) with 0 <= w < d
                for p, w in ((x.args[0], x.args[1]), (x.args[1], x.args[0])):
                    if p.op == "mul" and _is_c(p.args[1], d):
                        wl, wh = interval(w, ranges)
                        if 0 <= wl and wh < d:
                            return p.args[0] if n.op == "floordiv" else w
            if x.op == "mul" and _is_c(x.args[1], d):
                return x.args[0] if n.op == "floordiv" else const(0)
        return None

    prev = None
    while prev != e:
        prev, e = e, rewrite(e, rule)
    return e


def finite(v: float) -> bool:
    return not (math.isinf(v) or math.isnan(v))
