"""Fresh inputs for verification and shape probes.

q/k/v are redrawn at the requested sizes in the spec's own layout. Extra
tensors are resized along dims that follow b/h/q/kv and redrawn from the same
*family* as the example (bool masks stay masks, sorted ids stay sorted ids,
0/-inf bias stays 0/-inf), so a program that copied example values fails.
"""
from __future__ import annotations

import copy
from typing import Any

import torch

from ..ir.expr import walk
from ..ir.program import Operand, Program

_FOLLOW = {"b": "B", "h": "H", "q": "Sq", "kv": "Skv"}


def operand_shape(op: Operand, sizes: dict[str, int], is_q: bool) -> tuple[int, ...]:
    m = {"b": sizes["B"], "h": sizes["H"] if is_q else sizes["Hkv"], "s": sizes["Sq"] if is_q else sizes["Skv"],
         "d": sizes["D"] if is_q else sizes.get("Dv", sizes["D"])}
    return tuple(m[d] for d in op.dims)


def _follow_dims(p: Program, name: str) -> dict[int, str]:
    """dim -> size var for dims of an extra tensor indexed by a bare b/h/q/kv."""
    out: dict[int, str] = {}
    for e in (p.score, p.mask, p.sink):
        if e is None:
            continue
        for n in walk(e):
            if n.op == "load" and n.attr == name:
                for i, ix in enumerate(n.args):
                    if ix.op == "var" and ix.attr in _FOLLOW:
                        out[i] = _FOLLOW[ix.attr]
    return out


def redraw(example: torch.Tensor, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    ex = example.detach().cpu()
    if ex.dtype == torch.bool:
        p = float(ex.float().mean()) if ex.numel() else 0.5
        p = min(max(p, 0.15), 0.85)
        return torch.rand(shape, generator=gen) < p
    if not ex.dtype.is_floating_point:
        lo, hi = (int(ex.min()), int(ex.max())) if ex.numel() else (0, 1)
        x = torch.randint(lo, hi + 1, shape, generator=gen, dtype=torch.int64)
        if ex.dim() and ex.numel() > 1 and bool((ex.diff(dim=-1) >= 0).all()):
            x = x.sort(dim=-1).values  # sorted ids (document masks) stay sorted
        return x.to(ex.dtype)
    vals = ex.flatten().unique()
    if 1 <= vals.numel() <= 3 and (vals.isinf().any() or vals.abs().max() > 1e4 or vals.numel() == 1):
        pick = torch.randint(0, vals.numel(), shape, generator=gen)
        if vals.numel() > 1:  # keep most entries unmasked, as in the example
            pick = torch.where(torch.rand(shape, generator=gen) < 0.7, torch.full_like(pick, int(vals.abs().argmin())), pick)
        return vals[pick].to(ex.dtype)
    std = float(ex.float().std()) if ex.numel() > 1 else 1.0
    mean = float(ex.float().mean()) if ex.numel() else 0.0
    return (torch.randn(shape, generator=gen) * (std if std > 0 else 1.0) + mean).to(ex.dtype)


def make_inputs(p: Program, example: dict[str, Any], sizes: dict[str, int], seed: int,
                magnitude: float = 1.0, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """A bound-argument dict like `example`, at new sizes and with new values."""
    gen = torch.Generator().manual_seed(seed)
    out = dict(example)
    for name, op in (("q", p.q), ("k", p.k), ("v", p.v)):
        ex = example[op.arg]
        shape = operand_shape(op, sizes, name == "q")
        t = torch.randn(shape, generator=gen) * magnitude
        out[op.arg] = t.to(dtype or ex.dtype)
    copied: dict[str, Any] = {}
    for x in p.extras:
        if x.arg is None:
            continue
        head, _, attr = x.arg.partition(".")
        if x.arg not in example and isinstance(example.get(head), torch.nn.Module):
            # a module's own tensor (e.g. sinks): redraw it on a private copy of the module
            mod = copied.setdefault(head, copy.deepcopy(example[head]))
            t = getattr(mod, attr)
            with torch.no_grad():
                t.copy_(redraw(t, tuple(t.shape), gen))
            out[head] = mod
            continue
    loaded = {x.arg: x.name for x in p.extras if x.arg is not None}
    ex_sizes = example_sizes(p, example)
    for path, ex in example.items():
        if not isinstance(ex, torch.Tensor) or path in (p.q.arg, p.k.arg, p.v.arg):
            continue
        # every other tensor argument is redrawn, read by the program or not: a program
        # that baked example values into itself must disagree with the spec here
        follow = _follow_dims(p, loaded[path]) if path in loaded else {
            i: n for i, n in enumerate(_guess_follow(ex, ex_sizes))}
        shape = tuple(sizes[follow[i]] if follow.get(i) and ex.shape[i] != 1 else ex.shape[i] for i in range(ex.dim()))
        out[path] = redraw(ex, shape, gen)
    return out


def within_guards(p: Program, example: dict[str, Any], sizes: dict[str, int]) -> bool:
    """Inputs at these sizes satisfy the program's guards (verification stays where the program holds)."""
    if not p.guards:
        return True
    from ..ir.guards import bound_failing
    return bound_failing(p.guards, make_inputs(p, example, sizes, seed=0)) is None


def _guess_follow(ex: torch.Tensor, sizes: dict[str, int]) -> list[str | None]:
    by_size = {}
    for name in ("B", "Sq", "Skv"):
        by_size.setdefault(sizes[name], name)
    return [by_size.get(n) if n > 1 else None for n in ex.shape]


def example_sizes(p: Program, example: dict[str, Any]) -> dict[str, int]:
    from ..ir.bind import to_canonical
    q = to_canonical(example[p.q.arg], p.q)
    k = to_canonical(example[p.k.arg], p.k)
    v = to_canonical(example[p.v.arg], p.v)
    return {"B": q.shape[0], "H": q.shape[1], "Hkv": k.shape[1], "Sq": q.shape[2], "Skv": k.shape[2],
            "D": q.shape[3], "Dv": v.shape[3]}
