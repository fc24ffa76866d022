"""Where a computed operand's length comes from.

A program whose q, k or v the prologue computes (a KV cache concatenated with the new keys, memory
key/values prepended, RoPE applied inside the spec) has operand lengths that are no argument's
size, so generalisation had no argument to move and held such a program at its call's shape: a
decode loop over a growing cache captured again at every step. Here the prologue runs once more
over fake tensors whose every size is a symbol (torch's ShapeEnv), so each operand's length comes
out as an expression in argument sizes, `s_cache + 1` for a cache plus one new key, `s_width * s_page`
for pages gathered through a block table. Where it is one argument dim times a constant plus a
constant, the operand records that (`Operand.length`), and generalisation,
verification's redrawn inputs and the guards then move that dim as they move an argument's length.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import replace
from typing import Any

import sympy
import torch

from ..capture.guards import symbolic_fakes
from ..ir.bind import call_device, lookup
from ..ir.program import Program
from ..ir.prologue import FIXED, needed_steps, operand_inputs, run_steps


# with_lengths' rules by (program, what its prologue reads): a model's layers of one shape ask the same
# question, and a symbolic run through a convolution's shape rules took 15 s of each of cvt's 13 first calls
_MEMO: "OrderedDict[tuple, dict[str, tuple] | None]" = OrderedDict()
_MEMO_CAP = 256
_memo_lock = threading.Lock()


def with_lengths(p: Program, bound: dict[str, Any]) -> Program | None:
    """`p` with the length of each computed operand tied to an argument dim, or fixed where no size
    moves it (a module's latent queries); None where some computed operand's length is another function
    of the sizes."""
    computed = [(r, op) for r, op in (("q", p.q), ("k", p.k), ("v", p.v)) if op.step]
    if not computed:
        return p
    paths = sorted(operand_inputs(p))
    key = _memo_key(p, bound, paths)
    with _memo_lock:
        known = key is not None and key in _MEMO
        found = _MEMO.get(key) if known else None
    if not known:
        found = _found(computed, p, bound, paths)
        if key is not None:
            with _memo_lock:
                _MEMO[key] = found
                while len(_MEMO) > _MEMO_CAP:
                    _MEMO.popitem(last=False)
    if found is None:
        return None
    return replace(p, **{role: replace(op, length=found[role]) for role, op in computed})


def _memo_key(p: Program, bound: dict[str, Any], paths: list[str]) -> tuple | None:
    """Everything the rules are a function of: the program, and the size, layout, dtype and device of each
    tensor its prologue reads (a value it reads, by value); None where a read is neither."""
    parts: list = [p.to_json()]
    for path in paths:
        v = lookup(bound, path)
        if isinstance(v, torch.Tensor):
            parts.append((path, tuple(v.shape), tuple(v.stride()), str(v.dtype), str(v.device), path in bound))
        elif isinstance(v, (int, float, bool, str, type(None))):
            parts.append((path, type(v).__name__, v))
        else:
            return None
    return tuple(parts)


def _found(computed: list, p: Program, bound: dict[str, Any], paths: list[str]) -> dict[str, tuple] | None:
    steps = needed_steps(p.prologue, {op.step for _, op in computed})
    tensors = {path: t for path in paths if isinstance(t := lookup(bound, path), torch.Tensor)}
    # the run as captured, then with view sizes made symbolic ([B*T, C] viewed as [B, T, H, D] holds T as
    # a literal): the first that ties every length to an argument; a fixed length only where neither does
    found = _rules(computed, steps, tensors, bound, views=False)
    if not _tied(found):
        again = _rules(computed, steps, tensors, bound, views=True)
        found = again if _tied(again) else found or again
    return found


def _tied(rules: dict[str, tuple] | None) -> bool:
    """Every computed operand's length follows an argument dim (none fixed)."""
    return rules is not None and all(r[0] != FIXED for r in rules.values())


def _rules(computed: list, steps: tuple, tensors: dict[str, torch.Tensor], bound: dict[str, Any],
           views: bool) -> dict[str, tuple] | None:
    """Each computed operand's length rule from one symbolic run; None where some has none."""
    try:
        env, mode, fakes, owner = symbolic_fakes(tensors)
        with mode:
            done = run_steps(steps, {**bound, **fakes}, call_device(bound), rewrite=_rewriter(fakes, views))
    except Exception:  # an op symbolic sizes cannot run: held at its shape
        return None
    out = {}
    for role, op in computed:
        rule = _rule(done[op.step].shape[op.dims.index("s")], env, owner, bound)
        if rule is None:
            return None
        out[role] = rule
    return out


_VIEWS = ("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default")


def _rewriter(fakes: dict[str, torch.Tensor], views: bool):
    """rewrite(op, args) for the symbolic run: literals captured at the call's sizes made symbolic again
    (an expand's always, a view's where `views`)."""
    sizes = [n for t in fakes.values() for n in t.shape if isinstance(n, torch.SymInt)]

    def rewrite(op: str, args: list) -> list:
        if views and op in _VIEWS:
            return _view_sizes(args, sizes)
        return _same_size(op, args)
    return rewrite


def _view_sizes(args: list, sizes: list) -> list:
    """A view's literal size equal to an argument's size that the viewed tensor's sizes are made of, as
    that symbolic size ([B*T, C] viewed as [B, T, H, D]: B and T). A guess where two sizes are equal:
    generalisation's probes and verification decide whether the program holds."""
    if len(args) < 2 or not isinstance(args[0], torch.Tensor):
        return args
    made = set().union(*(n.node.expr.free_symbols for n in args[0].shape if isinstance(n, torch.SymInt)))
    by_hint: dict[int, list] = {}
    for n in sizes:
        if n.node.expr.is_Symbol and n.node.expr in made:
            by_hint.setdefault(n.node.hint, []).append(n)
    new = [by_hint[n][0] if type(n) is int and n > 1 and len({x.node.expr for x in by_hint.get(n, ())}) == 1 else n
           for n in args[1]]
    return [args[0], new] + list(args[2:])


def _same_size(op: str, args: list) -> list:
    """An expand's literal sizes equal to its input's (a matmul's broadcast, captured at the call's
    sizes) as -1: the same expand, but one that does not fix the symbolic length to the literal."""
    if op != "aten.expand.default" or len(args) < 2 or not isinstance(args[0], torch.Tensor):
        return args
    x, new = args[0], list(args[1])
    lead = len(new) - x.dim()
    for i, n in enumerate(new):
        j = i - lead
        if j >= 0 and type(n) is int and n == _hint(x.shape[j]):
            new[i] = -1
    return [x, new] + list(args[2:])


def _hint(n: Any) -> int | None:
    if isinstance(n, torch.SymInt):
        return n.node.hint
    return int(n)


def _rule(n: Any, env: Any, owner: dict, bound: dict[str, Any]) -> tuple | None:
    """(path, dim, offset, moved, scale) with length = that dim * scale + offset. The symbol moved is
    one the length is linear in with a positive integer coefficient once the other symbols take their
    example values (those stay pinned: `_unmoved` guards every argument dim the probes leave). Among
    coefficient-1 symbols the largest example size (a cache, not its new keys); otherwise the dim of the
    smallest argument (a block table's width, not the page pool's page size)."""
    if not isinstance(n, torch.SymInt):
        return FIXED, -1, int(n), ()
    expr = env.replace(n.node.expr)
    values = {s: int(lookup(bound, owner[s][0]).shape[owner[s][1]]) for s in expr.free_symbols if s in owner}
    if len(values) != len(expr.free_symbols):
        return None
    # a module's own tensor is no argument the call can size: its sizes are constants here
    expr = expr.subs({s: n for s, n in values.items() if owner[s][0] not in bound})
    if expr.is_Integer:
        return FIXED, -1, int(expr), ()  # no argument moves it (a module's latent queries): always that
    values = {s: n for s, n in values.items() if s in expr.free_symbols}
    coef = {}
    for s in values:  # only a top-level argument can be redrawn at another size (a module's keeps its own)
        c = sympy.diff(expr, s)
        if owner[s][0] not in bound or sympy.diff(c, s) != 0:
            continue
        c = c.subs(values)
        if c.is_Integer and int(c) >= 1:
            coef[s] = int(c)
    if not coef:
        return None
    ones = [x for x in coef if coef[x] == 1]
    s = max(ones, key=lambda x: values[x]) if ones else min(
        coef, key=lambda x: (lookup(bound, owner[x][0]).numel(), -values[x]))
    rest = (expr - coef[s] * s).subs(values)
    if not rest.is_Integer:
        return None
    path, d = owner[s]
    # every argument dim the prologue's own checks made equal to it (RoPE's table and the keys) moves too
    moved = tuple(sorted(pd for x, pd in owner.items() if env.replace(x) == s and pd[0] in bound))
    if any(pd[0] not in bound for x, pd in owner.items() if env.replace(x) == s):
        return None  # a module's own tensor that would have to move
    return (path, d, int(rest), moved) + ((coef[s],) if coef[s] != 1 else ())
