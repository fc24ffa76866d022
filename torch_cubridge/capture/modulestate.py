"""The plain attributes of each nn.Module argument, as a guard.

A program bakes in what the spec read from a module (`module.scaling`, `module.num_key_value_groups`,
`module.training`). Module arguments are keyed by identity, so setting such an attribute in place
(`attn.scaling = 0.5`) would leave the old program serving. The snapshot holds every attribute of a
plain value (numbers, strings, bytes, flags, None, tuples of them) and a call matches only while they are
unchanged (well under a microsecond for a transformers attention module). Tensors a module holds are
data the kernel reads each call, not part of this.
"""
from __future__ import annotations

import operator
from typing import Any

import torch

from ..ir.guards import reader
from .codekey import PLAIN


def _plain(x: Any) -> bool:
    return isinstance(x, PLAIN) or isinstance(x, tuple) and all(_plain(y) for y in x)


class ModuleState:
    def __init__(self, bound: dict[str, Any], signature: tuple[str, ...], nargs: int) -> None:
        self._mods = []
        for path, v in bound.items():
            if isinstance(v, torch.nn.Module):
                keys = tuple(k for k, x in vars(v).items() if _plain(x))
                if keys:  # itemgetter: one C call reads them all (a scalar for one key, a tuple for more)
                    self._mods.append((reader(signature, nargs, path), operator.itemgetter(*keys),
                                       operator.itemgetter(*keys)(vars(v)), keys))

    def __bool__(self) -> bool:
        return bool(self._mods)

    def holds(self, args: tuple, kwargs: dict) -> bool:
        for get, read, snap, _ in self._mods:
            try:
                now = read(get(args, kwargs).__dict__)
            except Exception:  # the argument or an attribute is missing, or not a module here: not this entry
                return False
            if now is not snap and now != snap:  # `is` first, as tuples compare items: a nan equals itself
                return False
        return True

    def holds_traceable(self, args: tuple, kwargs: dict) -> bool:
        """holds, in code torch.compile can trace (dynamo cannot call an itemgetter)."""
        for get, _, snap, keys in self._mods:
            d = get(args, kwargs).__dict__
            now = tuple(d.get(k) for k in keys)
            if now != (snap if len(keys) > 1 else (snap,)):
                return False
        return True
