"""A value per live nn.Module, kept on the module, for lookups that torch.compile traces.

A WeakKeyDictionary is what one would reach for, but dynamo reads a lookup in one by iterating the dict
and guards it by the position of the module's weak reference among the keys; another module collected
while dynamo traces moves or removes it, and dynamo fails with an internal IndexError
(`tests/integrations/test_module_table.py` makes the collector run mid-trace). A dict keyed by id() fails the same way
("dictionary changed size during iteration"). Here the entry is an attribute of the module itself, which
dynamo guards on that module alone. A copy or a pickle of the module carries no entry (its own calls
compile their own), and an entry answers only to the module it was made for.
"""
from __future__ import annotations

import weakref
from typing import Any, Generic, TypeVar

import torch

V = TypeVar("V")


class _Slot:
    __slots__ = ("owner", "value")

    def __init__(self, owner: int = 0, value: Any = None) -> None:
        self.owner, self.value = owner, value

    def __deepcopy__(self, memo: dict) -> "_Slot":
        return _Slot()

    def __reduce__(self) -> tuple:
        return (_Slot, ())


class ModuleTable(Generic[V]):
    def __init__(self, name: str) -> None:
        self._attr = f"_cubridge_{name}"
        self._modules: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()  # for listing, never traced

    def get(self, module: torch.nn.Module) -> V | None:
        slot = getattr(module, self._attr, None)
        return slot.value if slot is not None and slot.owner == id(module) else None

    def __getitem__(self, module: torch.nn.Module) -> V:
        value = self.get(module)
        if value is None:
            raise KeyError(module)
        return value

    def __contains__(self, module: torch.nn.Module) -> bool:
        return self.get(module) is not None

    def __setitem__(self, module: torch.nn.Module, value: V) -> None:
        module.__dict__[self._attr] = _Slot(id(module), value)
        self._modules.add(module)

    def items(self) -> list[tuple[torch.nn.Module, V]]:
        return [(m, v) for m in list(self._modules) if (v := self.get(m)) is not None]

    def values(self) -> list[V]:
        return [v for _, v in self.items()]

    def clear(self) -> None:
        for m in list(self._modules):
            m.__dict__.pop(self._attr, None)
        self._modules.clear()
