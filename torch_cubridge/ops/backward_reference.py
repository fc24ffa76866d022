"""The custom op's call seen by the backward: its operands as [B, H, S, D] views, the environment the
program's expressions read, and the reference backward of the attention (ir/backward.py) on them.

The op takes the spec's own q, k and v (after any prologue), its extra tensors and its argument scalars; the
output it returns is in the kernel's layout (Plan.out_layout). The reference backward recomputes O and the
rows' log-sum-exp from the operands (never trusting the forward kernel's LSE) and gives dQ, dK, dV and the
learnable extras' gradients in the operands' own layouts. It runs wherever the tensors lie, a query tile at
a time (ir/backward.py's BLOCK_M rows against every key), so nothing of size Sq x Skv is ever held.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..ir.backward import attention_backward, saved_forward, sink_gradients, unnormalised_row_sums
from ..ir.bind import head_index, scalar_values, sizes_of, to_canonical
from ..ir.interpreter import index_env
from ..ir.program import Program


@dataclass
class OpCall:
    """One call of the op, canonical: q, k, v as [B, H, S, D] views in `fdt`; env for the expressions."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    env: dict[str, Any]
    hk: torch.Tensor
    fdt: torch.dtype


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """float64 stays float64; every other dtype is computed in float32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def op_call(p: Program, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, extras: list[torch.Tensor],
            scalars: list[float], fdt: torch.dtype) -> OpCall:
    """The op's arguments as the reference reads them (extras in p.extras' order; scalars: the values of
    the scalars read from arguments, in p.scalars' order)."""
    qc, kc, vc = (to_canonical(t, op).to(fdt) for t, op in ((q, p.q), (k, p.k), (v, p.v)))
    sizes = sizes_of(p, qc, kc)
    return OpCall(qc, kc, vc, call_env(p, qc, kc, extras, scalars, fdt),
                  head_index(p, qc.shape[1], sizes["Hkv"]).to(qc.device), fdt)


def call_env(p: Program, qc: torch.Tensor, kc: torch.Tensor, extras: list[torch.Tensor], scalars: list[float],
             fdt: torch.dtype) -> dict[str, Any]:
    """The environment the program's expressions read on a call with canonical q and k (only their shapes
    and device are read)."""
    sizes = sizes_of(p, qc, kc)
    it = iter(scalars)
    bound = {s.arg: next(it) for s in p.scalars if s.arg is not None}
    # float scalars as fdt tensors: `evaluate` meets two Python floats in torch's default float32
    scal = {n: torch.tensor(x, dtype=fdt) if isinstance(x, float) else x
            for n, x in scalar_values(p, bound, sizes).items()}
    tensors = {x.name: t.detach() for x, t in zip(p.extras, extras)}
    return index_env(sizes, scal, tensors, qc.shape[0], qc.shape[1], qc.device)


def canonical_out(p: Program, out: torch.Tensor, B: int, H: int, Sq: int, Dv: int) -> torch.Tensor:
    """The op's output (or its gradient), in the kernel's layout, viewed as [B, H, Sq, Dv]."""
    from .fastpath import Plan
    shape, strides = Plan(p).out_layout(B, H, Sq, Dv)
    return out.reshape(shape).contiguous().as_strided((B, H, Sq, Dv), strides)


def in_layout_of(like: torch.Tensor, op: Any, g: torch.Tensor) -> torch.Tensor:
    """g ([B, H, S, D]) written into a tensor of like's shape, dtype and strides (the operand's layout)."""
    out = torch.empty_like(like)
    to_canonical(out, op).copy_(g)
    return out


def reference_backward(p: Program, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, extras: list[torch.Tensor],
                       scalars: list[float], dout: torch.Tensor, dlse: torch.Tensor | None, learn: list[int],
                       fdt: torch.dtype | None = None, o: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """dQ, dK, dV in q's, k's and v's layouts and dtypes, and the gradients of extras[i] for i in `learn`.
    `dout`: the output's gradient in the kernel's layout; `dlse`: the LSE's ([B, H, Sq]) or None. `o`: the
    forward's O as [B, H, Sq, Dv] (the verification hands the kernel's own, as its delta reads it); None:
    recomputed with the LSE in `fdt` (default: float32, float64 for float64 operands)."""
    c = op_call(p, q, k, v, extras, scalars, fdt or compute_dtype(q))
    B, H, Sq, _ = c.q.shape
    o_ref, lse = saved_forward(p, c.q, c.k, c.v, c.env, c.hk, c.fdt)
    o = o_ref if o is None else o.to(c.fdt)
    do = canonical_out(p, dout, B, H, Sq, c.v.shape[-1]).to(c.fdt)
    dl = None if dlse is None else dlse.to(c.fdt).unsqueeze(-1)
    names = {p.extras[i].name for i in learn}
    dq, dk, dv, grads = attention_backward(p, c.q, c.k, c.v, dict(c.env), c.hk, o, lse, do, dl, names, c.fdt)
    return (in_layout_of(q, p.q, dq), in_layout_of(k, p.k, dk), in_layout_of(v, p.v, dv),
            [grads[p.extras[i].name].to(extras[i].dtype) for i in learn])


def dout_for_lse_rounding(p: Program, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          extras: list[torch.Tensor], scalars: list[float], lse: torch.Tensor, rows: torch.Tensor,
                          dout: torch.Tensor) -> torch.Tensor:
    """dO with each row of `rows` divided by the row's sum of exp(X - LSE) (X computed in float32, as the
    kernel computes it), for a backward kernel that recomputes P = exp(X - LSE) from the forward's LSE.

    Where a finite fill fills a row whole (padding under finfo.min), the float32 LSE is the fill with
    log(count) lost to its rounding, and the kernel's P is c times softmax's, c that row sum. The backward is
    linear in dO given P: dV = P^T dO, dP = dO V^T, delta = rowsum(dO O), dS = P (dP - delta) dscore/ds, so
    the kernel's P times c with dO over c gives exactly softmax's gradients."""
    c = op_call(p, q, k, v, extras, scalars, torch.float32)
    sums = unnormalised_row_sums(p, c.q, c.k, c.env, c.hk, lse.reshape(rows.shape), rows)
    sums = torch.where(rows & (sums > 0), sums, torch.ones_like(sums))
    B, H, Sq = rows.shape
    scaled = dout.clone(memory_format=torch.contiguous_format)
    view = canonical_out(p, scaled, B, H, Sq, c.v.shape[-1])  # a view of `scaled`: it is contiguous
    assert view.untyped_storage().data_ptr() == scaled.untyped_storage().data_ptr()
    view.div_(sums.unsqueeze(-1).to(view.dtype))
    return scaled


def kernel_sink_gradients(p: Program, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, extras: list[torch.Tensor],
                          scalars: list[float], out: torch.Tensor, dout: torch.Tensor, lse_joined: torch.Tensor,
                          learn: list[int]) -> list[torch.Tensor]:
    """The gradients of extras[i] for i in `learn`, none read by the score, beside a backward kernel's dQ, dK,
    dV: from the forward kernel's O and LSE (the sink joined), in float32 (ir/backward.sink_gradients). A
    tensor only the row scale reads (scaled by PyTorch after the op) has none through the op: zero."""
    if p.sink is None:
        return [torch.zeros_like(extras[i]) for i in learn]
    qc, kc = to_canonical(q, p.q), to_canonical(k, p.k)
    B, H, Sq, _ = qc.shape
    o, do = (canonical_out(p, t, B, H, Sq, to_canonical(v, p.v).shape[-1]) for t in (out, dout))
    names = {p.extras[i].name for i in learn}
    grads = sink_gradients(p, call_env(p, qc, kc, extras, scalars, torch.float32), o, do,
                           lse_joined.reshape(B, H, Sq), names, torch.float32)
    return [grads[p.extras[i].name].to(extras[i].dtype) for i in learn]
