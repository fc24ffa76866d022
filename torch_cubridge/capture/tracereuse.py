"""The size-guard trace reused at other sizes, where every decision it recorded holds there.

`guards.symbolic_trace` runs the spec over fakes whose every size is a symbol, and its ShapeEnv records
each decision the spec's Python made on a size. As torch.compile's guards say, that trace answers for any
sizes where those decisions hold: a paged decode at a new batch size need not trace the spec again (0.87 s
of a 1.9 s transfer on the CPU). A trace is reused only for the same function with the same globals,
argument dtypes, devices, sizes of 0 and 1 (the fakes' constants) and plain values, with no module argument
(the memo in `tracememo` covers those), and only where, at the call's sizes, every guard holds, every size
the trace found equal to another still is, and every stride is the one the trace assumed.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable

import sympy
import torch

from .codekey import GlobalsWatch
from .tracememo import _Opaque, _value_key

_CAP = 64
_lock = threading.Lock()
_traces: "OrderedDict[tuple, list[tuple[Callable, GlobalsWatch, Any, dict]]]" = OrderedDict()


def _key(fn: Callable, bound: dict[str, Any], paths: list[str]) -> tuple | None:
    parts = []
    try:
        for p, v in bound.items():
            if isinstance(v, torch.nn.Module):
                return None
            if isinstance(v, torch.Tensor):
                parts.append((p, "tensor", tuple(n if n < 2 else -1 for n in v.shape), str(v.dtype), str(v.device),
                              v.requires_grad))
            else:
                parts.append((p, _value_key(v)))
    except _Opaque:
        return None
    return (id(fn), id(getattr(fn, "__code__", None)), tuple(paths), tuple(parts))


def _expr(n: Any) -> sympy.Basic:
    return n.node.expr if isinstance(n, torch.SymInt) else sympy.Integer(int(n))


def layout_exprs(fakes: dict[str, torch.Tensor]) -> dict[str, tuple]:
    """Each fake's strides and storage offset as the trace assumed them (expressions in its symbols)."""
    return {p: tuple(_expr(s) for s in f.stride()) + (_expr(f.storage_offset()),) for p, f in fakes.items()}


def holds(traced: tuple, layouts: dict[str, tuple], bound: dict[str, Any]) -> bool:
    """Whether a trace taken at other sizes answers for `bound`'s: its symbols take the call's sizes (and a
    stride or offset symbol the call's stride or offset), and then every guard, equality and layout holds."""
    _, env, owner = traced
    values: dict[sympy.Basic, int] = {s: int(bound[p].shape[d]) for s, (p, d) in owner.items()}
    actual = {p: tuple(bound[p].stride()) + (bound[p].storage_offset(),) for p in layouts}
    for p, exprs in layouts.items():
        for e, a in zip(exprs, actual[p]):
            if e.is_Symbol and e not in values:
                values[e] = a
    try:
        for p, exprs in layouts.items():
            if any(e.subs(values) != a for e, a in zip(exprs, actual[p])):
                return False
        for s in owner:
            r = env.replace(s)
            if r != s and sympy.sympify(r).subs(values) != values[s]:
                return False
        return all(bool(g.expr.subs(values) is sympy.true) for g in env.guards)
    except Exception:  # an expression this check cannot evaluate: trace again
        return False


def reused(fn: Callable, bound: dict[str, Any], paths: list[str],
           trace: Callable[[], tuple[tuple, dict[str, tuple]] | None]) -> tuple | None:
    """trace()'s (graph, shape env, owner), or an earlier one of the same key that holds at these sizes.
    trace returns ((graph, env, owner), layouts) or None."""
    key = _key(fn, bound, paths)
    if key is None:
        got = trace()
        return None if got is None else got[0]
    with _lock:
        entries = list(_traces.get(key, ()))
    for owner_fn, watch, traced, layouts in entries:
        if owner_fn is fn and watch.unchanged() and holds(traced, layouts, bound):
            return traced
    watch = GlobalsWatch(fn)  # before the trace: the values it reads
    got = trace()
    if got is None:
        return None
    with _lock:
        _traces.setdefault(key, []).append((fn, watch, got[0], got[1]))
        _traces.move_to_end(key)
        while len(_traces) > _CAP:
            _traces.popitem(last=False)
    return got[0]


def clear() -> None:
    with _lock:
        _traces.clear()
