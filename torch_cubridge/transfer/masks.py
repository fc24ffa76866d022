"""Pass: split the score expression into score and mask predicate.

Fills of -inf, or of a large negative (<= -1e4, where exp underflows in
fp32), by select, masked_fill or addition, become a predicate; everything
else stays in the score, computed exactly. Only fills at the top of the
score (or under monotone steps that keep -inf at -inf) are masks.
"""
from __future__ import annotations

import math

from ..ir.expr import Expr, call, const, walk

BIG_NEG = -1e4
HUGE_NEG = -1e30


def _fill(e: Expr) -> float | None:
    if e.op == "const" and isinstance(e.attr, (int, float)) and not isinstance(e.attr, bool) and e.attr <= BIG_NEG:
        return float(e.attr)
    if e.op == "to_float":
        return _fill(e.args[0])
    return None


def _has_s(e: Expr) -> bool:
    return any(n.op == "var" and n.attr == "s" for n in walk(e))


def _and(a: Expr | None, b: Expr) -> Expr:
    return b if a is None else call("and", a, b)


def extract_mask(score: Expr) -> tuple[Expr, Expr | None, str]:
    """Returns (score, mask, empty_rows)."""
    preds: list[tuple[Expr, float, str]] = []  # (keep, fill, how)

    def peel(e: Expr) -> Expr:
        if e.op == "where" and _has_s(e):
            c, x, y = e.args
            fy, fx = _fill(y), _fill(x)
            if fy is not None and _has_s(x) and not _has_s(c):
                preds.append((c, fy, "select"))
                return peel(x)
            if fx is not None and _has_s(y) and not _has_s(c):
                preds.append((call("not", c), fx, "select"))
                return peel(y)
        if e.op in ("add", "sub"):
            for i in (0, 1):
                t, other = e.args[i], e.args[1 - i]
                if e.op == "sub" and i == 0:
                    continue  # a - where(...) flips the sign
                if t.op == "where" and not _has_s(t) and _has_s(other):
                    c, x, y = t.args
                    for keep, zero, fill in ((c, x, y), (call("not", c), y, x)):
                        f = _fill(fill)
                        if (zero == const(0.0) or zero == const(0)) and f is not None \
                                and (f == -math.inf or f <= HUGE_NEG):
                            preds.append((keep, f, "add"))
                            return peel(other)
            # a monotone step keeps an -inf fill at -inf: x + finite
            inner = e.args[0]
            if inner.op == "where" and not _has_s(e.args[1]):
                n_before = len(preds)
                peeled = peel(inner)
                if peeled is not inner and all(p[1] == -math.inf for p in preds[n_before:]):
                    return call(e.op, peeled, e.args[1])
                # a finite fill plus a finite term is not a mask: the term can lift the filled keys level
                # with the kept ones (a padding fill added to a causal fill), so both stay in the score
                del preds[n_before:]
        if e.op in ("mul", "div") and e.args[1].op == "const" and isinstance(e.args[1].attr, (int, float)) \
                and e.args[1].attr > 0 and e.args[0].op == "where":
            n_before = len(preds)
            peeled = peel(e.args[0])
            if peeled is not e.args[0] and all(p[1] == -math.inf for p in preds[n_before:]):
                return call(e.op, peeled, e.args[1])
            del preds[n_before:]
        return e

    body = peel(score)
    if not preds:
        return score, None, "zero"
    fills = {p[1] for p in preds}
    if len(fills) > 1 and -math.inf in fills:
        # mixed fills: keep the finite ones exact in the score, mask only the -inf ones
        keep_exact = [p for p in preds if p[1] != -math.inf]
        for c, f, _ in reversed(keep_exact):
            body = call("where", c, body, const(f))
        preds = [p for p in preds if p[1] == -math.inf]
        fills = {-math.inf}
    if len(fills) > 1:
        return score, None, "zero"  # different finite fills: no exact predicate, stay exact
    mask: Expr | None = None
    for c, _, _ in preds:
        mask = _and(mask, c)
    empty = "zero" if fills == {-math.inf} else "mean_v"
    return body, mask, empty
