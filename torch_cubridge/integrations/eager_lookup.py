"""The eager attention function of an attention module, found by the lookup its own code performs.

A transformers attention module picks its function from the attention interface by the configured
implementation, with its eager function as the fallback:

    attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_fn)
    # or: attention_interface = eager_fn
    #     if self.config._attn_implementation != "eager":
    #         attention_interface = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]

What "eager" means for the module is that same lookup performed with "eager". The code that called the
drop-in is read (its source, parsed), each lookup in it is found (`get_interface`, `get`, `getattr` on the
interface, or a subscript of it guarded by an assignment of the fallback to the same name), its names are
resolved as the running code resolves them (the frame's locals, its globals, the builtins), and the lookup
is repeated with "eager". Lookups by a constant name ("sdpa") are not the dispatch and are ignored. The answer
is used only when every lookup in the code agrees on one function; else there is no answer and the reason
says why: a guessed function would compute something else than the model.
"""
from __future__ import annotations

import ast
import builtins
import functools
import inspect
import textwrap
import types
from dataclasses import dataclass
from typing import Any, Callable

_LOOKUP_METHODS = ("get_interface", "get")  # interface methods that take (implementation, fallback)


@dataclass(frozen=True)
class _Lookup:
    """One lookup in a function: the interface expression, how it is looked up, and the fallback expression."""
    interface: ast.expr
    how: str  # "method:<name>", "getattr" or "subscript"
    fallback: tuple[ast.expr, ...]  # for a guarded subscript, each other value assigned to its target


@dataclass(frozen=True)
class EagerLookup:
    """The function eager would call (None when it cannot be told), and why; `lookups`: how many lookups
    in the attention interface the code makes (none: the dispatch is made by other code)."""
    fn: Callable | None
    reason: str
    lookups: int = 0


def _is_str(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def _own_nodes(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.AST]:
    """The nodes of a function's body (not its decorators or defaults, which run elsewhere), without those
    of functions defined inside it (other code objects)."""
    out: list[ast.AST] = []
    todo: list[ast.AST] = list(fn.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        out.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return out


def _target_names(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Assign):
        return [t.id for t in node.targets if isinstance(t, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
        return [node.target.id]
    return []


def _lookups(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[_Lookup]:
    nodes = _own_nodes(fn)
    assigned: dict[str, list[ast.expr]] = {}
    for n in nodes:
        for name in _target_names(n):
            assigned.setdefault(name, []).append(n.value)  # type: ignore[attr-defined]
    found = []
    for n in nodes:
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in _LOOKUP_METHODS:
            args = list(n.args) + [k.value for k in n.keywords if k.arg == "default"]
            if len(args) == 2 and not _is_str(args[0]):
                found.append(_Lookup(n.func.value, f"method:{n.func.attr}", (args[1],)))
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "getattr":
            if len(n.args) == 3 and not _is_str(n.args[1]):
                found.append(_Lookup(n.args[0], "getattr", (n.args[2],)))
        elif isinstance(n, ast.Subscript) and isinstance(n.ctx, ast.Load) and not _is_str(n.slice):
            # the guarded form: the fallback is every other value the same name is given in this function
            targets = [name for m in nodes for name in _target_names(m) if getattr(m, "value", None) is n]
            others = tuple(v for t in targets for v in assigned.get(t, []) if v is not n)
            found.append(_Lookup(n.value, "subscript", others))
    return found


@functools.lru_cache(maxsize=None)
def _code_lookups(code: types.CodeType) -> tuple[list[_Lookup], str]:
    """The lookups in the function whose code this is, parsed from its source once."""
    try:
        lines, _ = inspect.getsourcelines(code)
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except (OSError, TypeError, SyntaxError, IndentationError) as e:
        return [], f"the source of {code.co_name} cannot be read ({type(e).__name__})"
    defs = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    if len(defs) != 1 or defs[0].name != code.co_name:
        return [], f"the source of {code.co_name} is not one function"
    return _lookups(defs[0]), ""


class _Scope:
    """Names as the running code resolves them: its locals (and cells), then its globals, then builtins."""

    def __init__(self, code: types.CodeType, local: Callable[[], dict[str, Any]], globals_: dict[str, Any]) -> None:
        self.code, self._local, self.globals = code, local, globals_
        self._locals: dict[str, Any] | None = None

    def name(self, name: str) -> Any:
        code = self.code
        if name in code.co_varnames or name in code.co_cellvars or name in code.co_freevars:
            if self._locals is None:
                self._locals = self._local()
            if name not in self._locals:
                raise LookupError(f"local {name!r} is unbound")
            return self._locals[name]
        if name in self.globals:
            return self.globals[name]
        if hasattr(builtins, name):
            return getattr(builtins, name)
        raise LookupError(f"name {name!r} is not defined")

    def value(self, node: ast.expr) -> Any:
        """A name or a chain of attributes of a name; any other expression is not evaluated."""
        if isinstance(node, ast.Name):
            return self.name(node.id)
        if isinstance(node, ast.Attribute):
            return getattr(self.value(node.value), node.attr)
        raise LookupError(f"{ast.unparse(node)!r} is not a name")


def _interface_type() -> type | None:
    try:
        from transformers import AttentionInterface
    except ImportError:
        return None
    return AttentionInterface


def _eager_of(lookup: _Lookup, scope: _Scope, interface: type) -> Callable | None:
    """The lookup repeated with "eager", or None where it is not a lookup in the attention interface."""
    try:
        table = scope.value(lookup.interface)
    except Exception:  # noqa: BLE001  (any other subscript or call of the code: not a lookup)
        return None
    if not isinstance(table, interface):
        return None
    if lookup.how == "getattr":
        return getattr(table, "eager", scope.value(lookup.fallback[0]))
    if lookup.how.startswith("method:"):
        return getattr(table, lookup.how.partition(":")[2])("eager", scope.value(lookup.fallback[0]))
    if "eager" in table:  # a subscript with "eager": the interface's own "eager" (an override) if it has one
        return table["eager"]
    values = {id(v): v for v in (scope.value(f) for f in lookup.fallback)}
    if len(values) != 1:
        raise LookupError(f"{len(values)} fallbacks are assigned beside the interface's subscript")
    return next(iter(values.values()))


def resolve(code: types.CodeType, local: Callable[[], dict[str, Any]], globals_: dict[str, Any]) -> EagerLookup:
    """The function that the lookups in `code` give for "eager", names resolved in this scope."""
    interface = _interface_type()
    if interface is None:
        return EagerLookup(None, "transformers' AttentionInterface cannot be imported")
    lookups, why = _code_lookups(code)
    if why:
        return EagerLookup(None, why)
    scope = _Scope(code, local, globals_)
    name = getattr(code, "co_qualname", code.co_name)
    found: dict[int, Callable] = {}
    seen = 0
    try:
        for lookup in lookups:
            fn = _eager_of(lookup, scope, interface)
            if fn is not None:
                found[id(fn)] = fn
                seen += 1
    except (LookupError, AttributeError, TypeError, KeyError) as e:
        return EagerLookup(None, f"{name}'s attention lookup cannot be repeated for eager: {e}", seen + 1)
    if len(found) != 1:
        return EagerLookup(None, f"{name} has {seen} attention-interface lookups with {len(found)} different "
                                 "eager functions" if found else f"{name} has no attention-interface lookup", seen)
    fn = next(iter(found.values()))
    if not callable(fn):
        return EagerLookup(None, f"{name}'s eager fallback {fn!r} is not callable", seen)
    return EagerLookup(fn, "", seen)


def from_frame(frame: types.FrameType) -> EagerLookup:
    """The eager function of the code running in `frame` (the code that called the attention interface)."""
    return resolve(frame.f_code, lambda: dict(frame.f_locals), frame.f_globals)


def from_class(cls: type) -> EagerLookup:
    """The eager function of the forward bound on `cls` (inherited forwards included), without a call:
    its globals and closure cells; locals of a call are unknown, so a lookup that needs one has no answer."""
    fwd = inspect.unwrap(getattr(cls, "forward", None) or (lambda: None))
    code = getattr(fwd, "__code__", None)
    if code is None:
        return EagerLookup(None, f"{cls.__name__}.forward is not a Python function")
    cells = dict(zip(code.co_freevars, (c.cell_contents for c in (fwd.__closure__ or ()))))
    return resolve(code, lambda: cells, fwd.__globals__)


@functools.lru_cache(maxsize=None)
def names_interface(cls: type) -> bool:
    """Whether the forward bound on `cls` names an attention interface among its globals (a cheap test
    before from_class parses it)."""
    interface = _interface_type()
    fwd = inspect.unwrap(getattr(cls, "forward", None) or (lambda: None))
    code, g = getattr(fwd, "__code__", None), getattr(fwd, "__globals__", {})
    return interface is not None and code is not None and any(isinstance(g.get(n), interface) for n in code.co_names)
