"""The compiled kernels as one torch.library custom op, for torch.compile.

`cubridge::attention` takes the spec's own q/k/v (any layout the program
declared), its extra tensors and its argument scalars, and a kernel id from
the in-process registry; `cubridge::attention_lse` the same, for a program
whose spec also returns the rows' log-sum-exp (the kernel's own, [B, H, Sq]
in float32; bind.as_result puts it in the spec's layout and dtype), with O before
the program's row scale (the caller applies it: ops/op_calls.py). Both are differentiable: a call that needs
gradients goes through `attention_lse`, which saves q, k, v, the extras, O and the LSE (nothing quadratic), and
its backward is the op `attention_backward` (ops/backward_runner.py). The fake implementation gives the output's shape
from the program's layout, so torch.compile(fullgraph=True) traces through
without running anything. Kernels are built and verified before any trace
(ops/registry.py holds them; this module is imported at the first trace).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from . import row_flags
from .determinism import split
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
    out, lse = _runner(kernel_id).op_forward(q, k, v, extras, scalars, want_lse=True)
    row_flags.note(lse)  # read by its backward (a call that wants gradients comes through here)
    return out, lse


@attention_lse.register_fake
def _(q, k, v, extras, scalars, kernel_id):
    out, rows = _empty_out(q, v, kernel_id)
    return out, q.new_empty(rows, dtype=torch.float32)


# -- autograd: the forward saves q, k, v, the extras, O and the LSE; the backward is one more op ----------------
@torch.library.custom_op("cubridge::attention_backward", mutates_args=())
def attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, extras: list[torch.Tensor],
                       scalars: list[float], out: torch.Tensor, lse: Optional[torch.Tensor], dout: torch.Tensor,
                       dlse: Optional[torch.Tensor], learn: list[int], kernel_id: str
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """dQ, dK, dV (in q's, k's and v's layouts) and the gradients of extras[i] for i in `learn`, by the
    program's backward runner (ops/backward_runner.py: the GPU kernel where verified, else the reference);
    bitwise-equal run to run where the forward's call asked (ops/determinism.py: the kernel id says)."""
    from .backward_runner import backward_for
    base, deterministic = split(kernel_id)
    dq, dk, dv, dx = backward_for(base)(q, k, v, extras, scalars, out, lse, dout, dlse, learn, deterministic)
    return dq, dk, dv, list(dx)


@attention_backward.register_fake
def _(q, k, v, extras, scalars, out, lse, dout, dlse, learn, kernel_id):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), [torch.empty_like(extras[i]) for i in learn]


def _setup(ctx: Any, inputs: tuple, output: Any) -> None:
    q, k, v, extras, scalars, kernel_id = inputs
    out, lse = output if isinstance(output, tuple) else (output, None)
    ctx.save_for_backward(q, k, v, out, lse, *extras)
    ctx.scalars, ctx.kernel_id = scalars, kernel_id
    ctx.learn = [i for i, t in enumerate(extras) if t.is_floating_point() and t.requires_grad]
    from .backward_runner import lse_has_gradient
    ctx.lse_grad = lse_has_gradient(_runner(kernel_id))


def _backward(ctx: Any, dout: torch.Tensor, dlse: torch.Tensor | None = None) -> tuple:
    if torch.is_grad_enabled():
        raise RuntimeError("torch_cubridge: the compiled attention's backward is not differentiable itself "
                           "(double backward, create_graph=True); call the spec function for that")
    q, k, v, out, lse, *extras = ctx.saved_tensors
    dq, dk, dv, dx = attention_backward(q, k, v, extras, ctx.scalars, out, lse, dout,
                                        dlse if ctx.lse_grad else None, ctx.learn, ctx.kernel_id)
    grads: list[torch.Tensor | None] = [None] * len(extras)
    for i, g in zip(ctx.learn, dx):
        grads[i] = g
    return dq, dk, dv, grads, [None] * len(ctx.scalars), None


attention.register_autograd(_backward, setup_context=_setup)
attention_lse.register_autograd(_backward, setup_context=_setup)
