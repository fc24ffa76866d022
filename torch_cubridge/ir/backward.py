"""The backward of a CuIR program, run on the CPU the way the backward kernel runs it.

The forward leaves O and the rows' log-sum-exp of the scores (LSE), nothing quadratic. Per query tile the
backward recomputes S = q.k (scale-free), X = score(S), P = exp(X - LSE) on the kept pairs, then
dP = dO V^T, D = rowsum(dO * O), dX = P (dP - D + dLSE), dS = dX * dscore/ds, dQ = dS K, dK = dS^T Q,
dV = P^T dO, and each learnable tensor the score reads gets dX * dscore/d(element), added at the element's
index. The derivatives come from ir/derivative.py and are evaluated by the interpreter's `evaluate`.

A sink c joins the normaliser: O = O_scores * F with F = sigmoid(LSE - c), so dP is taken against dO F,
dX = P (F (dP' - D) + dLSE) and dc = -D (1 - F). A row scale is applied by PyTorch after the kernel, so
autograd carries it; it reaches the kernel's backward as dLSE. The prologue and the epilogue are PyTorch
too: `run_with_grad` runs the whole program with autograd through them, the attention by `_Attend`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .bind import bind_args, call_device, extra_tensors, head_index, operand_value, scalar_values, sizes_of, to_canonical
from .derivative import derivative, load_sites
from .expr import ROW_LSE, Expr, var
from .interpreter import BLOCK_M, _to_output_layout, evaluate, index_env, row_factor
from .prologue import run_epilogue, run_prologue

if TYPE_CHECKING:
    from .program import Program


@dataclass(frozen=True)
class Derivatives:
    """A program's backward hooks: d score / d s, and per learnable load site (a `load` node of the score
    or the sink) the derivative of that expression with respect to the element it reads."""
    d_s: Expr
    score_sites: tuple[tuple[Expr, Expr], ...]
    sink_sites: tuple[tuple[Expr, Expr], ...]


def derive(p: Program, learnable: set[str]) -> Derivatives:
    """The derivatives the backward evaluates; `learnable`: the extra tensors that get a gradient.
    Raises derivative.NotDifferentiable where the score has no gradient."""
    sites = tuple((n, derivative(p.score, n)) for n in load_sites(p.score, learnable))
    sink = () if p.sink is None else tuple((n, derivative(p.sink, n)) for n in load_sites(p.sink, learnable))
    return Derivatives(derivative(p.score, var("s")), sites, sink)


def _tile(p: Program, env: dict[str, Any], q: torch.Tensor, k: torch.Tensor, hk: torch.Tensor, q0: int, q1: int,
          fdt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The tile's scores X over every key ([B, H, rows, Skv]) and its kept pairs (None: no mask); sets
    env's q, kv and s to the tile's."""
    dev = q.device
    env["q"] = torch.arange(q0, q1, device=dev).view(1, 1, -1, 1)
    env["kv"] = torch.arange(k.shape[2], device=dev).view(1, 1, 1, -1)
    env["s"] = q[:, :, q0:q1] @ k[:, hk].transpose(-1, -2)
    shape = (q.shape[0], q.shape[1], q1 - q0, k.shape[2])
    x = torch.as_tensor(evaluate(p.score, env, fdt), dtype=fdt, device=dev).expand(shape)
    if p.mask is None:
        return x, None
    keep = torch.as_tensor(evaluate(p.mask, env, fdt), device=dev).bool().expand(shape)
    return torch.where(keep, x, torch.tensor(-math.inf, dtype=fdt, device=dev)), keep


def unnormalised_row_sums(p: Program, q: torch.Tensor, k: torch.Tensor, env: dict[str, Any], hk: torch.Tensor,
                          lse: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """sum_k exp(X - LSE) per query row, in q's dtype, over the query tiles holding a row of `rows` ([B, H, Sq]
    bool); 1 elsewhere. A kernel that recomputes P = exp(X - LSE) with a given LSE has this row sum, where 1 is
    right: it differs from 1 where the LSE lost log(count) to a fill's rounding."""
    sums = torch.ones(rows.shape, dtype=q.dtype, device=q.device)
    for q0 in range(0, q.shape[2], BLOCK_M):
        q1 = min(q0 + BLOCK_M, q.shape[2])
        if bool(rows[:, :, q0:q1].any()):
            x, _ = _tile(p, env, q, k, hk, q0, q1, q.dtype)
            sums[:, :, q0:q1] = torch.exp(x - lse[:, :, q0:q1, None].to(q.dtype)).sum(-1)
    return sums


def _sink_factor(p: Program, env: dict[str, Any], lse: torch.Tensor, fdt: torch.dtype) -> torch.Tensor | None:
    if p.sink is None:
        return None
    c = torch.as_tensor(evaluate(p.sink, env, fdt), dtype=fdt, device=lse.device).expand_as(lse)
    return torch.sigmoid(lse - c)


def _probs(x: torch.Tensor) -> torch.Tensor:
    """softmax(X) over the row, zero on masked pairs and on rows with no key: normalised by the row's own sum,
    not by exp(LSE). A row whose every key holds a finite fill (a padded query row under finfo.min) has its
    LSE at the fill, where log(count) is below the fill's rounding (-3.4e38 + 2.6 is -3.4e38): exp(X - LSE)
    would be 1 on every key, not 1/count, while the forward (the kernel's and the interpreter's) divides its
    sum by the row's own denominator."""
    live = torch.isfinite(x)
    m = torch.where(live, x, torch.full_like(x, -math.inf)).amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.where(live, torch.exp(x - m), torch.zeros_like(x))
    total = e.sum(-1, keepdim=True)
    return e / torch.where(total > 0, total, torch.ones_like(total))


def saved_forward(p: Program, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, env: dict[str, Any],
                  hk: torch.Tensor, fdt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """What the forward kernel saves for the backward: O ([B, H, Sq, Dv], the sink applied, before any row
    scale) and the LSE of the scores alone ([B, H, Sq, 1], -inf for a row with no key), computed in fdt
    with no float32 rounding of the scores, so float64 checks the backward's own error."""
    B, H, Sq, _ = q.shape
    o = torch.zeros(B, H, Sq, v.shape[-1], dtype=fdt, device=q.device)
    lse = torch.empty(B, H, Sq, 1, dtype=fdt, device=q.device)
    vh = v[:, hk]
    for q0 in range(0, Sq, BLOCK_M):
        q1 = min(q0 + BLOCK_M, Sq)
        x, _ = _tile(p, env, q, k, hk, q0, q1, fdt)
        row = torch.logsumexp(x, -1, keepdim=True)
        res = _probs(x) @ vh
        f = _sink_factor(p, env, row, fdt)
        if f is not None:
            res = res * f
        elif p.empty_rows == "mean_v":
            res = torch.where(torch.isinf(row), vh.mean(dim=2, keepdim=True), res)
        o[:, :, q0:q1], lse[:, :, q0:q1] = res, row
    return o, lse


def _scatter(grads: dict[str, torch.Tensor], sites: tuple[tuple[Expr, Expr], ...], dx: torch.Tensor,
             keep: torch.Tensor | None, env: dict[str, Any], fdt: torch.dtype) -> None:
    """Add dx * d/d(element) at each site's index into its tensor's gradient."""
    for node, d in sites:
        if node.attr not in grads:
            continue
        g = dx * torch.as_tensor(evaluate(d, env, fdt), dtype=fdt, device=dx.device)
        if keep is not None:  # a derivative may be inf or nan on a masked pair, where P is 0
            g = torch.where(keep, g, torch.zeros_like(g))
        idx = tuple(torch.as_tensor(evaluate(i, env, fdt), device=dx.device).long().expand(g.shape)
                    for i in node.args)
        out = grads[node.attr]
        out.index_put_(idx, g.to(out.dtype), accumulate=True)


def _to_heads(g: torch.Tensor, hk: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Per query head [B, H, ...] summed into the KV heads they read ([B, Hkv, ...]), and over the batch
    where the operand has one batch for all."""
    out = torch.zeros(g.shape[0], like.shape[1], *g.shape[2:], dtype=g.dtype, device=g.device)
    out.index_add_(1, hk, g)
    return out.sum(0, keepdim=True) if like.shape[0] == 1 and g.shape[0] != 1 else out


def attention_backward(p: Program, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, env: dict[str, Any],
                       hk: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, do: torch.Tensor,
                       dlse: torch.Tensor | None, learnable: set[str], fdt: torch.dtype
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """dQ, dK, dV (canonical layouts, as q, k, v) and the gradients of the extra tensors in `learnable`
    (env's "@name"), from the saved O and LSE and the output's gradient dO (and the LSE's, dLSE)."""
    der = derive(p, learnable)
    B, H, Sq, _ = q.shape
    grads = {n: torch.zeros_like(env["@" + n]) for n in learnable}
    vh, kh = v[:, hk], k[:, hk]
    dq = torch.zeros_like(q)
    dk = torch.zeros(B, H, *k.shape[2:], dtype=fdt, device=q.device)
    dv = torch.zeros(B, H, *v.shape[2:], dtype=fdt, device=q.device)
    for q0 in range(0, Sq, BLOCK_M):
        q1 = min(q0 + BLOCK_M, Sq)
        x, keep = _tile(p, env, q, k, hk, q0, q1, fdt)
        row, g_o = lse[:, :, q0:q1], do[:, :, q0:q1]
        prob = _probs(x)
        big_d = (g_o * o[:, :, q0:q1]).sum(-1, keepdim=True)
        f = _sink_factor(p, env, row, fdt)
        g_os = g_o if f is None else g_o * f  # the gradient of the scores' own output O / F
        dx = prob * (g_os @ vh.transpose(-1, -2) - (big_d if f is None else f * big_d)
                     + (0.0 if dlse is None else dlse[:, :, q0:q1]))
        ds = dx * torch.as_tensor(evaluate(der.d_s, env, fdt), dtype=fdt, device=dx.device)
        if keep is not None:
            ds = torch.where(keep, ds, torch.zeros_like(ds))
        dq[:, :, q0:q1] = ds @ kh
        dk += ds.transpose(-1, -2) @ q[:, :, q0:q1]
        dv += prob.transpose(-1, -2) @ g_os
        if f is None and p.empty_rows == "mean_v":  # a row with no key is the mean of V
            empty = torch.isinf(row)
            dv += torch.where(empty, g_o, torch.zeros_like(g_o)).sum(2, keepdim=True) / k.shape[2]
        _scatter(grads, der.score_sites, dx, keep, env, fdt)
        if f is not None:
            _scatter(grads, der.sink_sites, -big_d * (1 - f), None, env, fdt)
    return dq, _to_heads(dk, hk, k), _to_heads(dv, hk, v), grads


def sink_gradients(p: Program, env: dict[str, Any], o: torch.Tensor, do: torch.Tensor, lse_joined: torch.Tensor,
                   names: set[str], fdt: torch.dtype) -> dict[str, torch.Tensor]:
    """The gradients of the sink's learnable tensors in `names`, from the forward's O and dO ([B, H, Sq, Dv])
    and the LSE with the sink joined ([B, H, Sq]: log(sum e^X + e^c), the kernel's). attention_backward's
    dc = -D (1 - F), with 1 - F = e^c / (sum e^X + e^c) = exp(c - lse_joined), added at each site's index.

    A backward kernel that recomputes P = exp(X - lse_joined) needs nothing else of the sink: that P is
    softmax's times F, so dV = P^T dO and dX = P (dP - rowsum(dO O)) are attention_backward's own."""
    der = derive(p, names)
    grads = {n: torch.zeros_like(env["@" + n]) for n in names}
    env = dict(env, q=torch.arange(o.shape[2], device=o.device).view(1, 1, -1, 1))
    big_d = (do.to(fdt) * o.to(fdt)).sum(-1, keepdim=True)
    lj = lse_joined.to(fdt).unsqueeze(-1)
    c = torch.as_tensor(evaluate(p.sink, env, fdt), dtype=fdt, device=o.device).expand_as(lj)
    away = torch.where(torch.isneginf(lj), torch.zeros_like(lj), torch.exp(c - lj))  # no key and no sink: 0
    _scatter(grads, der.sink_sites, -big_d * away, None, env, fdt)
    return grads


class _Attend(torch.autograd.Function):
    """The kernel's part of a program as one autograd node: (q, k, v, learnable extras) -> (O, LSE)."""

    @staticmethod
    def forward(ctx, p, env, hk, names, fdt, q, k, v, *extras):  # noqa: ANN001 (autograd's signature)
        env = dict(env, **{"@" + n: t.detach() for n, t in zip(names, extras)})
        o, lse = saved_forward(p, q, k, v, env, hk, fdt)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.p, ctx.env, ctx.hk, ctx.names, ctx.fdt = p, env, hk, names, fdt
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):  # noqa: ANN001
        q, k, v, o, lse = ctx.saved_tensors
        want = {n for n, need in zip(ctx.names, ctx.needs_input_grad[8:]) if need}
        dq, dk, dv, grads = attention_backward(ctx.p, q, k, v, dict(ctx.env), ctx.hk, o, lse, do, dlse,
                                               want, ctx.fdt)
        return (None,) * 5 + (dq, dk, dv) + tuple(grads.get(n) for n in ctx.names)


def run_with_grad(p: Program, /, *args: Any, **kwargs: Any) -> Any:
    """The program on a call, differentiable: gradients reach every argument that requires them through
    the backward above (the attention) and PyTorch's autograd (prologue, row scale, layout, epilogue)."""
    from .guards import GuardSet
    bad = GuardSet(p.guards, p.signature, len(args)).failing(args, kwargs) if p.guards else None
    if bad is not None:
        raise ValueError(f"this program holds only where {bad} (a guard recorded at capture)")
    bound = bind_args(p.signature, args, kwargs)
    made = run_prologue(p, bound, call_device(bound))
    q, k, v = (to_canonical(operand_value(bound, op, made), op) for op in (p.q, p.k, p.v))
    out_dtype = q.dtype
    fdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, v = q.to(fdt), k.to(fdt), v.to(fdt)
    sizes = sizes_of(p, q, k)
    B, H, Sq, _ = q.shape
    hk = head_index(p, H, sizes["Hkv"]).to(q.device)
    tensors = extra_tensors(p, bound, q.device, made)
    env = index_env(sizes, scalar_values(p, bound, sizes), tensors, B, H, q.device)
    names = tuple(n for n, t in tensors.items() if t.is_floating_point() and t.requires_grad)
    o, lse = _Attend.apply(p, env, hk, names, fdt, q, k, v, *(tensors[n] for n in names))
    if p.row_scale is not None:  # PyTorch scales the kernel's output: autograd carries it, dLSE included
        o = o.to(out_dtype).to(fdt) * row_factor(p.row_scale, dict(env, **{ROW_LSE: lse}), B, H, Sq, fdt)
    res = _to_output_layout(p, o.to(out_dtype), lse[..., 0] if p.out.lse_index >= 0 else None)
    return run_epilogue(p, res, bound) if p.epilogue else res
