"""Symbolic tensors: the abstract values of the graph analysis.

Every dimension of a tensor is a list of *atoms* (index variables with a
size; a merged dim has several). A tensor's value is a CuIR expression over
its atoms, so views become substitutions and broadcasting becomes
unification. Once the q.k contraction is found, its atoms get roles
(b, h, q, kv, d) and must survive to the end.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ...errors import UnsupportedSpec
from ...ir.expr import Expr, call, const, load, substitute
from ...ir.interval import Interval
from .simplify import simplify

Axes = tuple[tuple[str, ...], ...]


def packet_name(node: Any) -> str:
    """An FX node's aten op without its overload ("bmm" for aten.bmm.default); "" for anything else."""
    return getattr(getattr(node.target, "overloadpacket", None), "__name__", "")


@dataclass
class Sym:
    axes: Axes
    expr: Expr | None
    dtype: torch.dtype
    kind: str = "value"            # value | attn | probs | rowmax | shifted | expshift | rowsum | catsink
    payload: dict[str, Any] = field(default_factory=dict)


class Ctx:
    """Atom sizes, roles and the facts found about the attention structure."""

    def __init__(self) -> None:
        self.sizes: dict[str, int] = {}
        self.roles: dict[str, str] = {}
        self.facts: dict[str, Any] = {}
        self.derived: dict[str, Expr] = {}           # digit atom -> its value in the role atom it splits
        self._pairs: dict[tuple[str, str], str] = {}  # (outer, inner) -> the role atom they split
        self._n = 0

    def split(self, whole: str, outer: str, inner: str) -> None:
        """outer, inner: the digits of role atom `whole` (whole = outer * |inner| + inner)."""
        n = self.sizes[inner]
        self.derived[outer] = call("floordiv", Expr("var", (), whole), const(n))
        self.derived[inner] = call("mod", Expr("var", (), whole), const(n))
        self._pairs[(outer, inner)] = whole

    def digits_of(self, outer: str, inner: str) -> str | None:
        return self._pairs.get((outer, inner))

    def derived_of(self, atom: str) -> dict[str, Expr]:
        return {atom: self.derived[atom]} if atom in self.derived else {}

    def atom(self, size: int) -> str:
        self._n += 1
        name = f"_a{self._n}"
        self.sizes[name] = int(size)
        return name

    def ranges(self) -> dict[str, Interval]:
        return {a: (0.0, float(n - 1)) for a, n in self.sizes.items()}

    def dim_size(self, atoms: tuple[str, ...]) -> int:
        n = 1
        for a in atoms:
            n *= self.sizes[a]
        return n

    def shape(self, x: Sym) -> tuple[int, ...]:
        return tuple(self.dim_size(d) for d in x.axes)

    def subst(self, x: Sym, mapping: dict[str, Expr], op: str) -> Sym:
        """Rewrite x's value after a view; role atoms may not be rewritten."""
        if not mapping:
            return x
        hit = [a for a in mapping if a in self.roles]
        if hit and x.kind != "value" or any(a in self.roles and _mentions(x, a) for a in hit):
            raise UnsupportedSpec(f"a view re-indexes the {self.roles[hit[0]]} axis after the score matmul", op=op)
        expr = None if x.expr is None else simplify(substitute(x.expr, mapping), self.ranges())
        return Sym(x.axes, expr, x.dtype, x.kind, x.payload)

    def decompose(self, src: Expr, atoms: tuple[str, ...]) -> dict[str, Expr]:
        """atoms (row-major, merged) := digits of the flat index src."""
        out: dict[str, Expr] = {}
        inner = 1
        for a in reversed(atoms):
            n = self.sizes[a]
            e = src if inner == 1 else call("floordiv", src, const(inner))
            out[a] = e if a == atoms[0] else call("mod", e, const(n))
            inner *= n
        return {a: simplify(e, self.ranges()) for a, e in out.items()}

    def linear(self, atoms: tuple[str, ...]) -> Expr:
        e: Expr | None = None
        for a in atoms:
            e = Expr("var", (), a) if e is None else call("add", call("mul", e, const(self.sizes[a])), Expr("var", (), a))
        return e if e is not None else const(0)


def _mentions(x: Sym, atom: str) -> bool:
    if x.expr is not None and f"'{atom}'" in repr(x.expr):
        return True
    return any(atom in d for d in x.axes)


def unify(ctx: Ctx, keep: tuple[str, ...], other: tuple[str, ...], op: str) -> dict[str, Expr]:
    """Substitution for `other`'s atoms so they index like `keep` (same extent)."""
    if keep == other:
        return {}
    if len(keep) == len(other) == 1 and ctx.sizes[keep[0]] == ctx.sizes[other[0]] == 1:
        # one unit dim aligned with another (a single key against a single value row: Sq = Skv = 1):
        # the same axis, read as its variable (always 0), so the role it has on one side reaches the other
        return {other[0]: Expr("var", (), keep[0])}
    if ctx.dim_size(keep) != ctx.dim_size(other):
        raise UnsupportedSpec(f"cannot align dims of sizes {ctx.dim_size(keep)} and {ctx.dim_size(other)}", op=op)
    k = tuple(a for a in keep if ctx.sizes[a] > 1)
    o = tuple(a for a in other if ctx.sizes[a] > 1)
    m: dict[str, Expr] = {a: const(0) for a in other if ctx.sizes[a] == 1 and a not in keep}
    i = j = 0
    while i < len(k) and j < len(o):
        gk, gj = [k[i]], [o[j]]
        i, j = i + 1, j + 1
        pk, po = ctx.sizes[gk[0]], ctx.sizes[gj[0]]
        while pk != po:  # grow the smaller side until both groups span the same extent
            if pk < po and i < len(k):
                gk.append(k[i]); pk *= ctx.sizes[k[i]]; i += 1
            elif po < pk and j < len(o):
                gj.append(o[j]); po *= ctx.sizes[o[j]]; j += 1
            else:
                raise UnsupportedSpec("merged dims do not line up", op=op)
        if len(gk) == 1 and len(gj) == 1:
            if gk[0] != gj[0]:
                m[gj[0]] = Expr("var", (), gk[0])
        elif len(gk) == 1:
            m.update(ctx.decompose(Expr("var", (), gk[0]), tuple(gj)))
        elif len(gj) == 1:
            m[gj[0]] = ctx.linear(tuple(gk))
        else:
            raise UnsupportedSpec("merged dims split in two different ways", op=op)
    return m


def input_sym(ctx: Ctx, name: str, t: torch.Tensor) -> Sym:
    atoms = tuple((ctx.atom(n),) for n in t.shape)
    idx = [Expr("var", (), a[0]) for a in atoms]
    ctx.facts.setdefault("inputs", {})[name] = t
    return Sym(atoms, load(name, *idx), t.dtype)
