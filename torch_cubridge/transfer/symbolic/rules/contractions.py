"""Rules for matrix products: the first matmul of two call tensors is taken for q.k, the next for P.v
(symbolic/contract.py gives the roles); baddbmm and addmm add a scaled base to a scaled product.
"""
from __future__ import annotations

from ....errors import UnsupportedSpec
from ..contract import contract
from ..sym import Sym
from .registry import Call, rule


def score_candidate(c: Call) -> None:
    """Refuse the matmul as q.k where it cannot be (may_be_score), so that the prologue takes it; a
    walk that took the wrong matmul for q.k is run again without it (symbolic_backend)."""
    w = c.walker
    if "score" in c.ctx.facts:
        return
    if not w.may_be_score(c.node):
        raise UnsupportedSpec("a matmul of values off the score path", op=c.op)
    w.score_node = c.node.name
    if w.held_operand and w.prologue is not None:
        w.make_held_operand(c.node)


def _product(c: Call, a: int, b: int) -> Sym:
    """args[a] @ args[b], its operands first made by the prologue where they are gathered through data."""
    score_candidate(c)
    if c.walker.prologue is not None:
        c.walker.make_gathered_operands(c.node)
    return contract(c.ctx, c.sym(a), c.sym(b), c.op)


@rule("bmm", "mm", "matmul")
def matmul(c: Call) -> Sym:
    return _product(c, 0, 1)


@rule("baddbmm", "addmm")
def add_matmul(c: Call) -> Sym:
    """beta * input + alpha * (b1 @ b2)"""
    prod = _product(c, 1, 2)
    alpha, beta = c.kw.get("alpha", 1), c.kw.get("beta", 1)
    if alpha != 1:
        prod = c.combine("mul", [prod, c.scalar(alpha)])
    if beta == 0:
        return prod
    base = c.sym(0)
    if beta != 1:
        base = c.combine("mul", [base, c.scalar(beta)])
    return c.combine("add", [prod, base])
