"""Pass: make a program generic in sizes where probes show it may be.

The spec is captured again (with fake tensors, so this is cheap) at probe
shapes. If the structure is unchanged, every scalar whose value moves with
the shape is fitted exactly as c0 + c1*Sq + c2*Skv and becomes a derived
scalar. Any structural change, or a value no affine form explains, keeps the
program specialised to its shape: never a wrong generalisation. Where a
prologue or epilogue names the batch size, probes at other batch sizes fit
its literals in B as well (`Program.batch`), or B stays held.
"""
from __future__ import annotations

from dataclasses import replace
from fractions import Fraction
from typing import Any, Callable

import torch

from ..capture.trace import capture
from ..errors import UnsupportedSpec
from ..ir.expr import Expr, call, const, var
from ..ir.program import Program
from ..verify.inputs import example_sizes, length_steps, make_inputs


def _probe_sizes(ex: dict[str, int], step: dict[str, int]) -> list[dict[str, int]]:
    """Lengths near the call's, `step` apart where an operand's length comes in whole pages."""
    def near(n: int, d: int, name: str) -> int:
        # a size-1 dim is its own call signature (a broadcast, or one decoding query): probes never
        # leave 1, and never step onto it from a longer length
        if n == 1:
            return 1
        d *= step[name]  # and a table of pages never narrows to one page, a signature of its own
        return n - d if n - d >= 2 * step[name] else n + d
    if ex["Sq"] == ex["Skv"]:
        return [dict(ex, Sq=near(ex["Sq"], d, "Sq"), Skv=near(ex["Sq"], d, "Sq")) for d in (3, 1, 6)]
    return [dict(ex, Sq=near(ex["Sq"], a, "Sq"), Skv=near(ex["Skv"], b, "Skv")) for a, b in ((3, 1), (1, 4), (2, 7))]


def _solve(points: list[tuple[list[int], Fraction]]) -> list[Fraction] | None:
    """Exact least-size solve of A c = y by Gaussian elimination over fractions."""
    n = len(points[0][0])
    rows = [[Fraction(x) for x in a] + [y] for a, y in points]
    piv_cols, r = [], 0
    for c in range(n):
        p = next((i for i in range(r, len(rows)) if rows[i][c] != 0), None)
        if p is None:
            continue
        rows[r], rows[p] = rows[p], rows[r]
        rows[r] = [x / rows[r][c] for x in rows[r]]
        for i in range(len(rows)):
            if i != r and rows[i][c] != 0:
                f = rows[i][c]
                rows[i] = [a - f * b for a, b in zip(rows[i], rows[r])]
        piv_cols.append(c)
        r += 1
    if any(all(x == 0 for x in row[:-1]) and row[-1] != 0 for row in rows):
        return None
    sol = [Fraction(0)] * n
    for i, c in enumerate(piv_cols):
        sol[c] = rows[i][-1]
    return sol


def _affine(coef: list[Fraction], names: list[str], is_int: bool) -> Expr | None:
    terms: Expr | None = None
    for c, nm in zip(coef[1:], names):
        if c == 0:
            continue
        if c.denominator != 1:
            return None
        t = var(nm) if c == 1 else call("mul", const(int(c)), var(nm))
        terms = t if terms is None else call("add", terms, t)
    c0 = coef[0]
    if c0.denominator != 1 and is_int:
        return None
    c0v = int(c0) if c0.denominator == 1 else float(c0)
    if terms is None:
        return None
    return terms if c0v == 0 else call("add", terms, const(c0v))


def generalize(fn: Callable, example: dict[str, Any], prog: Program,
               transfer_fn: Callable[[Any], Program]) -> tuple[Program, bool]:
    ex = example_sizes(prog, example)
    square = ex["Sq"] == ex["Skv"]
    names = ["Sq"] if square else ["Sq", "Skv"]
    progs = _probes(fn, example, prog, transfer_fn, ex)
    if progs is None:
        return prog, False
    fitted = _fit(prog, progs, names)
    if fitted is None:
        return prog, False
    return _batch_free(fn, example, prog, progs, names, transfer_fn, ex) or fitted, True


def _fit(prog: Program, progs: list[tuple[dict[str, int], Program]], names: list[str]) -> Program | None:
    """prog with every scalar and pro-/epilogue literal that moves across the probes an exact affine form of
    the sizes `names`; None where one has none."""
    steps, after = _fit_steps(progs, names, "prologue"), _fit_steps(progs, names, "epilogue")
    if steps is None or after is None:
        return None
    scalars = []
    for i, s in enumerate(prog.scalars):
        vals = [Fraction(p.scalars[i].value).limit_denominator(1 << 20) for _, p in progs]
        if all(v == vals[0] for v in vals):
            scalars.append(s)
            continue
        pts = [([1] + [sz[n] for n in names], v) for (sz, _), v in zip(progs, vals)]
        coef = _solve(pts)
        expr = None if coef is None else _affine(coef, names, s.kind == "int")
        if expr is None or any(_eval(coef, [sz[n] for n in names]) != v for (sz, _), v in zip(progs, vals)):
            return None
        scalars.append(replace(s, value=None, expr=expr))
    return replace(prog, scalars=tuple(scalars), prologue=steps, epilogue=after)


def _batch_free(fn: Callable, example: dict[str, Any], prog: Program, progs: list[tuple[dict[str, int], Program]],
                names: list[str], transfer_fn: Callable[[Any], Program], ex: dict[str, int]) -> Program | None:
    """The program fitted in the batch size too, where a prologue or epilogue names it (a paged decode's
    views: [B, Hkv, S, D]) and probes at other batch sizes keep the structure; None: B stays held.
    The batch is the query's b dim and every argument size the spec's symbolic trace found equal to it
    (a block table's rows, a lengths vector), which verification's inputs then move with B. Not for a
    call with module arguments (whose symbolic trace is not kept), nor from a batch of one (a signature
    of its own)."""
    from ..capture.guards import sizes_equal_to
    if not (prog.prologue or prog.epilogue) or ex["B"] < 2 or any(
            isinstance(v, torch.nn.Module) for v in example.values()):
        return None
    op = next((o for o in (prog.q, prog.k, prog.v) if o.step is None and "b" in o.dims), None)
    if op is None:
        return None
    dims = sizes_equal_to(fn, example, op.arg, op.dims.index("b"))
    if not dims:
        return None
    batched = replace(prog, batch=dims)
    more = []
    try:
        for b in (ex["B"] + 1, ex["B"] + 2):
            bound = make_inputs(batched, example, dict(ex, B=b), seed=7, values=False)
            probe = transfer_fn(capture(fn, bound))
            if example_sizes(probe, bound) != dict(ex, B=b) or _size_free(probe) != _size_free(prog):
                return None
            more.append((dict(ex, B=b), probe))
    except (UnsupportedSpec, ValueError, TypeError, RuntimeError, IndexError):
        return None
    fitted = _fit(prog, progs + more, names + ["B"])
    return None if fitted is None else replace(fitted, batch=dims)


def _probes(fn: Callable, example: dict[str, Any], prog: Program, transfer_fn: Callable[[Any], Program],
            ex: dict[str, int]) -> list[tuple[dict[str, int], Program]] | None:
    """The program captured again at probe lengths near the call's; where the spec cannot run there
    (it reshapes the sequence into chunks, so lengths must divide), at 2, 3 and 4 times the call's.
    None: some probe changed the structure, or neither family runs."""
    for family in (_probe_sizes(ex, length_steps(prog)), _multiples(ex)):
        progs: list[tuple[dict[str, int], Program]] = [(ex, prog)]
        try:
            for sizes in family:
                bound = make_inputs(prog, example, sizes, seed=7, values=False)  # capture reads shapes only
                probe = transfer_fn(capture(fn, bound))
                got = example_sizes(probe, bound)
                if (got["Sq"], got["Skv"]) != (sizes["Sq"], sizes["Skv"]):  # a length rule that does not hold
                    return None
                progs.append((sizes, probe))
        except (UnsupportedSpec, ValueError, TypeError, RuntimeError, IndexError):
            continue
        return progs if all(_size_free(p) == _size_free(prog) for _, p in progs) else None
    return None


def _multiples(ex: dict[str, int]) -> list[dict[str, int]]:
    if ex["Sq"] == 1 or ex["Skv"] == 1:
        return []
    return [dict(ex, Sq=ex["Sq"] * m, Skv=ex["Skv"] * m) for m in (2, 3, 4)]


def _size_free(p: Program) -> Program:
    """The structure with the prologue's integer literals blanked: probes may move those."""
    def blank(steps: tuple) -> tuple:
        return tuple(replace(st, args=_blank(st.args), kwargs=_blank(st.kwargs)) for st in steps)
    ops = {r: replace(getattr(p, r), length=None) for r in ("q", "k", "v")}  # probes' programs have no rules
    return replace(p.structure(), prologue=blank(p.prologue), epilogue=blank(p.epilogue), **ops)


def _blank(x: Any) -> Any:
    if isinstance(x, tuple):
        return tuple(_blank(i) for i in x)
    return 0 if type(x) is int else x


def _fit_steps(progs: list[tuple[dict[str, int], Program]], names: list[str], which: str) -> tuple | None:
    """The prologue (or epilogue: `which`) with every integer literal that moves with the lengths
    (arange(S), a view's S) an exact affine form ("@size", c0, ((name, c), ...)) of them; None where no
    such form fits."""
    def fit(vals: list[Any]) -> Any:
        if type(vals[0]) is not int or all(v == vals[0] for v in vals):
            return vals[0]
        pts = [([1] + [sz[n] for n in names], Fraction(v)) for (sz, _), v in zip(progs, vals)]
        coef = _solve(pts)
        if coef is None or any(c.denominator != 1 for c in coef) or any(
                _eval(coef, [sz[n] for n in names]) != v for (sz, _), v in zip(progs, vals)):
            raise _NoFit
        return ("@size", int(coef[0]), tuple((n, int(c)) for n, c in zip(names, coef[1:]) if c))

    def walk(xs: list[Any]) -> Any:
        if isinstance(xs[0], tuple):
            return tuple(walk([x[i] for x in xs]) for i in range(len(xs[0])))
        return fit(xs)
    try:
        return tuple(replace(st, args=walk([getattr(p, which)[i].args for _, p in progs]),
                             kwargs=walk([getattr(p, which)[i].kwargs for _, p in progs]))
                     for i, st in enumerate(getattr(progs[0][1], which)))
    except _NoFit:
        return None


class _NoFit(Exception):
    pass


def _eval(coef: list[Fraction], xs: list[int]) -> Fraction:
    return coef[0] + sum(c * x for c, x in zip(coef[1:], xs))
