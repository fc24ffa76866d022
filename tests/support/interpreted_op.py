"""A CPU stand-in for the kernel behind the custom op: the program's forward by ir/backward.py's saved_forward
(O and the LSE, as the kernel saves them), so that on a machine without a GPU a compiled function's calls
reach torch.ops.cubridge.attention(_lse) and its autograd exactly as a GPU kernel's calls do (eager,
torch.compile, checkpointing), and the backward runner serves their gradients."""
from __future__ import annotations

import itertools
from typing import Any

import torch

from torch_cubridge.ir.backward import saved_forward
from torch_cubridge.ir.bind import bind_args
from torch_cubridge.ir.interpreter import evaluate
from torch_cubridge.ops.backward_reference import compute_dtype, op_call
from torch_cubridge.ops.errors import NeedsAutograd
from torch_cubridge.ops.fastpath import Plan
from torch_cubridge.ops.op_calls import CustomOpCalls
from torch_cubridge.ops.registry import register
from torch_cubridge.ops.runner import KernelRunner

_ids = itertools.count()


def _needs_grad(args: tuple, kwargs: dict) -> bool:
    def tensors(x: Any) -> list:
        if isinstance(x, torch.Tensor):
            return [x]
        if isinstance(x, torch.nn.Module):
            return list(x.parameters())
        return []
    return torch.is_grad_enabled() and any(t.requires_grad for a in (*args, *kwargs.values()) for t in tensors(a))


class InterpretedRunner(CustomOpCalls):
    """The runner's call paths (serve, op_call, op_forward) with the interpreter in place of the launch."""
    paged = None
    segments = None
    _extras = KernelRunner._extras
    _const = KernelRunner._const

    def __init__(self, p: Any) -> None:
        self.p = p
        self.plan = Plan(p)
        self.info = {"key": f"interpreted{next(_ids)}", "program": ""}
        self._lse_out = p.out.lse_index >= 0
        self._consts: dict = {}
        self.forward_calls = 0  # calls of the op's body

    def serve(self, args: tuple, kwargs: dict, record: bool = False) -> Any:
        if _needs_grad(args, kwargs):  # as the kernel runner: a call that needs gradients goes through the op
            raise NeedsAutograd("the kernel path computes no gradients")
        return self.p.run(*args, **kwargs)

    def op_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, extras: list, scalars: list,
                   want_lse: bool = False) -> Any:
        self.forward_calls += 1
        c = op_call(self.p, q, k, v, extras, scalars, compute_dtype(q))
        o, lse = saved_forward(self.p, c.q, c.k, c.v, c.env, c.hk, c.fdt)
        if self.p.sink is not None:  # the kernel's LSE has the sink joined (epilogue.cuh finish_stats)
            env = dict(c.env, q=torch.arange(lse.shape[2]).view(1, 1, -1, 1))
            lse = torch.logaddexp(lse, torch.as_tensor(evaluate(self.p.sink, env, c.fdt), dtype=c.fdt).expand_as(lse))
        B, H, Sq, Dv = o.shape
        shape, strides = self.plan.out_layout(B, H, Sq, Dv)
        out = q.new_empty(shape)
        out.as_strided((B, H, Sq, Dv), strides).copy_(o)
        return (out, lse[..., 0].float()) if self._lse_out or want_lse else out


def serve_by_op(monkeypatch) -> list:
    """From now on a compiled function's verified programs are served by InterpretedRunner (registered for the
    custom op); returns the list of runners made."""
    import importlib
    compile_mod = importlib.import_module("torch_cubridge.compile")
    made: list = []

    def stage(fn: Any, res: Any, bound: dict) -> tuple:
        r = InterpretedRunner(res.program)
        register(r.kernel_id, r)
        made.append(r)
        return r, "interpreted through the custom op"
    monkeypatch.setattr(compile_mod, "kernel_stage", stage)
    return made
