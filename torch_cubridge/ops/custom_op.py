"""The compiled kernels as one torch.library custom op, for torch.compile.

`cubridge::attention` takes the spec's own q/k/v (any layout the program
declared), its extra tensors and its argument scalars, and a kernel id from
the in-process registry; `cubridge::attention_lse` the same, for a program
whose spec also returns the rows' log-sum-exp (the kernel's own, [B, H, Sq]
in float32; bind.as_result puts it in the spec's layout and dtype). The fake implementation gives the output's shape
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


def _empty_out(q: torch.Tensor, v: torch.Tensor, kernel_id: str) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """The output as the kernel allocates it (the program's layout), and its [B, H, Sq]."""
    r = _runner(kernel_id)
    (B, H, S, _), _ = canon(q, r.plan.perms[0])
    dv = v.shape[-1] if r.paged is not None else canon(v, r.plan.perms[2])[0][3]  # O has V's head dim
    shape, _ = r.plan.out_layout(B, H, S, dv)
    return q.new_empty(shape), (B, H, S)


@attention.register_fake
def _(q, k, v, extras, scalars, kernel_id):
    return _empty_out(q, v, kernel_id)[0]


@torch.library.custom_op("cubridge::attention_lse", mutates_args=())
def attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, extras: list[torch.Tensor],
                  scalars: list[float], kernel_id: str) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = _runner(kernel_id).op_forward(q, k, v, extras, scalars)
    return out, lse


@attention_lse.register_fake
def _(q, k, v, extras, scalars, kernel_id):
    out, rows = _empty_out(q, v, kernel_id)
    return out, q.new_empty(rows, dtype=torch.float32)
