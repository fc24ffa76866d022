"""The spec evaluated in float64 on the CPU: the ground truth for verification."""
from __future__ import annotations

import copy
from typing import Any, Callable

import torch

from ..capture.trace import _rebuild_call


def to64(v: Any) -> Any:
    if isinstance(v, torch.nn.Module):
        return copy.deepcopy(v).double().cpu()
    if isinstance(v, torch.Tensor):
        v = v.detach().cpu()
        return v.double() if v.is_floating_point() else v
    return v


def run_reference(fn: Callable, bound: dict[str, Any]) -> Any:
    b = {k: to64(v) for k, v in bound.items()}
    args, kwargs = _rebuild_call(fn, b)
    with torch.no_grad():
        return fn(*args, **kwargs)


def attention_output(result: Any, index: int, tuple_len: int) -> torch.Tensor:
    return result[index] if tuple_len else result
