"""The per-call argument signature: the dictionary key from a call to its program.

It must be cheap (microseconds): dtypes, devices, ranks, which dims are 1,
and non-tensor values. Sizes are not in it; programs are generic in sizes
unless generalisation said otherwise, which the entry checks.

Modules and other objects are keyed by identity, never by id(): a program bakes
in what the spec read from them (module.scaling, a softcap, a window), and a new
object can be allocated at a dead one's address. A weak reference names the
object without keeping it alive, and once dead it equals no other reference.
"""
from __future__ import annotations

import weakref
from typing import Any

import torch


_ONE = (1).__eq__
_Tensor = torch.Tensor
_Ref = weakref.ref
_identity_eq = object.__eq__


class _Pinned:
    """An object no weak reference can key (no weakref support, or an __eq__ of its own): held, so
    its address cannot be reused while the key lives, and equal only to itself."""
    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Pinned) and other.obj is self.obj


def _same(v: Any) -> Any:
    """A key part equal only to `v` itself, for as long as it lives."""
    if type(v).__eq__ is _identity_eq:  # a live weakref compares its referents with ==: identity only
        try:
            r = _Ref(v)
            hash(r)  # __hash__ = None would fail at the table lookup instead
            return r
        except TypeError:
            pass
    return _Pinned(v)


_TENSOR, _MODULE, _PLAIN, _SEQ, _OTHER = range(5)
# an argument's branch below depends on its type alone: found once per type, then one dict lookup
_KIND: dict[type, int] = {}


def _kind(t: type) -> int:
    if issubclass(t, _Tensor):
        k = _TENSOR
    elif issubclass(t, torch.nn.Module):
        k = _MODULE
    elif issubclass(t, (int, float, bool, str, type(None), torch.dtype)):
        k = _PLAIN
    elif issubclass(t, (tuple, list)):
        k = _SEQ
    else:
        k = _OTHER
    _KIND[t] = k
    return k


def _meta(v: Any) -> Any:
    k = _KIND.get(type(v))
    if k is None:
        k = _kind(type(v))
    if k == _TENSOR:  # map with a C-level predicate: this runs on every call
        return (v.dtype, v.get_device(), tuple(map(_ONE, v.shape)))
    if k == _PLAIN:
        return v
    if k == _MODULE:
        return (type(v).__name__, _same(v))
    if k == _SEQ:
        return tuple(_meta(x) for x in v)
    return (type(v).__name__, _same(v))


_c_signature: Any = None  # the host fast path module's build of python_signature, once loaded (adopt_c)


def call_signature(args: tuple, kwargs: dict) -> tuple:
    c = _c_signature
    if c is not None:
        return c(args, kwargs)
    return python_signature(args, kwargs)


def python_signature(args: tuple, kwargs: dict) -> tuple:
    key = tuple(map(_meta, args))
    if kwargs:
        key += tuple((k, _meta(v)) for k, v in sorted(kwargs.items()))
    return key


def adopt_c(module: Any) -> bool:
    """Serve call_signature from the host fast path's C module (csrc/host/signature.h: this file's rule
    for each kind, key for key, on this file's kinds table) where it has one; returns whether it does."""
    global _c_signature
    fn, configure = getattr(module, "signature", None), getattr(module, "configure_signature", None)
    if fn is None or configure is None:
        return False
    configure(_KIND, _kind, _same, _ONE, (_TENSOR, _PLAIN, _SEQ))  # modules and the rest: by identity
    _c_signature = fn
    return True


def _meta_traceable(v: Any) -> Any:
    if isinstance(v, _Tensor):
        return (v.dtype, v.get_device(), tuple(n == 1 for n in v.shape))
    if isinstance(v, (tuple, list)):
        return tuple(_meta_traceable(x) for x in v)
    if isinstance(v, torch.nn.Module) and not any("__eq__" in c.__dict__ for c in type(v).__mro__[:-1]):
        # dynamo does not see `type(v).__eq__ is object.__eq__`; without this the key would hold a
        # _Pinned, which equals no eager key (and torch 2.11's dynamo cannot hash it)
        return (type(v).__name__, _Ref(v))
    return _meta(v)


def traced_signature(args: tuple, kwargs: dict) -> tuple:
    """call_signature's key, in code torch.compile can trace (no C-level method wrappers)."""
    key = tuple(_meta_traceable(a) for a in args)
    if kwargs:
        key += tuple((k, _meta_traceable(kwargs[k])) for k in sorted(kwargs))  # dynamo sorts constant keys only
    return key


def alive(key: tuple) -> bool:
    """False once an object the key names has died: no call can hit its entries again."""
    for part in key:
        if type(part) is _Ref and part() is None:
            return False
        if type(part) is tuple and not alive(part):
            return False
    return True
