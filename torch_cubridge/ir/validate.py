"""The validity check for CuIR programs (tests and every pass boundary call it)."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .program import Program

from .expr import BINARY, INDEX_VARS, ROW_LSE, SIZE_VARS, UNARY, Expr, free_vars, walk
from .expr import CANON
from .prologue import step_refs

_ARITY = {**{o: 1 for o in UNARY}, **{o: 2 for o in BINARY}, "where": 3}


class InvalidProgram(ValueError):
    pass


def _check_expr(e: Expr, allowed: set[str], what: str, p: Program) -> None:
    extras = {x.name: x for x in p.extras}
    scalars = {s.name for s in p.scalars}
    for n in walk(e):
        if n.op in _ARITY and len(n.args) != _ARITY[n.op]:
            raise InvalidProgram(f"{what}: {n.op} takes {_ARITY[n.op]} operands")
        if n.op == "load":
            if n.attr not in extras:
                raise InvalidProgram(f"{what}: load of undeclared tensor {n.attr!r}")
            if len(n.args) != extras[n.attr].rank:
                raise InvalidProgram(f"{what}: {n.attr} has rank {extras[n.attr].rank}, indexed with {len(n.args)}")
        if n.op == "scalar" and n.attr not in scalars:
            raise InvalidProgram(f"{what}: undeclared scalar {n.attr!r}")
    bad = free_vars(e) - allowed
    if bad:
        raise InvalidProgram(f"{what} reads {sorted(bad)}, which it may not")


def validate(p: Program) -> None:
    for name in ("q", "k", "v"):
        dims = getattr(p, name).dims
        if sorted(dims) not in (sorted(CANON), sorted(CANON[1:]), sorted("bsd")):
            raise InvalidProgram(f"{name} layout {dims} is not a permutation of b, h, s, d")
    if p.head_map not in ("group", "tile"):
        raise InvalidProgram(f"unknown head map {p.head_map!r}")
    sizes = set(SIZE_VARS)
    _check_expr(p.score, {"s", *INDEX_VARS, *sizes}, "score", p)
    if p.mask is not None:
        _check_expr(p.mask, {*INDEX_VARS, *sizes}, "mask", p)
    if p.sink is not None:
        _check_expr(p.sink, {"b", "h", *sizes}, "sink", p)
    if p.row_scale is not None:
        _check_expr(p.row_scale, {"b", "h", "q", ROW_LSE, *sizes}, "row scale", p)
    for s in p.scalars:
        if s.kind not in ("float", "int"):
            raise InvalidProgram(f"scalar {s.name}: kind {s.kind!r}")
        if sum(x is not None for x in (s.value, s.arg, s.expr)) > 1:
            raise InvalidProgram(f"scalar {s.name} has more than one source")
        if s.expr is not None:
            _check_expr(s.expr, sizes, f"scalar {s.name}", p)
    names = [x.name for x in p.extras] + [s.name for s in p.scalars]
    if len(set(names)) != len(names):
        raise InvalidProgram("duplicate tensor or scalar names")
    made: set[str] = set()
    for st in p.prologue:
        if st.name in made:
            raise InvalidProgram(f"prologue step {st.name} is made twice")
        for ref in step_refs((st.args, st.kwargs)):
            if ref not in made:
                raise InvalidProgram(f"prologue step {st.name} reads {ref} before it is made")
        made.add(st.name)
    for x in p.extras:
        if x.step is not None:
            if x.step not in made or x.arg is not None or x.value is not None:
                raise InvalidProgram(f"tensor {x.name}: prologue step {x.step!r} is missing or not its only source")
        elif x.arg is None and x.value is None and not _structure_only(p):
            raise InvalidProgram(f"tensor {x.name} has no source")
    from .expr import loads
    if p.mask is None:
        fits = p.block_rule == "none"
    else:  # interval analysis cannot see data; a mask that loads needs the runtime pre-pass
        fits = p.block_rule == "prepass" or (p.block_rule == "interval" and not loads(p.mask))
    if not fits:
        raise InvalidProgram(f"block rule {p.block_rule!r} does not fit the mask")
    if p.empty_rows not in ("zero", "mean_v"):
        raise InvalidProgram(f"empty_rows {p.empty_rows!r}")
    od = p.out.dims
    flat = [d for x in od for d in x.split("*")]
    if sorted(flat) not in (sorted(CANON), sorted(CANON[1:])):
        raise InvalidProgram(f"output layout {od} is not a permutation of b, h, s, d")
    if p.out.lse_index >= 0:  # a returned log-sum-exp: its own place in the tuple, over b, h, s
        named = [d for d in p.out.lse_dims if d != "1"]
        if not (p.out.lse_index < p.out.tuple_len and p.out.lse_index != p.out.index) or p.epilogue \
                or sorted(named) not in (["b", "h", "s"], ["h", "s"]) or ("b" in named) != ("b" in flat):
            raise InvalidProgram(f"log-sum-exp at {p.out.lse_index} laid out {p.out.lse_dims}")


def _structure_only(p: Program) -> bool:
    return all(x.value is None for x in p.extras)
