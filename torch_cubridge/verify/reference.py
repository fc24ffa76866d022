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


def reference_output(fn: Callable, bound: dict[str, Any], index: int, tuple_len: int) -> tuple[torch.Tensor, str]:
    """(the spec's output, the dtype it ran in): float64, or float32 for a spec that fixes float32
    somewhere (positions made with .float() meeting float64 weights) and so cannot run in float64."""
    try:
        return attention_output(run_reference(fn, bound), index, tuple_len), "float64"
    except Exception:
        return attention_output(run_reference(fn, bound, torch.float32), index, tuple_len), "float32"
