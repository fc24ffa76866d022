"""The runner's custom-op side (ops/runner.py KernelRunner): a call routed through
torch.ops.cubridge.attention (ops/custom_op.py), which torch.compile can trace, and the op's body.

Mixed into KernelRunner, whose state it reads (the program, the paged and segmented reads, the constants)
and whose launch (_execute) the op's body makes with the output in the kernel's own layout (raw).
"""
from __future__ import annotations

from typing import Any

import torch

from ..ir.bind import as_result, bind_args, call_device, lookup, operand_value, scalar_values
from ..ir.expr import ROW_LSE
from ..ir.interpreter import index_env, row_factor
from ..ir.prologue import run_epilogue, run_prologue
from .determinism import SUFFIX
from .fastpath import canon


class CustomOpCalls:
    """KernelRunner's calls through the custom op, which torch.compile traces instead of the kernel."""

    @property
    def kernel_id(self) -> str:
        return self.info["key"] + "/" + self.info.get("program", "")

    def op_call(self, args: tuple, kwargs: dict, deterministic: bool = False) -> Any:
        """Route a call through torch.ops.cubridge.attention (traceable by torch.compile). None where the
        call needs gradients and the op has no backward for this program: the spec serves it. deterministic:
        its gradients bitwise-equal run to run."""
        from . import custom_op
        bound = bind_args(self.p.signature, args, kwargs)
        q, k, v, extras, scal = self.op_operands(bound)
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, *extras))
        if grad and getattr(self, "autograd_refusal", "no backward was prepared") is not None:
            return None  # ops/backward_runner.py says why; the caller runs the spec
        lse = None
        if self._lse_out or grad:  # the op that gives the kernel's LSE too: the spec returns it, or the
            # backward reads it (the op's autograd, ops/custom_op.py)
            # a backward asked to be bitwise-equal run to run: the op's kernel named so (ops/determinism.py)
            kid = self.kernel_id + SUFFIX if grad and deterministic else self.kernel_id
            out, lse = custom_op.attention_lse(q, k, v, extras, scal, kid)
            if self.p.row_scale is not None:
                out = self._scale_rows_outside(out, lse, q, k, v, extras, bound)
        else:
            out = custom_op.attention(q, k, v, extras, scal, self.kernel_id)
        out = out if self.p.out.dtype == "q" else out.to(getattr(torch, self.p.out.dtype))
        res = as_result(self.p, out, lse if self._lse_out else None, q.dtype)
        # what the spec does after the attention (a gate, heads merged and projected, a norm): its own ops,
        # outside the op, so autograd and torch.compile see them as they see the prologue's
        return run_epilogue(self.p, res, bound) if self.p.epilogue else res

    def op_operands(self, bound: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list, list]:
        """The op's q, k, v, extras and scalars from a call's bound arguments (the prologue run on them)."""
        in_place = ("k", "v") if self.paged is not None else ()  # pieces: the op takes K and V joined
        made = run_prologue(self.p, bound, call_device(bound), in_place) if self.p.prologue else {}
        q = operand_value(bound, self.p.q, made)
        ex = self._extras(bound, made)
        extras = [ex[x.name] if ex[x.name] is not None else self._const(x, q.device) for x in self.p.extras]
        if self.paged is not None:  # the op takes the pages as k and v, and the tables after the extras
            k, v = (lookup(bound, r.pages) for r in self.paged)
            extras += [lookup(bound, r.table) for r in self.paged]
        else:
            k, v = (operand_value(bound, op, made) for op in (self.p.k, self.p.v))
        scal = [float(lookup(bound, s.arg)) for s in self.p.scalars if s.arg is not None]
        return q, k, v, extras, scal

    def _row_factor(self, sizes: dict, scal: dict, tensors: dict, lse: torch.Tensor | None, rows: tuple,
                    dev: torch.device) -> torch.Tensor:
        """The program's row scale as a [B, H, Sq, 1] float32 factor (`rows`: B, H, Sq); `lse`: the rows'
        log-sum-exp [B, H, Sq], where the scale reads it. The runner's in-place scaling and the scaling after
        the op both take it from here."""
        B, H, Sq = rows
        env = index_env(sizes, scal, tensors, B, H, dev)
        if lse is not None:
            env[ROW_LSE] = lse.unsqueeze(-1)
        return row_factor(self.p.row_scale, env, B, H, Sq, torch.float32)

    def _scale_rows_outside(self, out: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                            v: torch.Tensor, extras: list, bound: dict) -> torch.Tensor:
        """The program's row scale on `out` (the kernel's layout), by PyTorch after the op, whose `attention_lse`
        gives O unscaled: autograd carries the scale into dO, into the LSE's gradient (the backward's dLSE) and
        into the gradients of learnable tensors the scale reads."""
        p, perms = self.p, self.plan.perms
        (B, H, Sq, D), _ = canon(q, perms[0])
        (_, Hkv, Skv, _), _ = canon(k, perms[1])
        Dv = canon(v, perms[2])[0][3]
        sizes = {"B": B, "H": H, "Hkv": Hkv, "Sq": Sq, "Skv": Skv, "D": D}
        factor = self._row_factor(sizes, scalar_values(p, bound, sizes),
                                  {x.name: t for x, t in zip(p.extras, extras)}, lse, (B, H, Sq), q.device)
        # the kernel's layout is its dims in out_flat's order, contiguous: viewed as [B, H, Sq, Dv] and back
        # with reshapes and permutes only (torch.compile traces them)
        ext = {"b": B, "h": H, "s": Sq, "d": Dv}
        names = list(self.plan.out_flat)
        o = out.reshape([ext[c] for c in names])
        if "b" not in names:  # an output without a batch dim: B is 1
            o, names = o.unsqueeze(0), ["b"] + names
        o = o.permute([names.index(c) for c in "bhsd"])
        scaled = (o.float() * factor).to(out.dtype)
        return scaled.permute(["bhsd".index(c) for c in names]).reshape(out.shape)

    def op_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, extras: list, scalars: list,
                   want_lse: bool = False) -> Any:
        """The custom op's body: the output in the kernel's layout, with the rows' log-sum-exp where the
        spec returns it or `want_lse` (the op `attention_lse`, whose O is before the program's row scale:
        op_call applies it, differentiably)."""
        it = iter(scalars)
        bound = {s.arg: next(it) for s in self.p.scalars if s.arg is not None}
        ex = {x.name: t for x, t in zip(self.p.extras, extras)}
        if self.paged is not None:
            (kr, vr), (kt, vt) = self.paged, extras[-2:]
            kv = self._pages({kr.pages: k, vr.pages: v, kr.table: kt, vr.table: vt})
            return self._execute(q, k, v, self.plan.perms, ex, bound, False, raw=True, paged=kv[2:], want_lse=want_lse)
        if self.segments is not None:  # one piece each
            kv = self._pieces([k], [v])
            return self._execute(q, kv[0], kv[1], self.plan.perms, ex, bound, False, raw=True, paged=kv[2:], want_lse=want_lse)
        return self._execute(q, k, v, self.plan.perms, ex, bound, False, raw=True, want_lse=want_lse)
