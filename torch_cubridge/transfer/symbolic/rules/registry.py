"""The table of symbolic rules: one rule per aten op, registered by the family module that knows it.

A rule takes the op's call (its node, arguments and result dtype, and the walker that holds every
earlier node's value) and returns the node's symbolic value, or raises UnsupportedSpec. An op with no
rule is refused by `no_rule`, the walker's fallback.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch.fx import Node

from ....errors import UnsupportedSpec
from ..elementwise import combine, lift_scalar
from ..sym import Ctx, Sym

if TYPE_CHECKING:  # the walker calls the rules; they see it only as the holder of the values
    from ..graph import Walker


def aten_name(node: Node) -> str:
    """The op's aten packet name with an in-place op's trailing underscore dropped (add_ is add)."""
    t = node.target
    name = getattr(getattr(t, "overloadpacket", None), "__name__", str(t))
    return name.rstrip("_") if name.endswith("_") and name not in ("slice_",) else name


@dataclass(frozen=True)
class Call:
    """One aten call as its rule sees it."""
    walker: Walker
    node: Node
    name: str               # aten_name(node)
    dtype: torch.dtype      # the result's dtype (float32 where the result is not one tensor)

    @staticmethod
    def of(walker: Walker, node: Node) -> Call:
        val = node.meta.get("val")
        return Call(walker, node, aten_name(node), val.dtype if isinstance(val, torch.Tensor) else torch.float32)

    @property
    def op(self) -> str:
        """The op as refusals name it."""
        return f"aten.{self.name}"

    @property
    def args(self) -> tuple:
        return self.node.args

    @property
    def kw(self) -> dict[str, Any]:
        return self.node.kwargs

    @property
    def ctx(self) -> Ctx:
        return self.walker.ctx

    def sym(self, i: int) -> Sym:
        """Positional argument i as a symbolic tensor (a Python number lifted to a constant)."""
        return self.walker.sym(self.args[i])

    def opt(self, i: int, key: str, default: Any = None) -> Any:
        """An argument given positionally at i or by keyword."""
        return self.args[i] if len(self.args) > i else self.kw.get(key, default)

    def combine(self, cuir_op: str, xs: list[Sym], dtype: torch.dtype | None = None) -> Sym:
        """The elementwise `cuir_op` of xs, broadcast; of the call's dtype unless told."""
        return combine(self.ctx, cuir_op, xs, self.dtype if dtype is None else dtype, self.op)

    def scalar(self, v: Any) -> Sym:
        return lift_scalar(v, self.dtype)


Rule = Callable[[Call], Any]
RULES: dict[str, Rule] = {}


def rule(*names: str) -> Callable[[Rule], Rule]:
    """Register the decorated function as the rule for each aten op in `names`."""
    def register(fn: Rule) -> Rule:
        for n in names:
            if n in RULES:
                raise ValueError(f"two symbolic rules for aten.{n}: {RULES[n].__name__} and {fn.__name__}")
            RULES[n] = fn
        return fn
    return register


def no_rule(c: Call) -> Any:
    """The fallback: an op the walk has no rule for (or a form of it no rule takes) is refused."""
    raise UnsupportedSpec("no symbolic rule for this op", op=c.op)
