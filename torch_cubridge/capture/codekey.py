"""A key over everything a spec's Python can read besides its arguments, as Triton's JIT keys a
kernel: the function's code, defaults and closure, and every global it names (functions it calls,
recursively; library modules by name and version; plain constants by value).

Where the key exists, a new process may look up the program an earlier process verified for the
same key and call signature, and skip capture. Where anything the spec reads could change without
changing the key (a user module's attributes, a mutable container, a tensor held in a closure), there
is no key: `code_key` returns None and capture runs as usual.
"""
from __future__ import annotations

import builtins
import hashlib
import operator
import sys
import types
from typing import Any, Callable

# library packages whose behaviour is fixed by their version (a user's own module is not: its
# attributes can be reassigned between calls without any code changing)
_LIBRARIES = {"torch", "numpy", "einops", "math", "operator", "functools", "typing", "builtins"}
PLAIN = (int, float, bool, str, bytes, type(None))  # values compared (and hashed) by value


class _NoKey(Exception):
    pass


def code_key(fn: Callable) -> str | None:
    """The key of fn's code and everything it reads besides its arguments, or None."""
    h = hashlib.sha256()
    try:
        _function(fn, h, set())
    except _NoKey:
        return None
    return h.hexdigest()[:32]


def _library_version(name: str) -> str | None:
    top = name.split(".")[0]
    if top not in _LIBRARIES and top not in getattr(sys, "stdlib_module_names", ()):
        return None
    return str(getattr(sys.modules.get(top), "__version__", sys.version))


def _value(v: Any, h: "hashlib._Hash", seen: set[int]) -> None:
    if isinstance(v, PLAIN):
        h.update(f"{type(v).__name__}:{v!r}\n".encode())
    elif isinstance(v, tuple):
        h.update(b"(")
        for x in v:
            _value(x, h, seen)
        h.update(b")")
    elif isinstance(v, types.ModuleType):
        h.update(f"module:{v.__name__}:{_library(v.__name__)}\n".encode())
    elif _is_user_function(v):
        _function(v, h, seen)  # the user's own helper: its code and what it reads
    elif isinstance(v, (types.FunctionType, types.BuiltinFunctionType, types.BuiltinMethodType, type)) \
            or type(v).__module__ == "torch._ops":
        # library functions and classes, builtins, torch ops: named by where they live
        mod = getattr(v, "__module__", None) or "builtins"
        h.update(f"object:{mod}.{getattr(v, '__qualname__', getattr(v, '__name__', ''))}:{_library(mod)}\n".encode())
    elif type(v).__module__ == "torch" and type(v).__name__ in ("dtype", "device"):
        h.update(f"{type(v).__name__}:{v}\n".encode())
    else:  # tensors, containers, instances (nn.Module too): their contents change under one key
        raise _NoKey(type(v).__name__)


def _is_user_function(v: Any) -> bool:
    """A Python function outside the libraries: its code and what it reads belong to the spec."""
    return isinstance(v, types.FunctionType) and _library_version(v.__module__ or "") is None


def _library(name: str) -> str:
    ver = _library_version(name)
    if ver is None:
        raise _NoKey(name)
    return ver


def _function(fn: Any, h: "hashlib._Hash", seen: set[int]) -> None:
    if not isinstance(fn, types.FunctionType):
        _value(fn, h, seen)
        return
    if id(fn) in seen:  # recursion: the code is hashed once
        h.update(f"again:{fn.__qualname__}\n".encode())
        return
    seen.add(id(fn))
    h.update(f"function:{fn.__module__}.{fn.__qualname__}\n".encode())
    names: set[str] = set()
    _code(fn.__code__, h, names)
    _value(fn.__defaults__ or (), h, seen)
    for k, v in sorted((fn.__kwdefaults__ or {}).items()):
        h.update(k.encode())
        _value(v, h, seen)
    for cell in fn.__closure__ or ():
        try:
            _value(cell.cell_contents, h, seen)
        except ValueError:  # an empty cell (a name bound later)
            raise _NoKey("empty closure cell") from None
    for name in sorted(names):
        if name in fn.__globals__:
            h.update(f"global:{name}\n".encode())
            _value(fn.__globals__[name], h, seen)
        elif hasattr(builtins, name):
            h.update(f"builtin:{name}\n".encode())
        # else: an attribute name (q.shape, torch.softmax): its object is hashed where it is looked up


def _code(c: types.CodeType, h: "hashlib._Hash | None", names: set[str]) -> None:
    """Collect every name c (and the code nested in it) reads; hash the code too unless h is None."""
    names.update(c.co_names)
    if h is not None:
        h.update(c.co_code)
        h.update(repr(c.co_names).encode())
    for k in c.co_consts:
        if isinstance(k, types.CodeType):  # nested functions and comprehensions
            _code(k, h, names)
        elif h is not None:
            h.update(f"{type(k).__name__}:{k!r}\n".encode())


_MISSING = object()


class GlobalsWatch:
    """Every global binding and closure cell the spec's code reads (through the user's own helper
    functions too), with the object each held at capture. A program bakes in what the spec read;
    if one of these is rebound (`W = 4`, `nonlocal cap`), no program captured before holds.
    Rebinding is detected, not mutation in place of a tensor or container a global holds."""

    def __init__(self, fn: Callable) -> None:
        self._globals: list[tuple[dict, str, Any]] = []
        self._cells: list[tuple[Any, Any]] = []
        self._by_ns: list[tuple[Callable, tuple, tuple]] | None = None
        self._collect(fn, set())

    def _collect(self, fn: Any, seen: set[int]) -> None:
        if not isinstance(fn, types.FunctionType) or id(fn) in seen:
            return
        seen.add(id(fn))
        names: set[str] = set()
        _code(fn.__code__, None, names)
        for cell in fn.__closure__ or ():
            try:
                v = cell.cell_contents
            except ValueError:
                v = _MISSING
            self._cells.append((cell, v))
            self._collect(v, seen)
        for name in sorted(names):
            v = fn.__globals__.get(name, _MISSING)
            if v is _MISSING:
                continue  # a builtin or an attribute name
            self._globals.append((fn.__globals__, name, v))
            if _is_user_function(v):
                self._collect(v, seen)

    def _namespaces(self) -> list[tuple[dict, tuple, tuple]]:
        """Per namespace: the dict, its watched names and the objects they held."""
        by: dict[int, tuple[dict, list, list]] = {}
        for ns, name, v in self._globals:
            by.setdefault(id(ns), (ns, [], []))[1].append(name)
            by[id(ns)][2].append(v)
        return [(ns, tuple(names), tuple(vals)) for ns, names, vals in by.values()]

    def held(self) -> tuple[tuple, tuple, object]:
        """What the host fast path checks before it replays a launch (csrc/host/hotpath.c `watch_holds`), the
        same test as `unchanged`: ((namespace dict, names, objects held), ...), ((cell, object held), ...) and
        the marker held for an empty cell."""
        return tuple(self._namespaces()), tuple(self._cells), _MISSING

    def unchanged(self) -> bool:
        if self._by_ns is None:  # per namespace: its names' getter and the objects they held (checked per call)
            self._by_ns = [(ns.__getitem__, names, vals) for ns, names, vals in self._namespaces()]
        try:
            for get, names, held in self._by_ns:
                if not all(map(operator.is_, map(get, names), held)):
                    return False
        except KeyError:  # a global deleted
            return False
        for cell, v in self._cells:
            try:
                if cell.cell_contents is not v:
                    return False
            except ValueError:
                if v is not _MISSING:
                    return False
        return True
