"""Softmax written out by hand, as patterns the elementwise rules try first.

An elementwise op on a piece of the normaliser (a row max, a shifted score, a row sum, a logsumexp,
the probabilities or the attention output) is a step of the softmax, not arithmetic: x - max(x) is a
shifted score, exp of that over its row sum is the softmax. Each pattern names the aten ops it applies
to and the kinds of operands it takes; the first that matches gives the value. A pattern that returns
None declines after a closer look, and the next is tried.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ....errors import UnsupportedSpec
from ..contract import unit_key_output
from ..elementwise import combine, lift_scalar
from ..sym import Sym
from .registry import Call


@dataclass(frozen=True)
class Pattern:
    names: tuple[str, ...]                         # the aten ops it applies to
    kinds: Callable[..., bool]                     # on the operands' kinds
    build: Callable[..., Sym | None]               # (call, *operands) -> the value, or None: not this one


def _logprobs(c: Call, x: Sym, lse: Sym) -> Sym:
    """x - logsumexp(x): log_softmax(x)."""
    if lse.payload["of"] is not x:
        raise UnsupportedSpec("subtracting the logsumexp of another tensor", op=c.op)
    return Sym(x.axes, None, x.dtype, "logprobs", {"of": x})


def _probs_first(x: Sym, y: Sym, kind: str = "probs") -> tuple[Sym, Sym]:
    return (x, y) if x.kind == kind else (y, x)


def _unit_key(c: Call, x: Sym, y: Sym) -> Sym | None:
    """P * v with one key (einsum at Skv = 1); None: a factor on the probabilities."""
    return unit_key_output(c.ctx, *_probs_first(x, y), c.op)


def _row_factor(c: Call, p: Sym, f: Sym) -> Sym:
    """P * f or P / f with f constant along the keys: f moves to the output."""
    if c.name == "div":
        f = combine(c.ctx, "div", [lift_scalar(1.0, c.dtype), f], c.dtype, c.op)
    return c.walker.row_scaled(p, f, c.op)


UNARY_PATTERNS: tuple[Pattern, ...] = (
    # exp(x - max x): the softmax's numerator
    Pattern(("exp",), lambda k: k == "shifted", lambda c, x: Sym(x.axes, None, x.dtype, "expshift", x.payload)),
    # exp(x - logsumexp(x)) is softmax(x)
    Pattern(("exp",), lambda k: k == "logprobs", lambda c, x: c.walker.softmax(x.payload["of"], -1, c.dtype, c.op)),
    # sigmoid(lse - c) = sum e^x / (sum e^x + e^c): a sink logit c
    Pattern(("sigmoid",), lambda k: k == "lse_minus", lambda c, x: Sym(x.axes, None, c.dtype, "sinkscale", x.payload)),
)

BINARY_PATTERNS: tuple[Pattern, ...] = (
    # x - max(x): the shifted score
    Pattern(("sub",), lambda a, b: a in ("value", "catsink") and b == "rowmax",
            lambda c, x, m: c.walker.shift(x, m, c.op)),
    Pattern(("sub",), lambda a, b: (a, b) == ("value", "rowlse"), _logprobs),
    # exp(x - max x) / its row sum: the softmax
    Pattern(("div",), lambda a, b: (a, b) == ("expshift", "rowsum"),
            lambda c, e, s: c.walker.manual_softmax(e, s, c.op)),
    # logsumexp(x) - c: a sink logit c, for the sigmoid above
    Pattern(("sub",), lambda a, b: (a, b) == ("rowlse", "value"), lambda c, lse, x: c.walker.lse_minus(lse, x, c.op)),
    # the output times sigmoid(lse - c): the sink joins the normaliser
    Pattern(("mul",), lambda a, b: {a, b} == {"attn", "sinkscale"},
            lambda c, x, y: c.walker.sink_from_scale(*_probs_first(x, y, "attn"), op=c.op)),
    Pattern(("mul",), lambda a, b: {a, b} == {"probs", "value"}, _unit_key),
    # the probabilities times a factor per query row
    Pattern(("mul", "div"), lambda a, b: (a, b) == ("probs", "value"), _row_factor),
    Pattern(("mul",), lambda a, b: (a, b) == ("value", "probs"), lambda c, f, p: c.walker.row_scaled(p, f, c.op)),
)


def match(patterns: tuple[Pattern, ...], c: Call, xs: list[Sym]) -> Sym | None:
    """The value of the first pattern that takes this call and these operands; None: no pattern does."""
    for p in patterns:
        if c.name in p.names and p.kinds(*(x.kind for x in xs)):
            out = p.build(c, *xs)
            if out is not None:
                return out
    return None
