"""Rules for elementwise ops: copies and casts, unary and binary arithmetic, where, masked_fill, clamp,
nan_to_num. Values combine by broadcasting (symbolic/elementwise.py); the softmax written out by hand is
matched first (by_hand.py).
"""
from __future__ import annotations

from typing import Any

import torch

from ....errors import UnsupportedSpec
from ..elementwise import BINARY, UNARY, cast
from ..sym import Sym
from .by_hand import BINARY_PATTERNS, UNARY_PATTERNS, match
from .registry import Call, rule

# ops that copy or cast their first argument and change no value
COPIES = ("clone", "contiguous", "alias", "detach", "lift_fresh_copy", "lift_fresh", "_to_copy", "to", "type_as")


@rule(*COPIES)
def copy(c: Call) -> Sym:
    return cast(c.sym(0), c.dtype)


@rule("dropout")
def dropout(c: Call) -> Sym:
    """dropout(x, p, train): x itself in eval mode."""
    x, a = c.sym(0), c.args
    if len(a) > 2 and a[2] and a[1] > 0:
        raise UnsupportedSpec("dropout in training mode is random", op=c.op)
    return cast(x, c.dtype)


@rule("clamp")
def clamp(c: Call) -> Sym:
    """clamp(x, min, max): each bound a number or a tensor (clamp.Tensor: Swin V2's logit scale)."""
    x = c.sym(0)
    lo, hi = c.opt(1, "min"), c.opt(2, "max")
    if lo is not None:
        x = c.combine("max", [x, c.walker.sym(lo)])
    if hi is not None:
        x = c.combine("min", [x, c.walker.sym(hi)])
    return x


@rule(*UNARY)
def unary(c: Call) -> Sym:
    x = c.sym(0)
    return match(UNARY_PATTERNS, c, [x]) or c.combine(UNARY[c.name], [x])


@rule(*BINARY)
def binary(c: Call) -> Sym:
    xs = [c.walker.sym(x) for x in c.args[:2]]
    if c.name == "div" and c.kw.get("rounding_mode") == "floor":
        return c.combine("floordiv", xs)
    if c.name == "div" and c.kw.get("rounding_mode") == "trunc":
        raise UnsupportedSpec("truncating division", op=c.op)
    alpha = c.kw.get("alpha", c.args[2] if len(c.args) > 2 else 1)
    if c.name in ("add", "sub") and alpha != 1:  # add(x, y, alpha=a) is x + a * y
        xs[1] = c.combine("mul", [xs[1], c.scalar(alpha)], xs[1].dtype)
    return match(BINARY_PATTERNS, c, xs) or c.combine(BINARY[c.name], xs)


def _is_zero(x: Sym) -> bool:
    """A literal zero (a masked_fill or where filling with 0)."""
    return x.kind == "value" and x.expr is not None and x.expr.op == "const" and x.expr.attr == 0


@rule("where")
def where(c: Call) -> Sym:
    cond, x, y = (c.sym(i) for i in range(3))
    if {x.kind, y.kind} == {"probs", "value"} and _is_zero(x if y.kind == "probs" else y):
        # probabilities zeroed where cond fails: a factor per query row
        keep = cond if x.kind == "probs" else c.combine("not", [cond], torch.bool)
        return c.walker.row_scaled(x if x.kind == "probs" else y, cast(keep, c.dtype), c.op)
    return c.combine("where", [cond, x, y])


@rule("masked_fill")
def masked_fill(c: Call) -> Sym:
    x, m, v = c.sym(0), c.sym(1), c.sym(2)
    if x.kind == "probs" and _is_zero(v):  # rows of probabilities zeroed (Longformer's padded queries)
        return c.walker.row_scaled(x, cast(c.combine("not", [m], torch.bool), c.dtype), c.op)
    return c.combine("where", [m, v, x])


@rule("nan_to_num")
def nan_to_num(c: Call) -> Sym:
    """NaN to `nan` (0), +-inf to `posinf`/`neginf` (the dtype's largest finite values), given
    positionally or by keyword."""
    fills: dict[str, Any] = {**dict(zip(("nan", "posinf", "neginf"), c.args[1:])), **c.kw}
    x, dtype = c.sym(0), c.dtype
    big = torch.finfo(dtype).max if dtype.is_floating_point else 0

    def put(hit: Sym, val: Any, x: Sym) -> Sym:
        return c.combine("where", [hit, c.scalar(val), x])
    nan = fills.get("nan")
    x = put(c.combine("ne", [x, x], torch.bool), 0.0 if nan is None else nan, x)  # only NaN != NaN
    for inf, fill, default in ((float("inf"), fills.get("posinf"), big), (float("-inf"), fills.get("neginf"), -big)):
        x = put(c.combine("eq", [x, c.scalar(inf)], torch.bool), default if fill is None else fill, x)
    return x


@rule("log_sigmoid_forward")
def log_sigmoid(c: Call) -> tuple[Sym, None]:
    """min(x, 0) - log(1 + exp(-|x|)), stable for any x (and the op's unused buffer)."""
    x = c.sym(0)
    neg_abs = c.combine("neg", [c.combine("abs", [x])])
    soft = c.combine("log", [c.combine("add", [c.scalar(1.0), c.combine("exp", [neg_abs])])])
    return c.combine("sub", [c.combine("min", [x, c.scalar(0.0)]), soft]), None
