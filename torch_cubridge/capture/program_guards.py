"""When a transferred program holds: the sizes it requires and the guards a later call must pass.

A generic program moves with the lengths (and the batch, where probes showed it); everything else the
example fixed is pinned. The guards are the spec's own size decisions (traced symbolically by
capture/guards.py), the pinned sizes, and the values of its Python arguments.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

import torch

from ..ir.expr import Expr, call, const, dim, walk
from ..ir.program import Operand, Program
from ..ir.prologue import FIXED, length_rule, operand_length
from ..verify.inputs import example_sizes, length_steps, make_inputs
from .guards import pin_all, size_guards, value_guards


def held(fn: Callable, bound: dict[str, Any], prog: Program, generic: bool) -> Program:
    """The program with the sizes it requires and the guards it holds under."""
    prog = with_requirements(prog, bound, generic)
    return replace(prog, guards=guards_for(fn, bound, prog, generic))


def with_requirements(prog: Program, bound: dict[str, Any], generic: bool) -> Program:
    """Sizes of extent 1 were broadcasts at capture; a specialised program holds at its shape only."""
    sizes = example_sizes(prog, bound)
    keep = ("B", "H", "Hkv", "Sq", "Skv")
    # a generic prologue is fitted in the lengths (and the batch, where probes showed it: Program.batch)
    # only: the heads stay the call's
    fixed = (("H", "Hkv") if prog.batch else ("B", "H", "Hkv")) if prog.prologue or prog.epilogue else ()
    req = tuple((k, sizes[k]) for k in keep if sizes[k] == 1 or not generic or k in fixed)
    return replace(prog, requires=req)


def guards_for(fn: Callable, bound: dict[str, Any], prog: Program, generic: bool) -> tuple[Expr, ...]:
    """When the program holds: the spec's size decisions, pinned sizes, its Python arguments."""
    seq = [length_of(op) for op in (prog.q, prog.k, prog.v)]
    moving = tuple(s[:2] for s in seq if s is not None and s[0] != FIXED) + tuple(
        pd for op in (prog.q, prog.k, prog.v) if op.step and op.length for pd in length_rule(op)[3])
    unmoved = _unmoved(prog, bound) if generic and (prog.prologue or prog.epilogue) else ()
    pinned = frozenset((path, d) for path, d, _ in unmoved)
    traced = size_guards(fn, bound, moving, pinned) if generic and None not in seq else None
    unread: frozenset = frozenset()
    if traced is None:  # not generic, or code only a static trace survives: exactly the example's sizes
        sizes = pin_all(bound)
    else:
        sizes, unread = traced  # sizes the spec never reads (a page pool's page count) stay free
        if operand_length(prog.q, bound) == operand_length(prog.k, bound):
            # generalisation fitted scalars in Sq alone when the example was square
            sizes += (call("eq", _length_expr(seq[0]), _length_expr(seq[1])),)
    sizes += tuple(call("eq", dim(path, d), const(n)) for path, d, n in unmoved if (path, d) not in unread)
    if generic:
        sizes += _divisor_pins(prog, bound)
    return sizes + value_guards(fn, bound)


def _divisor_pins(prog: Program, bound: dict[str, Any]) -> tuple[Expr, ...]:
    """A constant that divides an index (b % 4 from Swin's view(B // nW, nW, ...)) may be a size that
    reached the program through a view's shape, which no guard records: every argument dim of that
    size is pinned (at worst a needless pin: another size captures again)."""
    vals = {s.name: s.value for s in prog.scalars if s.kind == "int" and s.expr is None and s.arg is None}
    used = {vals[n.args[1].attr] for e in (prog.score, prog.mask, prog.sink) if e is not None for n in walk(e)
            if n.op in ("floordiv", "mod") and n.args[1].op == "scalar" and n.args[1].attr in vals}
    return tuple(call("eq", dim(path, d), const(int(n))) for path, t in bound.items() if isinstance(t, torch.Tensor)
                 for d, n in enumerate(t.shape) if n in used and n > 1)


def _unmoved(prog: Program, bound: dict[str, Any]) -> tuple[tuple[str, int, int], ...]:
    """(path, dim, size) of every argument size that does not follow the lengths (or the batch, where the
    program is fitted to it), to be pinned: a generic prologue has only its fitted literals moving (a view's
    H or a table's size stays a literal)."""
    ex, step = example_sizes(prog, bound), length_steps(prog)
    probe = dict(ex, Sq=ex["Sq"] + 3 * step["Sq"], Skv=ex["Skv"] + (3 if ex["Sq"] == ex["Skv"] else 5) * step["Skv"])
    if prog.batch:
        probe["B"] = ex["B"] + 1
    moved = make_inputs(prog, bound, probe, seed=0, values=False)
    return tuple((path, d, int(n)) for path, t in bound.items() if isinstance(t, torch.Tensor)
                 for d, n in enumerate(t.shape) if moved[path].shape[d] == n)


def length_of(op: Operand) -> tuple[str, int, int, int] | None:
    """(path, dim, offset, scale): the argument dim an operand's length is, times scale, plus offset;
    None: held."""
    if op.step is None:
        return op.arg, op.dims.index("s"), 0, 1
    rule = length_rule(op)
    return None if rule is None else (rule[0], rule[1], rule[2], rule[4])


def _length_expr(seq: tuple[str, int, int, int]) -> Expr:
    path, d, off, scale = seq
    if path == FIXED:
        return const(off)
    n = dim(path, d) if scale == 1 else call("mul", dim(path, d), const(scale))
    return call("add", n, const(off)) if off else n
