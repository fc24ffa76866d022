"""A transfer's refusal named at the user's op and line (capture/locate.py finds it) instead of an aten op."""
from __future__ import annotations

from typing import Any, Callable

from ..errors import UnsupportedSpec
from .locate import locate_op, occurrence, torch_name
from .trace import Captured, spec_over


def located(fn: Callable, bound: dict[str, Any], e: UnsupportedSpec, cap: Captured) -> UnsupportedSpec:
    """The refusal, naming the user's op and line instead of an aten op."""
    if not (e.op or "").startswith("aten."):
        return e
    where = locate_op(spec_over(fn, bound, []), e.op, occurrence(cap.graph, e.node) if e.node else 0)
    return UnsupportedSpec(e.reason, op=f"{torch_name(e.op)} at {where}") if where else e
