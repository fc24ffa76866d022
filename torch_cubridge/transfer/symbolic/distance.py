"""Values of the spec that depend on the positions only through kv - q (T5's buckets, a bias of the
distance), left to the prologue: computed over the Sq + Skv - 1 distances instead of the Sq x Skv grid.

A node qualifies when one value it reads is `col - row` (or `row - col`) of its two axes, and every op
from there to the node treats each element alone: pointwise ops with scalar operands, a gather whose
indices come from that value. Replaying those ops on a vector of distances gives a table whose entry
col - row + Sq - 1 is the grid's entry (row, col): the prologue stores 2S - 1 values where the grid
held S^2, and the kernel reads one of them per score.
"""
from __future__ import annotations

import torch
from torch.fx import Node

from ...ir.expr import Expr, call, const
from .sym import Sym, packet_name

# Besides the ops torch tags pointwise: ops that compute each element of the result from the same
# element of their inputs without the tag (casts, *_like, where, comparisons, division)
_ELEMENTWISE = {
    "_to_copy", "to", "full_like", "zeros_like", "ones_like", "where", "gt", "lt", "ge", "le", "eq", "ne",
    "div", "true_divide", "floor_divide", "remainder", "fmod", "alias", "lift_fresh_copy", "detach",
    "scalar_tensor", "clone",
}


def difference(s: Sym) -> int:
    """+1 where `s` is col - row of its two axes, -1 where it is row - col, 0 otherwise."""
    e = s.expr
    if s.kind != "value" or e is None or len(s.axes) != 2 or any(len(a) != 1 for a in s.axes):
        return 0
    if e.op != "sub" or len(e.args) != 2 or any(a.op != "var" for a in e.args):
        return 0
    (row,), (col,) = s.axes
    got = (e.args[0].attr, e.args[1].attr)
    return 1 if got == (col, row) else -1 if got == (row, col) else 0


def _scalar(x: object) -> bool:
    v = x.meta.get("val") if isinstance(x, Node) else x
    return not isinstance(v, torch.Tensor) or v.dim() == 0


def _elementwise(n: Node, fed: set[Node]) -> bool:
    """n computes each element from the same element of its inputs in `fed`: the others are scalars,
    or the table a gather reads through them."""
    name = packet_name(n)
    if name in _ELEMENTWISE or torch.Tag.pointwise in getattr(n.target, "tags", ()):
        return all(a in fed or _scalar(a) for a in n.all_input_nodes)
    if name == "index":  # table[idx]: one index, on the table's first dim
        table, idx = n.args[0], n.args[1]
        return table not in fed and len(idx) == 1 and idx[0] in fed
    if name == "embedding":
        return n.args[0] not in fed and n.args[1] in fed
    return False


def distance_chain(node: Node, cone: list[Node], env: dict) -> tuple[Node, int, list[Node]] | None:
    """(the kv - q node, its sign, the nodes from it to `node` in graph order) where `node` is a
    function of the distance alone; None otherwise."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() < 2:
        return None
    for diff in reversed(cone):
        s = env.get(diff)
        sign = difference(s) if isinstance(s, Sym) else 0
        if not sign or tuple(val.shape[:2]) != tuple(diff.meta["val"].shape):
            continue
        fed, chain = {diff}, []
        for n in cone[cone.index(diff) + 1:]:
            if not any(a in fed for a in n.all_input_nodes):
                continue
            if not _elementwise(n, fed):
                break
            fed.add(n)
            chain.append(n)
        else:
            if chain and chain[-1] is node:
                return diff, sign, chain
    return None


def index_of(s: Sym, sq: int) -> Expr:
    """Where the table holds the grid's (row, col): col - row + Sq - 1."""
    (row,), (col,) = s.axes  # atoms: Expr("var") directly (ir.expr.var takes role names only)
    return call("add", call("sub", Expr("var", (), col), Expr("var", (), row)), const(sq - 1))
