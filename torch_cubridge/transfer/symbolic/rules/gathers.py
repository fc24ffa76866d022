"""Rules for gathers: x[i0, i1, ...], index_select and embedding, where only inputs can be gathered
(a load through index expressions).
"""
from __future__ import annotations

from typing import Any

from ....errors import UnsupportedSpec
from ....ir.expr import Expr
from ..elementwise import broadcast
from ..sym import Sym
from .registry import Call, rule


def gather(c: Call, x: Sym, indices: list[Any]) -> Sym:
    """x[indices] with tensor indices (None: the whole dim), laid out as aten.index lays it out: the
    indices' broadcast dims in place of the indexed dims where those are adjacent, else first."""
    if x.kind != "value" or x.expr is None or x.expr.op != "load":
        raise UnsupportedSpec("indexing a computed tensor (only inputs can be gathered)", op=c.op)
    idx_syms = [None if i is None else c.walker.sym(i) for i in indices]
    used = [s for s in idx_syms if s is not None]
    axes, exprs = broadcast(c.ctx, used, c.op)
    it = iter(exprs)
    sub: dict[str, Expr] = {}
    rest: list[tuple[str, ...]] = []
    for i, d in enumerate(x.axes):
        s = idx_syms[i] if i < len(idx_syms) else None
        if s is None:
            rest.append(d)
        else:
            sub.update(c.ctx.decompose(next(it), d))
    y = c.ctx.subst(x, sub, c.op)
    first = next(i for i, s in enumerate(idx_syms) if s is not None)
    contiguous = all(s is not None for s in idx_syms[first:first + len(used)])
    out = rest[:first] + list(axes) + rest[first:] if contiguous else list(axes) + rest
    return Sym(tuple(out), y.expr, x.dtype)


@rule("index")
def index(c: Call) -> Sym:
    return gather(c, c.sym(0), list(c.args[1]))


@rule("index_select")
def index_select(c: Call) -> Sym:
    return gather(c, c.sym(0), [None] * (c.args[1] % len(c.sym(0).axes)) + [c.args[2]])


@rule("embedding")
def embedding(c: Call) -> Sym:
    return gather(c, c.sym(0), [c.args[1]])
