"""The compiled kernels as one torch.library custom op, for torch.compile.

`cubridge::attention` takes the spec's own q/k/v (any layout the program
declared), its extra tensors and its argument scalars, and a kernel id from
the in-process registry. The fake implementation gives the output's shape
from the program's layout, so torch.compile(fullgraph=True) traces through
without running anything. Kernels are built and verified before any trace.
"""
from __future__ import annotations

import torch

from .fastpath import canon

_REGISTRY: dict[str, "object"] = {}


def register(kernel_id: str, runner: object) -> str:
    _REGISTRY[kernel_id] = runner
    return kernel_id


def _runner(kernel_id: str):
    try:
        return _REGISTRY[kernel_id]
    except KeyError:
        raise RuntimeError(f"cubridge kernel {kernel_id} is not loaded in this process; call the compiled "
                           "function once eagerly (it builds and verifies the kernel) before tracing") from None


@torch.library.custom_op("cubridge::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, extras: list[torch.Tensor],
              scalars: list[float], kernel_id: str) -> torch.Tensor:
    return _runner(kernel_id).op_forward(q, k, v, extras, scalars)


@attention.register_fake
def _(q, k, v, extras, scalars, kernel_id):
    r = _runner(kernel_id)
    (B, H, S, D), _ = canon(q, r.plan.perms[0])
    shape, _ = r.plan.out_layout(B, H, S, D)
    return q.new_empty(shape)
