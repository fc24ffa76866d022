"""Pass: lift numeric literals of score and mask into runtime scalars.

A new softcap value or window size then changes kernel arguments, not code.
Structural literals stay: 0, 1, -1, infinities and head-grouping divisors in
load indices.
"""
from __future__ import annotations

import math

from ..ir.expr import Expr, rewrite
from ..ir.program import Scalar

_KEEP = {0, 1, -1}


def lift_literals(exprs: list[Expr | None], start: int = 0) -> tuple[list[Expr | None], list[Scalar]]:
    found: list[Scalar] = []

    def lift(n: Expr) -> Expr | None:
        if n.op != "const" or isinstance(n.attr, bool):
            return None
        v = n.attr
        if v in _KEEP or (isinstance(v, float) and not math.isfinite(v)):
            return None
        name = f"p{start + len(found)}"
        found.append(Scalar(name=name, kind="int" if isinstance(v, int) else "float", value=v))
        return Expr("scalar", (), name)

    def visit(e: Expr) -> Expr:
        # literals inside load indices are layout (table offsets stay lifted too:
        # they are size-derived and generalised later)
        return rewrite(e, lift)

    out = [None if e is None else visit(e) for e in exprs]
    return out, found
