"""A memo of the size guards, keyed by everything the symbolic trace saw.

The symbolic trace that derives size guards costs about a second on a CPU, and a transformers model
runs it once per layer although every layer calls the same function on the same shapes. Its result is
a function of: the spec's function and code, the globals and closure cells it reads (as the
dispatch table holds them: rebinding one misses; a container mutated in place is not seen), the sequence
axes, each tensor argument's sizes, strides, dtype and device, each plain argument's value, and the
attributes the spec read from its module arguments. The last are recorded during the trace by a
stand-in (`_Reading`) that forwards every attribute read to the module. A read of anything whose
value the key cannot hold (a submodule, a config object, a call of the module) makes the trace
unmemoisable, and it runs every time, as before.

The stand-in is a single class of this module, not a subclass made per trace: dynamo guards on
`cls.__subclasses__()`, and classes born and collected between its tracing and its guard building
broke a model's torch.compile (benchmarks/NOTES.md v16).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable

import torch

from .codekey import PLAIN, GlobalsWatch

_CAP = 256
_MISSING = ("missing",)
_lock = threading.Lock()
_memo: "OrderedDict[tuple, list[tuple[Callable, GlobalsWatch, tuple, Any]]]" = OrderedDict()


class _Opaque(Exception):
    pass


def _value_key(v: Any) -> Any:
    """A hashable stand-in for v that equals another's exactly when the trace cannot tell them apart."""
    if isinstance(v, PLAIN):
        return (type(v).__name__, v)
    if isinstance(v, tuple):
        return ("tuple",) + tuple(_value_key(x) for x in v)
    if isinstance(v, (torch.dtype, torch.device)):
        return (type(v).__name__, str(v))
    if isinstance(v, torch.Tensor):
        return ("tensor", tuple(v.shape), tuple(v.stride()), str(v.dtype), str(v.device), v.requires_grad)
    raise _Opaque(type(v).__name__)


class _Reading:
    """A module argument's stand-in that records the attributes read (isinstance still holds)."""
    __slots__ = ("_module", "_reads", "_opaque")

    def __init__(self, module: torch.nn.Module) -> None:
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "_reads", {})
        object.__setattr__(self, "_opaque", False)

    @property
    def __class__(self):  # noqa: D401 - isinstance(stand_in, Attention) reads this
        return type(object.__getattribute__(self, "_module"))

    def __getattr__(self, name: str) -> Any:
        m = object.__getattribute__(self, "_module")
        reads = object.__getattribute__(self, "_reads")
        try:
            v = getattr(m, name)
        except AttributeError:
            reads[name] = _MISSING
            raise
        try:
            reads[name] = _value_key(v)
        except _Opaque:
            object.__setattr__(self, "_opaque", True)
        return v

    def __setattr__(self, name: str, v: Any) -> None:  # a spec that writes to its module: no memo
        object.__setattr__(self, "_opaque", True)
        setattr(object.__getattribute__(self, "_module"), name, v)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        object.__setattr__(self, "_opaque", True)
        return object.__getattribute__(self, "_module")(*args, **kwargs)


def _static_key(fn: Callable, bound: dict[str, Any], extra: Any) -> tuple | None:
    parts = []
    try:
        for p, v in bound.items():
            parts.append((p, "module") if isinstance(v, torch.nn.Module) else (p, _value_key(v)))
    except _Opaque:
        return None
    return (id(fn), id(getattr(fn, "__code__", None)), extra, tuple(parts))


def _holds(reads: tuple, bound: dict[str, Any]) -> bool:
    for path, name, want in reads:
        try:
            got = _value_key(getattr(bound[path], name))
        except AttributeError:
            got = _MISSING
        except _Opaque:
            return False
        if got != want:
            return False
    return True


def memoised(fn: Callable, bound: dict[str, Any], extra: Any,
             compute: Callable[[dict[str, Any]], Any]) -> Any:
    """compute(bound) through the memo; compute receives the bound arguments with module stand-ins."""
    key = _static_key(fn, bound, extra)
    if key is None:
        return compute(bound)
    with _lock:
        entries = list(_memo.get(key, ()))
    for owner, watch, reads, result in entries:
        if owner is fn and watch.unchanged() and _holds(reads, bound):
            return result
    watch = GlobalsWatch(fn)
    stand = {p: _Reading(v) for p, v in bound.items() if isinstance(v, torch.nn.Module)}
    result = compute({**bound, **stand})
    if any(object.__getattribute__(s, "_opaque") for s in stand.values()):
        return result
    reads = tuple((p, n, k) for p, s in stand.items()
                  for n, k in sorted(object.__getattribute__(s, "_reads").items()))
    with _lock:
        _memo.setdefault(key, []).append((fn, watch, reads, result))
        _memo.move_to_end(key)
        while len(_memo) > _CAP:
            _memo.popitem(last=False)
    return result


def clear() -> None:
    with _lock:
        _memo.clear()
