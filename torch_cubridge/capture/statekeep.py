"""A spec traced over fake tensors must leave its modules as it found them.

A module may cache what its forward computes in its own attributes (LeViT keeps its gathered attention
bias in a dict keyed by device, filled on the first eval call). Traced over fake tensors, that cache is
filled with a fake tensor, and every later real call of the module, the spec itself included, reads it:
verification then fails and the spec, the fallback, would raise. Each trace therefore runs between a
snapshot and a restore of the plain state of every module it is handed (their submodules too): each
attribute's binding, and the contents of the dicts, lists and sets they hold, restored in place, so
an object the module shares keeps its identity.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterable, Iterator

import torch

from .tracememo import unwrapped

_CONTAINERS = (dict, list, set)


def _modules(values: Iterable[Any]) -> list[torch.nn.Module]:
    seen: dict[int, torch.nn.Module] = {}
    for v in map(unwrapped, values):  # a memo's stand-in: its module, so keeping it is not a read it records
        if isinstance(v, torch.nn.Module):
            for m in v.modules():
                seen.setdefault(id(m), m)
    return list(seen.values())


def _restore(obj: Any, saved: Any) -> None:
    if isinstance(obj, list):
        obj[:] = saved
    else:  # a dict or a set
        obj.clear()
        obj.update(saved)


@contextmanager
def modules_kept(values: Iterable[Any]) -> Iterator[None]:
    """Run the block, then put back every attribute of the nn.Modules among `values` (and beneath them)
    and the contents of their containers, as they were before it."""
    snaps = []
    for m in _modules(values):
        attrs = dict(vars(m))
        snaps.append((m, attrs, {k: (v, type(v)(v)) for k, v in attrs.items() if type(v) in _CONTAINERS}))
    try:
        yield
    finally:
        for m, attrs, inner in snaps:
            d = vars(m)
            for k in [k for k in d if k not in attrs]:
                del d[k]
            d.update(attrs)
            for obj, content in inner.values():
                _restore(obj, content)
