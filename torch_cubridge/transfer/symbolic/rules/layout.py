"""Rules for views and layout: reshape, permute, transpose, (un)squeeze, expand, repeat, slice, select, cat.

A view changes which atoms index a tensor, never its values (symbolic/views.py does the algebra).
"""
from __future__ import annotations

from .. import views
from ..sym import Sym
from .registry import Call, rule


@rule("view", "reshape", "_unsafe_view")
def reshape(c: Call) -> Sym:
    return views.reshape(c.ctx, c.sym(0), list(c.args[1]), c.op)


@rule("permute")
def permute(c: Call) -> Sym:
    return views.permute(c.sym(0), list(c.args[1]))


@rule("transpose")
def transpose(c: Call) -> Sym:
    return views.transpose(c.sym(0), c.args[1], c.args[2])


@rule("t")
def t(c: Call) -> Sym:
    return views.transpose(c.sym(0), 0, 1)


@rule("unsqueeze")
def unsqueeze(c: Call) -> Sym:
    return views.unsqueeze(c.sym(0), c.args[1])


@rule("squeeze")
def squeeze(c: Call) -> Sym:
    a = c.args
    dims = None if len(a) < 2 else ([a[1]] if isinstance(a[1], int) else list(a[1]))
    return views.squeeze(c.ctx, c.sym(0), dims, c.op)


@rule("expand", "broadcast_to")
def expand(c: Call) -> Sym:
    return views.expand(c.ctx, c.sym(0), list(c.args[1]), c.op)


@rule("repeat")
def repeat(c: Call) -> Sym:
    return views.repeat(c.ctx, c.sym(0), list(c.args[1]), c.op)


@rule("slice")
def slice_(c: Call) -> Sym:
    a = c.args
    x = c.sym(0)
    dim, start, end, step = (list(a[1:]) + [0, None, None, 1][len(a) - 1:])[:4]
    if x.kind == "probs" and x.payload.get("sink_col"):  # the sink's extra score column cut off again
        return c.walker.drop_sink_column(x, dim, start, end, c.op)
    return views.slice_(c.ctx, x, dim, start, end, step or 1, c.op)


@rule("select")
def select(c: Call) -> Sym:
    return views.select(c.ctx, c.sym(0), c.args[1], c.args[2], c.op)


@rule("cat")
def cat(c: Call) -> Sym:
    """Only a sink logit joined to the scores as an extra key column (the normaliser's)."""
    return c.walker.cat([c.walker.sym(x) for x in c.args[0]], c.opt(1, "dim", 0), c.op)
