"""Contractions: the q.k score matmul and the P.v output matmul.

A contraction of two loaded inputs over their last dim is the score; it
gives the atoms their roles. A contraction of softmax probabilities with a
loaded input over the key axis is the output.
"""
from __future__ import annotations

from ...errors import SplitLayoutRefused, UnsupportedSpec
from ...ir.expr import Expr, call, const, walk
from .elementwise import broadcast
from .simplify import simplify
from .sym import Ctx, Sym, unify


def _factor(e: Expr, over: str) -> tuple[Expr, Expr]:
    """Split e into (coefficient, the one load that reads `over`)."""
    factors: list[Expr] = []

    def flat(x: Expr) -> None:
        if x.op == "mul":
            flat(x.args[0])
            flat(x.args[1])
        elif x.op == "div":  # q / sqrt(d): a coefficient 1 / c (a c that reads `over` is refused below)
            flat(x.args[0])
            factors.append(call("div", const(1.0), x.args[1]))
        elif x.op in ("to_float",):
            flat(x.args[0])
        else:
            factors.append(x)

    flat(e)
    reads = [f for f in factors if any(n.op == "var" and n.attr == over for n in walk(f))]
    if len(reads) != 1 or reads[0].op != "load":
        raise UnsupportedSpec("a matmul operand is not a (scaled) input tensor")
    coef: Expr | None = None
    for f in factors:
        if f is not reads[0]:
            coef = f if coef is None else call("mul", coef, f)
    return (coef if coef is not None else const(1.0)), reads[0]


def packs_axes(ld: Expr) -> bool:
    """A load with two axes packed in one index (h * D + d: heads with the head dim); a head map h // g
    reads one axis and does not count."""
    return any(ix.op not in ("var", "const") and len({x.attr for x in walk(ix) if x.op == "var"}) > 1
               for ix in ld.args)


def _factor_or_split(ctx: Ctx, e: Expr, over: str) -> tuple[Expr, Expr]:
    """_factor; where it fails on a tensor the prologue made that packs two axes in one dim (a fused
    qkv projection [B*S, 3*H*D] read as q), the walk is retried with that tensor's split view made by
    the prologue (symbolic_backend: SplitLayoutRefused)."""
    try:
        return _factor(e, over)
    except UnsupportedSpec:
        made = ctx.facts.get("prologue", {})
        for n in walk(e):
            if n.op == "load" and n.attr in made and packs_axes(n):
                raise SplitLayoutRefused("a matmul operand packs dims the spec splits apart", op="matmul",
                                         input=n.attr) from None
        raise


def _operands(ctx: Ctx, a: Sym, b: Sym, op: str) -> tuple[tuple, tuple, tuple, Expr, Expr]:
    """Align batch dims and the contracted dim; returns (batch, m, n, a_expr, b_expr)."""
    if len(a.axes) != len(b.axes) or len(a.axes) not in (2, 3):
        raise UnsupportedSpec("matmul operands of unexpected rank", op=op)
    sub: dict[str, Expr] = {}
    if len(a.axes) == 3:
        sub.update(unify(ctx, a.axes[0], b.axes[0], op))
    sub.update(unify(ctx, a.axes[-1], b.axes[-2], op))
    b2 = ctx.subst(b, sub, op) if b.kind == "value" else b
    batch = a.axes[:-2]
    return batch, a.axes[-2], b.axes[-1], a.expr, b2.expr


def contract(ctx: Ctx, a: Sym, b: Sym, op: str) -> Sym:
    if a.kind == "value" and b.kind == "value" and "score" not in ctx.facts:
        return _score(ctx, a, b, op)
    if a.kind == "probs" and b.kind == "value" and "output" not in ctx.facts:
        return _output(ctx, a, b, op)
    raise UnsupportedSpec("a matmul that is neither q.k nor softmax(...).v", op=op)


def _single(d: tuple[str, ...], what: str, op: str) -> str:
    if len(d) != 1:
        raise UnsupportedSpec(f"the {what} axis is merged with another axis", op=op)
    return d[0]


def _query_atom(ctx: Ctx, m: tuple[str, ...], op: str) -> str:
    """The query atom of q.k's row dim. einsum and matmul fold batch-like axes of q alone into the rows
    (MQA's "bhid,bjd->bhij" multiplies [b, h*i, d] by [b, d, j]); the query is the innermost, the rest
    are batch axes. A unit atom there is ambiguous (a size-1 head and a size-1 query read alike), so a
    merged row dim takes atoms of size > 1 only."""
    if len(m) == 1:
        return m[0]
    if len(m) == 0 or any(ctx.sizes[x] == 1 for x in m):
        raise UnsupportedSpec("the query axis is merged with another axis", op=op)
    return m[-1]


def _score(ctx: Ctx, a: Sym, b: Sym, op: str) -> Sym:
    batch, m, n, ea, eb = _operands(ctx, a, b, op)
    k = a.axes[-1]
    kd = _single(k, "head-dim", op)
    ca, la = _factor_or_split(ctx, ea, kd)
    cb, lb = _factor_or_split(ctx, eb, kd)
    if la.attr == lb.attr:
        if la.attr in ctx.facts.get("prologue", {}):  # slices of one made tensor (a fused qkv): each made apart
            raise SplitLayoutRefused("q and k are slices of one tensor", op=op, input=la.attr)
        raise UnsupportedSpec("q and k are the same tensor", op=op)
    qa, kva = _query_atom(ctx, m, op), _single(n, "key", op)
    ctx.roles.update({qa: "q", kva: "kv", kd: "d"})
    batch_atoms = [x for d in batch for x in d] + [x for x in m if x != qa]
    ctx.facts["score"] = {"q": la, "k": lb, "batch": batch_atoms}
    coef = simplify(call("mul", ca, cb), ctx.ranges())
    s = Expr("var", (), "s")
    e = s if coef == const(1.0) else call("mul", s, coef)
    # batch roles are fixed later, from the query's own dim order
    for x in batch_atoms:
        ctx.roles.setdefault(x, "batch")
    return Sym(tuple(batch) + (m, n), e, a.dtype if a.dtype.is_floating_point else b.dtype)


def _output(ctx: Ctx, p: Sym, v: Sym, op: str) -> Sym:
    if len(p.axes) != len(v.axes):
        raise UnsupportedSpec("P.v operands of unexpected rank", op=op)
    batch, m, n, _, ev = _operands(ctx, p, v, op)
    if ctx.roles.get(_single(p.axes[-1], "key", op)) != "kv":
        raise UnsupportedSpec("P.v does not contract over the key axis", op=op)
    dv = _single(n, "value head-dim", op)
    coef, lv = _factor(ev, p.axes[-1][0])
    if coef != const(1.0):
        raise UnsupportedSpec("the value tensor is scaled inside P.v", op=op)
    ctx.roles[dv] = "dv"
    ctx.facts["output"] = {"v": lv, "probs": p}
    return Sym(tuple(batch) + (m, n), None, v.dtype, "attn", {})


def unit_key_output(ctx: Ctx, p: Sym, v: Sym, op: str) -> Sym | None:
    """P * v where the key axis is size 1: P.v with one key, as einsum writes it at Skv = 1 (a broadcast
    product, the sum over one key left to a view that drops the unit dim). None where it is not that: the
    key axis longer than 1, P.v already found, or a v that is not a plain input (a factor on the
    probabilities, for row_scaled to judge)."""
    kv = p.axes[-1] if p.axes else ()
    if "output" in ctx.facts or len(kv) != 1 or ctx.roles.get(kv[0]) != "kv" or ctx.sizes.get(kv[0]) != 1:
        return None
    if v.kind != "value" or v.expr is None or v.expr.op != "load" or len(v.axes) > len(p.axes):
        return None
    lead = len(p.axes) - len(v.axes)
    own = v.axes[len(p.axes) - 1 - lead] if len(p.axes) - 1 >= lead else ()
    if len(own) == 1 and ctx.sizes.get(own[0]) == 1 and own[0] not in ctx.roles:  # v's own key index reads P's
        v = ctx.subst(v, {own[0]: Expr("var", (), kv[0])}, op)
    axes, (_, ev) = broadcast(ctx, [Sym(p.axes, const(0.0), p.dtype), v], op)
    rest = [ax for ax in axes if len(ax) == 1 and ctx.sizes.get(ax[0], 1) > 1 and ax[0] not in ctx.roles]
    if ev.op != "load" or len(rest) != 1:
        return None
    ctx.roles[rest[0][0]] = "dv"
    ctx.facts["output"] = {"v": ev, "probs": p}
    # the product still has the one key as a unit dim, which the output does not index
    return Sym(tuple(() if ax == kv else ax for ax in axes), None, v.dtype, "attn", {})
