"""The spec evaluated on the CPU: in float64, the ground truth for verification; in float32, the
kernel's own precision (see verify.cpu.judge)."""
from __future__ import annotations

import copy
from typing import Any, Callable

import torch

from ..capture.trace import _rebuild_call


def to64(v: Any, dtype: torch.dtype = torch.float64) -> Any:
    """v on the CPU with its floating-point tensors (a module's too) in `dtype`."""
    if isinstance(v, torch.nn.Module):
        return copy.deepcopy(v).cpu().to(dtype)
    if isinstance(v, torch.Tensor):
        v = v.detach().cpu()
        return v.to(dtype) if v.is_floating_point() else v
    return v


def run_reference(fn: Callable, bound: dict[str, Any], dtype: torch.dtype = torch.float64) -> Any:
    """The spec on the CPU with every floating-point input cast to `dtype` (float64: the ground truth)."""
    b = {k: to64(v, dtype) for k, v in bound.items()}
    args, kwargs = _rebuild_call(fn, b)
    with torch.no_grad():
        return fn(*args, **kwargs)


def attention_output(result: Any, index: int, tuple_len: int) -> torch.Tensor:
    return result[index] if tuple_len else result
