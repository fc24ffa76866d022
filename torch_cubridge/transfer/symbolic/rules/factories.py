"""Rules for tensors made from nothing but their shape and indices: constant fills, arange, triu/tril
and diag_embed (the masks and position tables a spec builds for itself).
"""
from __future__ import annotations

import torch

from ....errors import UnsupportedSpec
from ....ir.expr import Expr, call, const
from ..simplify import simplify
from ..sym import Sym
from .registry import Call, rule

FILLS = ("scalar_tensor", "full", "ones", "zeros", "full_like", "ones_like", "zeros_like",
         "new_ones", "new_zeros", "new_full", "empty", "empty_like")


def _fill_value(c: Call) -> object:
    name, a = c.name, c.args
    if name == "scalar_tensor":
        return a[0]
    if name in ("full", "new_full", "full_like"):
        return a[-1] if name != "full_like" else a[1]
    if name in ("ones", "ones_like", "new_ones"):
        return 1
    if name in ("zeros", "zeros_like", "new_zeros"):
        return 0
    raise UnsupportedSpec("uninitialised memory", op=c.op)


@rule(*FILLS)
def fill(c: Call) -> Sym:
    """A constant of the result's shape: a size-1 dim has no atom, as a broadcast operand's."""
    shape, dtype = c.node.meta["val"].shape, c.dtype
    fill = _fill_value(c)
    v = bool(fill) if dtype == torch.bool else (float(fill) if dtype.is_floating_point else int(fill))
    return Sym(tuple((c.ctx.atom(n),) if n > 1 else () for n in shape), const(v), dtype)


@rule("arange")
def arange(c: Call) -> Sym:
    a = list(c.args)
    start, end, step = (0, a[0], 1) if len(a) == 1 else (a + [1])[:3]
    at = c.ctx.atom(c.node.meta["val"].shape[0])
    e: Expr = Expr("var", (), at)
    if step != 1:
        e = call("mul", e, const(step))
    if start:
        e = call("add", e, const(start))
    if c.dtype.is_floating_point:
        e = call("to_float", e)
    return Sym(((at,),), e, c.dtype)


def _zero(dtype: torch.dtype) -> Expr:
    return const(False) if dtype == torch.bool else const(0 if not dtype.is_floating_point else 0.0)


@rule("triu", "tril")
def tri(c: Call) -> Sym:
    """x kept on one side of diagonal `diagonal` of its last two dims, 0 on the other."""
    x, diag = c.sym(0), c.opt(1, "diagonal", 0)
    off = call("sub", c.ctx.linear(x.axes[-1]), c.ctx.linear(x.axes[-2]))  # column - row
    keep = call("ge", off, const(diag)) if c.name == "triu" else call("le", off, const(diag))
    return Sym(x.axes, simplify(call("where", keep, x.expr, _zero(c.dtype)), c.ctx.ranges()), c.dtype)


@rule("diag_embed")
def diag_embed(c: Call) -> Sym:
    """torch.diag(x) of a vector: out[..., i, j] = x[..., i] where j == i, else 0 (the last two dims)."""
    x = c.sym(0)
    offset, dim1, dim2 = (list(c.args[1:]) + [c.kw.get("offset", 0), c.kw.get("dim1", -2), c.kw.get("dim2", -1)])[:3]
    if (dim1, dim2) not in ((-2, -1), (len(x.axes) - 1, len(x.axes))) or not x.axes:
        raise UnsupportedSpec("diag_embed into other than the last two dims", op=c.op)
    row = x.axes[-1]
    col = c.ctx.atom(c.ctx.dim_size(row) + abs(offset))
    if offset:  # the output is larger than x: its rows need their own atom too
        raise UnsupportedSpec("diag_embed with an offset", op=c.op)
    on = call("eq", Expr("var", (), col), c.ctx.linear(row))
    return Sym(x.axes + ((col,),), simplify(call("where", on, x.expr, _zero(c.dtype)), c.ctx.ranges()), c.dtype)
