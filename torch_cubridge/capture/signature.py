"""The per-call argument signature: the dictionary key from a call to its program.

It must be cheap (microseconds): dtypes, devices, ranks, which dims are 1,
and non-tensor values. Sizes are not in it; programs are generic in sizes
unless generalisation said otherwise, which the entry checks.
"""
from __future__ import annotations

from typing import Any

import torch


_ONE = (1).__eq__
_Tensor = torch.Tensor


def _meta(v: Any) -> Any:
    if isinstance(v, _Tensor):  # map with a C-level predicate: this runs on every call
        return (v.dtype, v.get_device(), tuple(map(_ONE, v.shape)))
    if isinstance(v, torch.nn.Module):
        return (type(v).__name__, id(v))
    if isinstance(v, (int, float, bool, str, type(None))):
        return v
    if isinstance(v, (tuple, list)):
        return tuple(_meta(x) for x in v)
    if isinstance(v, torch.dtype):
        return v
    return (type(v).__name__, id(v))


def call_signature(args: tuple, kwargs: dict) -> tuple:
    key = tuple(map(_meta, args))
    if kwargs:
        key += tuple((k, _meta(v)) for k, v in sorted(kwargs.items()))
    return key


def _meta_traceable(v: Any) -> Any:
    if isinstance(v, _Tensor):
        return (v.dtype, v.get_device(), tuple(n == 1 for n in v.shape))
    if isinstance(v, (tuple, list)):
        return tuple(_meta_traceable(x) for x in v)
    return _meta(v)


def traced_signature(args: tuple, kwargs: dict) -> tuple:
    """call_signature's key, in code torch.compile can trace (no C-level method wrappers)."""
    key = tuple(_meta_traceable(a) for a in args)
    if kwargs:
        key += tuple((k, _meta_traceable(v)) for k, v in sorted(kwargs.items()))
    return key
