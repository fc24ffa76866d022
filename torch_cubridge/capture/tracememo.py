"""A memo of the size guards and of whole transfers, keyed by everything their traces saw.

The symbolic trace that derives size guards costs about a second on a CPU, and a transformers model
runs it once per layer although every layer calls the same function on the same shapes. Its result is
a function of: the spec's function and code, the globals and closure cells it reads (as the
dispatch table holds them: rebinding one misses; a container mutated in place is not seen), the sequence
axes, each tensor argument's sizes, strides, dtype and device, each plain argument's value, and the
attributes the spec read from its module arguments. The last are recorded during the trace by a
stand-in (`_Reading`) that forwards every attribute read to the module. A read of anything whose
value the key cannot hold (a submodule, a config object, a call of the module) makes the trace
unmemoisable, and it runs every time, as before.

A whole transfer (capture, size probes, size guards, CPU verification) is memoised the same way
(memoised_stage): every trace inside it calls the spec through `trace.spec_over`, which hands the spec
stand-ins while the stage records, so the key holds the attributes read by all of them. A layer after
the first of a transformers model then takes the first layer's verified program with no capture: the
layers call one function on the same shapes, with modules whose read attributes are equal.

The stand-in is a single class of this module, not a subclass made per trace: dynamo guards on
`cls.__subclasses__()`, and classes born and collected between its tracing and its guard building
broke a model's torch.compile.
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


class _Sink:
    """Where a stand-in records: the attributes read (name -> value key), and whether the module was
    used in a way the key cannot hold (opaque)."""
    __slots__ = ("reads", "opaque")

    def __init__(self) -> None:
        self.reads: dict[str, Any] = {}
        self.opaque = False


class _Reading:
    """A module argument's stand-in that records the attributes read into its sinks (isinstance still
    holds). A stand-in of a stand-in is one stand-in over the module with both sinks."""
    __slots__ = ("_module", "_sinks")

    def __init__(self, module: Any, sink: _Sink) -> None:
        sinks = (sink,)
        if type(module) is _Reading:
            sinks = object.__getattribute__(module, "_sinks") + sinks
            module = object.__getattribute__(module, "_module")
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "_sinks", sinks)

    def _mark(self, name: str | None, key: Any = None) -> None:
        for sink in object.__getattribute__(self, "_sinks"):
            if name is None:
                sink.opaque = True
            else:
                sink.reads[name] = key

    @property
    def __class__(self):  # noqa: D401 - isinstance(stand_in, Attention) reads this
        return type(object.__getattribute__(self, "_module"))

    def __getattr__(self, name: str) -> Any:
        m = object.__getattribute__(self, "_module")
        mark = object.__getattribute__(self, "_mark")
        try:
            v = getattr(m, name)
        except AttributeError:
            mark(name, _MISSING)
            raise
        try:
            mark(name, _value_key(v))
        except _Opaque:
            mark(None)
        return v

    def __setattr__(self, name: str, v: Any) -> None:  # a spec that writes to its module: no memo
        object.__getattribute__(self, "_mark")(None)
        setattr(object.__getattribute__(self, "_module"), name, v)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        object.__getattribute__(self, "_mark")(None)
        return object.__getattribute__(self, "_module")(*args, **kwargs)


def unwrapped(v: Any) -> Any:
    """The module behind a stand-in (read without recording), or v itself."""
    return object.__getattribute__(v, "_module") if type(v) is _Reading else v


class _Recording(threading.local):
    sinks: dict[str, _Sink] | None = None  # by argument path, while a memoised stage records


_recording = _Recording()


def reading_modules(bound: dict[str, Any]) -> dict[str, Any]:
    """The bound call the spec runs on inside a trace: while a memoised stage records (memoised_stage),
    each module argument is a stand-in that records what the spec reads from it, across every trace the
    stage makes (the capture, the size probes, the size-guard trace); else the call itself."""
    sinks = _recording.sinks
    if sinks is None:
        return bound
    return {p: _Reading(v, sinks.setdefault(p, _Sink())) if isinstance(v, torch.nn.Module) else v
            for p, v in bound.items()}


def _record(reads: tuple) -> None:
    """A memo hit inside a recording stage: the reads the skipped trace made count as the stage's."""
    sinks = _recording.sinks
    if sinks is not None:
        for path, name, k in reads:
            sinks.setdefault(path, _Sink()).reads[name] = k


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
    hit = _lookup(key, fn, bound)
    if hit is not None:
        return hit
    watch = GlobalsWatch(fn)
    sinks = {p: _Sink() for p, v in bound.items() if isinstance(v, torch.nn.Module)}
    result = compute({**bound, **{p: _Reading(bound[p], s) for p, s in sinks.items()}})
    _store(key, fn, watch, sinks, result)
    return result


def memoised_stage(fn: Callable, bound: dict[str, Any], extra: Any, compute: Callable[[], Any]) -> Any:
    """compute() through the memo, for a stage whose traces call the spec through trace.spec_over (a
    transfer: capture, size probes, size guards): the attributes the spec reads from its module
    arguments are recorded across all of them. A transformers model's layers call one function with
    modules whose read attributes are equal (not layer_idx, which the spec does not read), so a layer
    after the first takes the first's program without a capture."""
    key = _static_key(fn, bound, extra)
    if key is None or _recording.sinks is not None or not any(isinstance(v, torch.nn.Module) for v in bound.values()):
        return compute()  # unkeyable; inside another recording stage (that one records); no module to share
    hit = _lookup(key, fn, bound)
    if hit is not None:
        return hit
    watch = GlobalsWatch(fn)
    _recording.sinks = {}
    try:
        result = compute()
        sinks = _recording.sinks
    finally:
        _recording.sinks = None
    if all(isinstance(bound.get(p), torch.nn.Module) for p in sinks):  # else a path this key cannot check
        _store(key, fn, watch, sinks, result)
    return result


def _lookup(key: tuple, fn: Callable, bound: dict[str, Any]) -> Any:
    with _lock:
        entries = list(_memo.get(key, ()))
    for owner, watch, reads, result in entries:
        if owner is fn and watch.unchanged() and _holds(reads, bound):
            _record(reads)
            return result
    return None


def _store(key: tuple, fn: Callable, watch: GlobalsWatch, sinks: dict[str, _Sink], result: Any) -> None:
    if any(s.opaque for s in sinks.values()):
        return
    reads = tuple((p, n, k) for p, s in sinks.items() for n, k in sorted(s.reads.items()))
    with _lock:
        _memo.setdefault(key, []).append((fn, watch, reads, result))
        _memo.move_to_end(key)
        while len(_memo) > _CAP:
            _memo.popitem(last=False)


def clear() -> None:
    with _lock:
        _memo.clear()
