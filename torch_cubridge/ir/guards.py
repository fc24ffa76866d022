"""Guards: the conditions on a call under which a program holds.

A guard is a boolean CuIR expression over the call itself: sizes of its
arguments (`dim` leaves, "path:i") and Python scalar arguments (`arg` leaves).
Capture records one for every decision the spec's Python made on a size, for
every size a constant was computed from, and for every Python argument baked
into the program. A call that fails one is not served by that program.

Guards compile to a tree of closures once per call layout (no eval: a program
read from JSON is data, never code), so checking costs well under a microsecond
per guard.
"""
from __future__ import annotations

import math
import operator
from typing import Any, Callable

from .expr import Expr, render

_BINARY: dict[str, Callable[[Any, Any], Any]] = {
    "add": operator.add, "sub": operator.sub, "mul": operator.mul, "div": operator.truediv,
    "floordiv": operator.floordiv, "mod": operator.mod, "max": max, "min": min, "pow": operator.pow,
    "eq": operator.eq, "ne": operator.ne, "lt": operator.lt, "le": operator.le, "gt": operator.gt,
    "ge": operator.ge, "and": lambda a, b: bool(a) and bool(b), "or": lambda a, b: bool(a) or bool(b),
}
_UNARY: dict[str, Callable[[Any], Any]] = {
    "neg": operator.neg, "not": operator.not_, "abs": abs, "floor": math.floor, "to_float": float,
    "to_int": int, "to_bool": bool, "sqrt": math.sqrt, "log": math.log, "exp": math.exp,
}

Call = tuple[tuple, dict]
Getter = Callable[[tuple, dict], Any]


def reader(signature: tuple[str, ...], nargs: int, path: str) -> Getter:
    """A getter for `path` ("q", "args.2", "kwargs.mask", "module.sinks") in calls with nargs positionals."""
    head, _, tail = path.partition(".")
    names = [n for n in signature]
    base: Getter
    star = next((i for i, n in enumerate(names) if n.startswith("*") and not n.startswith("**")), len(names))
    if path in names and names.index(path) < min(nargs, star):  # a bound dict's own key
        i = names.index(path)
        return lambda a, kw: a[i]
    if f"*{head}" in names and tail.split(".")[0].isdigit():
        i = star + int(tail.split(".")[0])
        tail = tail.partition(".")[2]
        base = lambda a, kw, i=i: a[i]  # noqa: E731
    elif f"**{head}" in names:
        key, _, tail = tail.partition(".")
        base = lambda a, kw, key=key: kw[key]  # noqa: E731
    elif head in names and names.index(head) < min(nargs, star):
        i = names.index(head)
        base = lambda a, kw, i=i: a[i]  # noqa: E731
    else:
        base = lambda a, kw, head=head: kw[head]  # noqa: E731
    for part in [p for p in tail.split(".") if p]:
        base = (lambda g, part: lambda a, kw: getattr(g(a, kw), part))(base, part)
    return base


def _compile(e: Expr, get: Callable[[str], Getter]) -> Callable[[tuple, dict], Any]:
    op = e.op
    if op == "const":
        v = e.attr
        return lambda a, kw: v
    if op == "dim":
        path, _, i = e.attr.rpartition(":")
        g, d = get(path), int(i)
        return lambda a, kw: g(a, kw).shape[d]
    if op == "arg":
        g = get(e.attr)
        if not e.args:
            return g
        default = e.args[0].attr  # an argument left out of the call takes the spec's default

        def value(a: tuple, kw: dict) -> Any:
            try:
                return g(a, kw)
            except (IndexError, KeyError):
                return default
        return value
    if op == "where":
        c, x, y = (_compile(x, get) for x in e.args)
        return lambda a, kw: x(a, kw) if c(a, kw) else y(a, kw)
    if op in _UNARY:
        f, x = _UNARY[op], _compile(e.args[0], get)
        return lambda a, kw: f(x(a, kw))
    if op in _BINARY:
        f = _BINARY[op]
        x, y = (_compile(x, get) for x in e.args)
        return lambda a, kw: f(x(a, kw), y(a, kw))
    raise ValueError(f"guards cannot use CuIR op {op!r}")


class GuardSet:
    """The compiled guards of one program for one call layout (signature, positional count)."""

    def __init__(self, guards: tuple[Expr, ...], signature: tuple[str, ...], nargs: int) -> None:
        getters: dict[str, Getter] = {}

        def get(path: str) -> Getter:
            if path not in getters:
                getters[path] = reader(signature, nargs, path)
            return getters[path]
        self.guards = guards
        self._checks = [_compile(g, get) for g in guards]

    def failing(self, args: tuple, kwargs: dict) -> Expr | None:
        """The first guard the call violates, or None when all hold."""
        for g, check in zip(self.guards, self._checks):
            try:
                if not check(args, kwargs):
                    return g
            except Exception:  # a missing argument or dim fails the guard; it never raises
                return g
        return None

    def __call__(self, args: tuple, kwargs: dict) -> bool:
        return self.failing(args, kwargs) is None


def bound_failing(guards: tuple[Expr, ...], bound: dict[str, Any]) -> Expr | None:
    """The first guard violated by a bound-argument dict (paths as keys), or None."""
    keys = tuple(bound)
    args = tuple(bound[k] for k in keys)
    return GuardSet(guards, keys, len(keys)).failing(args, {})


def describe(g: Expr) -> str:
    return render(g)
