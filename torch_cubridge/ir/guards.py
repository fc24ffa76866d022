"""Guards: the conditions on a call under which a program holds.

A guard is a boolean CuIR expression over the call itself: sizes of its
arguments (`dim` leaves, "path:i") and Python scalar arguments (`arg` leaves).
Capture records one for every decision the spec's Python made on a size, for
every size a constant was computed from, and for every Python argument baked
into the program. A call that fails one is not served by that program.

Guards compile once per call layout into one generated function. Its source
holds only operators, indices and fixed names: every constant, argument name
and attribute comes from a side table, so a program read from JSON stays data
and cannot inject code. A refusal names its guard: single-guard checks are
generated only when the conjunction fails.
"""
from __future__ import annotations

import math
from typing import Any, Callable

from .expr import Expr

Getter = Callable[[tuple, dict], Any]


_INFIX = {"add": "+", "sub": "-", "mul": "*", "div": "/", "floordiv": "//", "mod": "%", "pow": "**",
          "eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">=", "and": "and", "or": "or"}
_CALLS = {"max": "max", "min": "min", "abs": "abs", "floor": "_floor", "to_float": "float", "to_int": "int",
          "to_bool": "bool", "sqrt": "_sqrt", "log": "_log", "exp": "_exp"}


class _Source:
    """Python source for a guard conjunction; constants and names live in the table `K`."""

    def __init__(self, signature: tuple[str, ...], nargs: int) -> None:
        self.signature, self.nargs = signature, nargs
        self.table: list[Any] = []
        self.shapes: dict[str, str] = {}   # access code -> local holding its .shape, read once

    def k(self, value: Any) -> str:
        self.table.append(value)
        return f"K[{len(self.table) - 1}]"

    def access(self, path: str, default: Expr | None = None) -> str:
        names = list(self.signature)
        head, _, tail = path.partition(".")
        star = next((i for i, n in enumerate(names) if n.startswith("*") and not n.startswith("**")), len(names))
        parts = [p for p in tail.split(".") if p]
        if path in names and names.index(path) < min(self.nargs, star):
            base, parts = f"a[{names.index(path)}]", []
        elif f"*{head}" in names and parts and parts[0].isdigit():
            base, parts = f"a[{star + int(parts[0])}]", parts[1:]
        elif f"**{head}" in names and parts:
            base, parts = f"kw[{self.k(parts[0])}]", parts[1:]
        elif head in names and names.index(head) < min(self.nargs, star):
            base = f"a[{names.index(head)}]"
        elif default is not None and not parts:
            return f"kw.get({self.k(head)}, {self.k(default.attr)})"
        else:
            base = f"kw[{self.k(head)}]"
        for part in parts:
            base = f"getattr({base}, {self.k(part)})"
        return base

    def expr(self, e: Expr) -> str:
        op = e.op
        if op == "const":
            return self.k(e.attr)
        if op == "dim":
            path, _, i = e.attr.rpartition(":")
            base = self.access(path)
            local = self.shapes.setdefault(base, f"S{len(self.shapes)}")
            return f"{local}[{int(i)}]"
        if op == "arg":
            return self.access(e.attr, e.args[0] if e.args else None)
        if op == "where":
            c, x, y = (self.expr(a) for a in e.args)
            return f"({x} if {c} else {y})"
        if op == "neg":
            return f"(-{self.expr(e.args[0])})"
        if op == "not":
            return f"(not {self.expr(e.args[0])})"
        if op in _INFIX:
            return f"({self.expr(e.args[0])} {_INFIX[op]} {self.expr(e.args[1])})"
        if op in _CALLS:
            return f"{_CALLS[op]}({', '.join(self.expr(a) for a in e.args)})"
        raise ValueError(f"guards cannot use CuIR op {op!r}")


_SCOPE = {"_floor": math.floor, "_sqrt": math.sqrt, "_log": math.log, "_exp": math.exp,
          "__builtins__": {"max": max, "min": min, "abs": abs, "float": float, "int": int, "bool": bool,
                           "getattr": getattr, "Exception": Exception, "KeyError": KeyError,
                           "IndexError": IndexError}}


def _define(code: str, src: _Source) -> Callable[[tuple, dict], Any]:
    scope = dict(_SCOPE, K=src.table)
    exec(compile(code, "<cubridge guards>", "exec"), scope)  # noqa: S102 - source has no data in it, see _Source
    return scope["f"]


def _generate(guards: tuple[Expr, ...], signature: tuple[str, ...], nargs: int) -> Callable[[tuple, dict], bool]:
    src = _Source(signature, nargs)
    body = " and ".join(src.expr(g) for g in guards) or "True"
    loads = "".join(f"        {local} = {base}.shape\n" for base, local in src.shapes.items())
    return _define(f"def f(a, kw):\n    try:\n{loads}        return bool({body})\n"
                   "    except Exception:\n        return False\n", src)


def reader(signature: tuple[str, ...], nargs: int, path: str) -> Getter:
    """A getter for `path` ("q", "args.2", "kwargs.mask", "module.sinks") in calls with nargs positionals."""
    src = _Source(signature, nargs)
    return _define(f"def f(a, kw):\n    return {src.access(path)}\n", src)


class GuardSet:
    """The compiled guards of one program for one call layout (signature, positional count)."""

    def __init__(self, guards: tuple[Expr, ...], signature: tuple[str, ...], nargs: int) -> None:
        self.guards = guards
        self._layout = (signature, nargs)
        self._fast = _generate(guards, signature, nargs)
        self._each: list[Callable[[tuple, dict], bool]] | None = None  # per guard, built on first refusal

    def failing(self, args: tuple, kwargs: dict) -> Expr | None:
        """The first guard the call violates, or None when all hold."""
        if self._fast(args, kwargs):
            return None
        if self._each is None:
            self._each = [_generate((g,), *self._layout) for g in self.guards]
        for g, check in zip(self.guards, self._each):
            if not check(args, kwargs):  # a missing argument or dim fails its guard; never raises
                return g
        return None

    def __call__(self, args: tuple, kwargs: dict) -> bool:
        return self._fast(args, kwargs)


def bound_failing(guards: tuple[Expr, ...], bound: dict[str, Any]) -> Expr | None:
    """The first guard violated by a bound-argument dict (paths as keys), or None."""
    keys = tuple(bound)
    args = tuple(bound[k] for k in keys)
    return GuardSet(guards, keys, len(keys)).failing(args, {})
