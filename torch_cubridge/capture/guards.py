"""Size guards from a symbolic capture, with torch's own ShapeEnv.

The spec is traced once more with every argument size a symbol (no duck
sizing: two equal sizes stay two symbols). Every decision its Python makes on
a size (`if S > window`, `range(H)`, `math.sqrt(D)`) is recorded by the
ShapeEnv as a guard. A size that flows into a value rather than a shape (ALiBi
slopes from `H`, `D ** -0.5`, a slice offset) pins that size: the concrete
program has its value baked in. Sequence lengths are the exception: the
generalisation pass fits them as runtime scalars, and pins them itself when
it cannot. Python scalar arguments are baked into the capture, so each one
is a guard too.
"""
from __future__ import annotations

from typing import Any, Callable

import sympy
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from ..ir.expr import Expr, arg, call, const, dim
from .trace import TRACE_LOCK, quiet_meta_failures, spec_over
from .tracememo import memoised
from .tracereuse import layout_exprs, reused

_SYM = (torch.SymInt, torch.SymFloat, torch.SymBool)
_CMP = {sympy.Eq: "eq", sympy.Ne: "ne", sympy.StrictLessThan: "lt", sympy.LessThan: "le",
        sympy.StrictGreaterThan: "gt", sympy.GreaterThan: "ge"}


class _Opaque(Exception):
    """A guard expression with a function this converter does not know."""


def _to_expr(e: sympy.Basic, where: dict[sympy.Symbol, Expr]) -> Expr:
    if e is sympy.true or e is sympy.false:
        return const(bool(e))
    if isinstance(e, sympy.Symbol):
        if e not in where:
            raise _Opaque(str(e))
        return where[e]
    if isinstance(e, sympy.Integer):
        return const(int(e))
    if isinstance(e, (sympy.Rational, sympy.Float)):
        return const(float(e))
    args = [_to_expr(a, where) for a in e.args]
    for cls, op in _CMP.items():
        if isinstance(e, cls):
            return call(op, *args)
    name = type(e).__name__
    fold = {sympy.Add: "add", sympy.Mul: "mul", sympy.And: "and", sympy.Or: "or"}
    for cls, op in fold.items():
        if isinstance(e, cls):
            out = args[0]
            for a in args[1:]:
                out = call(op, out, a)
            return out
    if isinstance(e, sympy.Not):
        return call("not", args[0])
    if isinstance(e, sympy.Pow) and isinstance(e.args[1], sympy.Integer) and int(e.args[1]) >= 0:
        return call("pow", *args)
    named = {"FloorDiv": "floordiv", "PythonMod": "mod", "Mod": "mod", "Max": "max", "Min": "min"}
    if name in named and len(args) == 2:
        return call(named[name], *args)
    raise _Opaque(name)


def _fakes(bound: dict[str, Any], paths: list[str], env: ShapeEnv, mode: FakeTensorMode
           ) -> tuple[list[torch.Tensor], dict[sympy.Symbol, tuple[str, int]]]:
    from torch._dynamo.source import LocalSource
    fakes, owner = [], {}
    for i, p in enumerate(paths):
        t = bound[p]
        ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * t.dim())
        f = mode.from_tensor(t, source=LocalSource(f"t{i}"), symbolic_context=ctx)
        for d, n in enumerate(f.shape):
            if isinstance(n, torch.SymInt) and isinstance(n.node.expr, sympy.Symbol):
                owner.setdefault(n.node.expr, (p, d))
        fakes.append(f)
    return fakes, owner


def _symbolic_mode() -> tuple[ShapeEnv, FakeTensorMode]:
    """A shape env with no duck sizing and a fake mode over it. The fake mode's dispatch cache is off:
    with symbolic sizes each entry is checked and rebuilt through the shape env's sympy, and a spec's
    ops are seldom repeated at one shape within one trace (an 8-layer llama's first generate on the CPU:
    2.86 s with the cache, 2.06 s without)."""
    env = ShapeEnv(duck_shape=False)
    _no_source_locations(env)
    mode = FakeTensorMode(shape_env=env, allow_non_fake_inputs=True)
    mode.cache_enabled = False
    return env, mode


def _no_source_locations(env: ShapeEnv) -> None:
    """The shape env records where each symbol and guard came from, for its error messages, by walking the
    stack past "uninteresting" files; the first walk imports torch.export, aot_autograd, inductor's sizevars
    and networkx to name them (0.5 s of a first generate on the CPU, more than the trace itself). The
    guards here are read as expressions, never reported, so every location is one fixed string."""
    try:
        from torch._guards import SLoc
    except ImportError:  # another torch: keep its own
        return
    here = SLoc("torch_cubridge size trace", None)
    env._get_stack_summary = lambda is_debug=False, framework_loc=None: (here, "")


def symbolic_fakes(tensors: dict[str, torch.Tensor]) -> tuple[ShapeEnv, FakeTensorMode, dict[str, torch.Tensor],
                                                                dict[sympy.Symbol, tuple[str, int]]]:
    """Fakes of `tensors` whose every size is its own symbol: (shape env, mode, fakes by path,
    symbol -> (path, dim))."""
    env, mode = _symbolic_mode()
    paths = list(tensors)
    fakes, owner = _fakes(tensors, paths, env, mode)
    return env, mode, dict(zip(paths, fakes)), owner


def _value_symbols(gm: torch.fx.GraphModule) -> set[sympy.Symbol]:
    """Symbols of sizes that reach an aten op as a scalar value (not a shape list)."""
    out: set[sympy.Symbol] = set()
    for n in gm.graph.nodes:
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
            continue
        for a in list(n.args) + list(n.kwargs.values()):
            v = a.meta.get("val") if isinstance(a, torch.fx.Node) else None
            if isinstance(v, _SYM):
                out |= v.node.expr.free_symbols
    return out


def symbolic_trace(fn: Callable, bound: dict[str, Any], paths: list[str]):
    """fn traced over fakes whose every size is a symbol: (graph, shape env, symbol -> (path, dim)),
    or None when the trace fails. A trace of the same function at other sizes is reused where every
    decision it recorded holds at these (`tracereuse`)."""
    def trace():
        env, mode = _symbolic_mode()
        fakes, owner = _fakes(bound, paths, env, mode)
        try:
            with TRACE_LOCK, mode, quiet_meta_failures():
                gm = make_fx(spec_over(fn, bound, paths), tracing_mode="symbolic")(*fakes)
        except Exception:
            return None
        return (gm, env, owner), layout_exprs(dict(zip(paths, fakes)))
    return reused(fn, bound, paths, trace)


def size_guards(fn: Callable, bound: dict[str, Any], seq_dims: tuple[tuple[str, int], ...],
                pinned: frozenset[tuple[str, int]] = frozenset()
                ) -> tuple[tuple[Expr, ...], frozenset[tuple[str, int]]] | None:
    """(guards over the call's sizes, the pinned sizes the spec never reads), or None when the symbolic
    trace fails (then pin every size).

    seq_dims: (path, dim) of the query and key sequence axes, which generalisation owns. pinned:
    (path, dim) the caller pins to the call's size: their values are put into every other decision,
    and a decision that then always holds is dropped (a paged spec's reshapes, once the page pool's
    sizes are fixed, say nothing more). A pinned size the spec never reads (`unread_sizes`: a page pool's
    page count, where pages are reached only through a table's entries) is returned instead of pinned:
    the program is the same at every value of it.
    The trace runs once per code, shapes and module attributes read (`tracememo`).
    """
    return memoised(fn, bound, (seq_dims, tuple(sorted(pinned))), lambda b: _size_guards(fn, b, seq_dims, pinned))


def _read_symbols(gm: torch.fx.GraphModule) -> set[sympy.Symbol]:
    """Symbols of every size an op of the trace takes as an argument (a view's shape, an arange's end, a
    scalar), or an expression of one; a size op itself (`sym_size`) only names it."""
    skip = {torch.ops.aten.sym_size.int, torch.ops.aten.sym_stride.int, torch.ops.aten.sym_numel.default,
            torch.ops.aten.sym_storage_offset.default}
    out: set[sympy.Symbol] = set()

    def visit(a: Any) -> None:
        if isinstance(a, (list, tuple)):
            for x in a:
                visit(x)
        elif isinstance(a, dict):
            for x in a.values():
                visit(x)
        elif isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), _SYM):
            out.update(a.meta["val"].node.expr.free_symbols)
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target not in skip:
            visit(n.args)
            visit(n.kwargs)
    return out


def unread_sizes(gm: torch.fx.GraphModule, env: ShapeEnv, owner: dict[sympy.Symbol, tuple[str, int]]
                 ) -> frozenset[tuple[str, int]]:
    """(path, dim) of the argument sizes the traced spec never reads: no op takes the size or an expression
    of it as an argument, no decision of the spec's Python names it, and no other size was found equal to
    it. A program holds at every value of such a size: nothing it computes was given it."""
    read = _read_symbols(gm)
    for g in env.guards:
        read |= g.expr.free_symbols
    tied = {env.replace(x) for x in owner if env.replace(x) != x}
    read |= {x for x in owner if env.replace(x) != x} | {s for t in tied for s in t.free_symbols}
    return frozenset(pd for s, pd in owner.items() if s not in read)


def sizes_equal_to(fn: Callable, bound: dict[str, Any], path: str, d: int) -> tuple[tuple[str, int], ...] | None:
    """(argument, dim) of every tensor argument size the symbolic trace found equal to `path`'s dim `d` (itself
    included, in argument order): the sizes that must move together with it, found by the spec's own ops (a
    batch matmul broadcasting q's batch against a gathered K's). None where the trace fails, or found the size
    equal to a number or an expression of other sizes (it cannot move alone)."""
    paths = [p for p, v in bound.items() if isinstance(v, torch.Tensor)]
    traced = symbolic_trace(fn, bound, paths)
    if traced is None:
        return None
    _, env, owner = traced
    mine = [s for s, pd in owner.items() if pd == (path, d)]
    if not mine or not env.replace(mine[0]).is_Symbol:
        return None
    cls = env.replace(mine[0])
    return tuple(sorted((pd for s, pd in owner.items() if env.replace(s) == cls), key=lambda pd: (paths.index(pd[0]), pd[1])))


def _size_guards(fn: Callable, bound: dict[str, Any], seq_dims: tuple[tuple[str, int], ...],
                 pinned: frozenset[tuple[str, int]] = frozenset()
                 ) -> tuple[tuple[Expr, ...], frozenset[tuple[str, int]]] | None:
    paths = [p for p, v in bound.items() if isinstance(v, torch.Tensor)]
    traced = symbolic_trace(fn, bound, paths)
    if traced is None:  # code only a static trace survives: the caller pins every size
        return None
    gm, env, owner = traced
    unread = unread_sizes(gm, env, owner) & pinned
    pinned = pinned - unread
    where = {s: dim(p, d) for s, (p, d) in owner.items()}
    value = {env.replace(s) for s in _value_symbols(gm)}
    seq = {env.replace(s) for s, pd in owner.items() if pd in seq_dims}
    canon: dict[sympy.Basic, list[sympy.Symbol]] = {}
    for s in owner:
        canon.setdefault(env.replace(s), []).append(s)
    # equalities and pins in canonical form (each size against its class's representative),
    # then every other decision the spec's Python made
    facts = [sympy.Eq(s, env.replace(s)) for s in owner if env.replace(s) != s]
    facts += [g.expr for g in env.guards if not _is_equality(g.expr)]
    # a stride's own symbol: decisions about memory layout (a stride against a size), which the program
    # does not make (it reads every tensor through its strides); pinning the sizes they name would make
    # a packed continuous-batching mask ([1, 1, Q, K], stride K) pin the key length every step
    strides = {s for s, srcs in env.var_to_sources.items() if any(".stride()" in _source_name(src) for src in srcs)}
    fixed = {s: int(bound[p].shape[d]) for s, (p, d) in owner.items() if (p, d) in pinned}
    # a class of equal sizes is fixed only where every member is pinned (never a moving length)
    fixed.update({env.replace(s): n for s, n in list(fixed.items()) if env.replace(s).is_Symbol
                  and all(m in fixed for m in canon.get(env.replace(s), ()))})
    out: list[Expr] = []
    for f in facts:
        if f.free_symbols & strides:
            continue
        if fixed and f.free_symbols & set(fixed):
            g = f.subs(fixed)
            if g is sympy.true:
                continue  # the pins imply it
            if g.free_symbols and g is not sympy.false:
                f = g
        try:
            out.append(_to_expr(f, where))
        except _Opaque:  # pin what it speaks of
            out += [call("eq", where[s], const(int(bound[owner[s][0]].shape[owner[s][1]])))
                    for s in f.free_symbols if s in where]
    for c in value - seq:
        for s in c.free_symbols:
            for orig in canon.get(s, [s]):
                if orig in where:
                    p, d = owner[orig]
                    out.append(call("eq", where[orig], const(int(bound[p].shape[d]))))
    return _unique(out), unread


def _source_name(src: Any) -> str:
    """A symbol's source as text (`name` is a method in some torch versions, a property in others)."""
    n = getattr(src, "name", "")
    return str(n() if callable(n) else n)


def _is_equality(e: sympy.Basic) -> bool:
    """Eq of two sizes or a size and a number: the replacements already say it."""
    return isinstance(e, sympy.Eq) and all(isinstance(a, (sympy.Symbol, sympy.Integer)) for a in e.args)


def pin_all(bound: dict[str, Any]) -> tuple[Expr, ...]:
    """Every size of every tensor argument equal to the example's."""
    return tuple(call("eq", dim(p, d), const(int(n)))
                 for p, v in bound.items() if isinstance(v, torch.Tensor) for d, n in enumerate(v.shape))


def value_guards(fn: Callable, bound: dict[str, Any]) -> tuple[Expr, ...]:
    """Python scalar arguments are constants of the capture: each call must pass the same."""
    import inspect
    defaults = {n: p.default for n, p in inspect.signature(fn).parameters.items()
                if p.default is not inspect.Parameter.empty}
    out = []
    for p, v in bound.items():
        if isinstance(v, (bool, int, float, str)) or v is None:
            d = defaults.get(p, inspect.Parameter.empty)
            leaf = arg(p, d) if d is not inspect.Parameter.empty and type(d) is type(v) and d == v else arg(p)
            out.append(call("eq", leaf, const(v)))
    return tuple(out)


def _unique(gs: list[Expr]) -> tuple[Expr, ...]:
    seen, out = set(), []
    for g in gs:
        if g not in seen and g != const(True):
            seen.add(g)
            out.append(g)
    return tuple(out)
