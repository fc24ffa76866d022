"""Rules for the softmax and the reductions along its row: softmax, log_softmax, logsumexp, the row max
and the row sum. Each may only run over the key axis of a score (symbolic/normaliser.py checks that).
"""
from __future__ import annotations

from ..sym import Sym
from .registry import Call, no_rule, rule


@rule("_softmax", "softmax", "_safe_softmax")
def softmax(c: Call) -> Sym:
    return c.walker.softmax(c.sym(0), c.args[1], c.dtype, c.op)


@rule("_log_softmax")
def log_softmax(c: Call) -> Sym:
    x = c.sym(0)
    c.walker.softmax(x, c.args[1], c.dtype, c.op)  # the same checks: over the key axis of a score
    return Sym(x.axes, None, c.dtype, "logprobs", {"of": x})


@rule("logsumexp")
def logsumexp(c: Call) -> Sym:
    x = c.sym(0)
    m = c.walker.rowmax(x, c.args[1], c.op)
    return Sym(m.axes if c.opt(2, "keepdim", False) else m.axes[:-1], None, m.dtype, "rowlse", {"of": x})


@rule("amax", "max")
def row_max(c: Call) -> Sym | tuple[Sym, None]:
    """The row max over a dim; max over a dim also gives its indices, which the softmax never reads."""
    if len(c.args) < 2:  # the max of the whole tensor
        return no_rule(c)
    m = c.walker.rowmax(c.sym(0), c.args[1], c.op)
    return (m, None) if c.name == "max" else m


@rule("sum")
def row_sum(c: Call) -> Sym:
    if len(c.args) < 2:  # the sum of the whole tensor
        return no_rule(c)
    return c.walker.rowsum(c.sym(0), c.args[1], c.op)
