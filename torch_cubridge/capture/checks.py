"""Bad input fails here, with TypeError or ValueError, before any capture work."""
from __future__ import annotations

from typing import Any

import torch

from ..ir.program import Program

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_call(bound: dict[str, Any]) -> None:
    tensors = [(p, v) for p, v in bound.items() if isinstance(v, torch.Tensor)]
    if not tensors:  # q, k or v may be the function's own (a module's latent query): the graph says which
        raise TypeError("attention needs tensor arguments; got none")
    devices = {v.device for _, v in tensors}
    if len(devices) > 1:
        raise ValueError("tensor arguments are on different devices: "
                         + ", ".join(f"{p} on {v.device}" for p, v in tensors))
    floats = [(p, v) for p, v in tensors if v.is_floating_point() or v.is_complex()]
    for p, v in floats:
        if v.dtype not in FLOATS:
            raise TypeError(f"{p} has dtype {v.dtype}; supported: float16, bfloat16, float32, float64")
    for p, v in floats[:1]:  # the others may be weights (projections made inside the spec)
        if v.dim() not in (3, 4):
            raise ValueError(f"{p} must be a 3-D or 4-D tensor ([batch,] heads, seq, dim in any order); "
                             f"got shape {tuple(v.shape)}")
    if not floats:
        raise TypeError("query, key and value must be floating-point tensors")
    for p, v in floats[:3]:
        if 0 in v.shape:
            raise ValueError(f"{p} is empty (shape {tuple(v.shape)}): a batch, head or sequence size of 0 "
                             "has nothing to compile")


def check_against(p: Program, bound: dict[str, Any]) -> None:
    """A later call against an established program: ranks and dtypes must fit."""
    from ..ir.bind import lookup
    dts = set()
    for name, op in (("query", p.q), ("key", p.k), ("value", p.v)):
        if op.step:  # computed by the prologue: the guards pin the arguments it reads
            continue
        t = lookup(bound, op.arg)
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op.arg} ({name}) must be a tensor")
        if t.dim() != len(op.dims):
            raise ValueError(f"{op.arg} ({name}) must have rank {len(op.dims)} (layout {list(op.dims)}); "
                             f"got shape {tuple(t.shape)}")
        dts.add(t.dtype)
    if len(dts) > 1:
        raise TypeError(f"query, key and value must share a dtype; got {sorted(map(str, dts))}")
