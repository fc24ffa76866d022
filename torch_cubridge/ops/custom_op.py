"""The compiled kernels as one torch.library custom op, for torch.compile.

`cubridge::attention` takes the spec's own q/k/v (any layout the program
declared), its extra tensors and its argument scalars, and a kernel id from
the in-process registry. The fake implementation gives the output's shape
from the program's layout, so torch.compile(fullgraph=True) traces through
without running anything. Kernels are built and verified before any trace
(ops/registry.py holds them; this module is imported at the first trace).
"""
from __future__ import annotations

import torch

from .fastpath import canon
from .registry import runner_for as _runner


@torch.library.custom_op("cubridge::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, extras: list[torch.Tensor],
              scalars: list[float], kernel_id: str) -> torch.Tensor:
    return _runner(kernel_id).op_forward(q, k, v, extras, scalars)


@attention.register_fake
def _(q, k, v, extras, scalars, kernel_id):
    r = _runner(kernel_id)
    (B, H, S, _), _ = canon(q, r.plan.perms[0])
    dv = v.shape[-1] if r.paged is not None else canon(v, r.plan.perms[2])[0][3]  # O has V's head dim
    shape, _ = r.plan.out_layout(B, H, S, dv)
    return q.new_empty(shape)
