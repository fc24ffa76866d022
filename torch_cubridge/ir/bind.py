"""Binding a call's arguments to a program's inputs (shared by interpreter and ops)."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: Program.run and str() call into this module
    from .program import Operand, Program

from typing import Any

import torch

from ..errors import UnsupportedSpec


def bind_args(signature: tuple[str, ...], args: tuple, kwargs: dict) -> dict[str, Any]:
    """Map names (and "name.attr" paths resolved lazily) to call values."""
    out: dict[str, Any] = {}
    pos = list(args)
    rest = dict(kwargs)
    for name in signature:
        if name.startswith("**"):
            for k, v in rest.items():
                out[f"{name[2:]}.{k}"] = v
            rest = {}
        elif name.startswith("*"):
            for i, v in enumerate(pos):
                out[f"{name[1:]}.{i}"] = v
            pos = []
        elif pos:
            out[name] = pos.pop(0)
        elif name in rest:
            out[name] = rest.pop(name)
    if pos or rest:
        raise TypeError(f"unexpected arguments: {len(pos)} positional, {sorted(rest)}")
    return out


def lookup(bound: dict[str, Any], path: str) -> Any:
    """Resolve "name" or "name.attr.attr" (module attributes such as sinks)."""
    if path in bound:
        return bound[path]
    head, _, tail = path.partition(".")
    if head not in bound:
        raise TypeError(f"missing argument {head!r}")
    obj = bound[head]
    for part in tail.split("."):
        obj = getattr(obj, part)
    return obj


def call_device(bound: dict[str, Any]) -> torch.device:
    """The device of a call: its first tensor argument's (the CPU when it has none)."""
    return next((t.device for t in bound.values() if isinstance(t, torch.Tensor)), torch.device("cpu"))


def operand_value(bound: dict[str, Any], op: Operand, made: dict[str, Any]) -> Any:
    """q, k or v of a call: its argument, or the prologue's result (`made`, by step) when computed."""
    return made[op.step] if op.step else lookup(bound, op.arg)


def to_canonical(t: torch.Tensor, op: Operand) -> torch.Tensor:
    """View an operand as [B, H, S, D] (rank-3 operands get B = 1, or H = 1 for keys shared by all heads)."""
    if t.dim() != len(op.dims):
        raise ValueError(f"expected a rank-{len(op.dims)} tensor for layout {op.dims}, got shape {tuple(t.shape)}")
    dims = list(op.dims)
    for missing in [c for c in "bh" if c not in dims]:  # rank 3: batch 1, or one head shared by all
        t, dims = t.unsqueeze(0), [missing] + dims
    return t.permute([dims.index(c) for c in "bhsd"])


def as_result(p: "Program", out: Any, lse: torch.Tensor | None = None, q_dtype: torch.dtype | None = None) -> Any:
    """The attention output in the spec's result: alone, or at its place in a tuple whose other items
    (attention weights) are None, the rows' log-sum-exp at its own place where the spec returns it
    (`lse`: [B, H, Sq], put in the spec's layout and dtype here). With an epilogue the epilogue's last step
    makes the result instead."""
    if not p.out.tuple_len or p.epilogue:
        return out
    full: list[Any] = [None] * p.out.tuple_len
    full[p.out.index] = out
    if p.out.lse_index >= 0:
        if lse is None:
            raise ValueError("this program returns the rows' log-sum-exp, and none was computed")
        full[p.out.lse_index] = lse_layout(p, lse, q_dtype or out.dtype)
    return tuple(full)


def lse_layout(p: "Program", lse: torch.Tensor, q_dtype: torch.dtype) -> torch.Tensor:
    """[B, H, Sq] log-sum-exp in the layout Output.lse_dims names ("1": a kept unit dim; no "b": the batch
    of one a rank-3 query has) and dtype ("q": the query's)."""
    named = [d for d in p.out.lse_dims if d != "1"]
    t = lse if "b" in named else lse.squeeze(0)
    t = t.permute([[c for c in "bhs" if c in named].index(d) for d in named])
    shape, it = [], iter(t.shape)
    for d in p.out.lse_dims:
        shape.append(1 if d == "1" else next(it))
    dt = q_dtype if p.out.lse_dtype == "q" else getattr(torch, p.out.lse_dtype)
    return t.reshape(shape).to(dt)


def sizes_of(p: Program, q: torch.Tensor, k: torch.Tensor) -> dict[str, int]:
    B, H, Sq, D = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    sizes = {"B": B, "H": H, "Hkv": Hkv, "Sq": Sq, "Skv": Skv, "D": D}
    for name, val in p.requires:
        if sizes[name] != val:
            raise ValueError(f"this program was captured with {name}={val} and is only valid there "
                             f"(got {name}={sizes[name]}); transfer the spec again at the new shape")
    return sizes


def scalar_values(p: Program, bound: dict[str, Any], sizes: dict[str, int]) -> dict[str, float | int]:
    from .interval import interval
    vals: dict[str, float | int] = {}
    for s in p.scalars:
        if s.arg is not None:
            v = lookup(bound, s.arg)
        elif s.expr is not None:
            v = interval(s.expr, {k: (x, x) for k, x in sizes.items()})[0]
        else:
            v = s.value
        if v is None:
            raise UnsupportedSpec(f"scalar {s.name} has no value", op="scalar")
        vals[s.name] = int(v) if s.kind == "int" else float(v)
    return vals


def extra_tensors(p: Program, bound: dict[str, Any], device: torch.device,
                  made: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Extra tensors by name; `made`: the prologue's results by step (ir.prologue.run_prologue)."""
    out = {}
    for x in p.extras:
        if x.step is not None:
            t = made[x.step]
        elif x.arg is not None:
            t = lookup(bound, x.arg)
        else:
            t = torch.tensor(x.value, dtype=getattr(torch, x.dtype))
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{x.arg} must be a tensor")
        if t.dim() != x.rank:
            raise ValueError(f"{x.arg or x.name} must have rank {x.rank}, got {t.dim()}")
        out[x.name] = t.to(device)
    return out


def head_index(p: Program, H: int, Hkv: int) -> torch.Tensor:
    h = torch.arange(H)
    if H % Hkv:
        raise ValueError(f"{H} query heads are not a multiple of {Hkv} key/value heads")
    return h // (H // Hkv) if p.head_map == "group" else h % Hkv

