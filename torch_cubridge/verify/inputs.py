"""Fresh inputs for verification and shape probes.

q/k/v are redrawn at the requested sizes in the spec's own layout. Extra
tensors are resized along dims that follow b/h/q/kv and redrawn from the same
*family* as the example (bool masks stay masks, sorted ids stay sorted ids,
0/-inf bias stays 0/-inf), so a program that copied example values fails.
"""
from __future__ import annotations

import copy
import functools
import math
from typing import Any

import torch

from ..ir.expr import walk
from ..ir.program import Operand, Program
from ..ir.prologue import FIXED, length_rule, operand_inputs
from .reference import BIG, once

_FOLLOW = {"b": "B", "h": "H", "q": "Sq", "kv": "Skv"}


def operand_shape(op: Operand, sizes: dict[str, int], role: str) -> tuple[int, ...]:
    """The shape of operand `role` (q, k or v): q and k share the head dim D, v has Dv."""
    is_q = role == "q"
    m = {"b": sizes["B"], "h": sizes["H"] if is_q else sizes["Hkv"], "s": sizes["Sq"] if is_q else sizes["Skv"],
         "d": sizes.get("Dv", sizes["D"]) if role == "v" else sizes["D"]}
    return tuple(m[d] for d in op.dims)


def _follow_dims(p: Program, name: str) -> dict[int, str]:
    """dim -> size var for dims of an extra tensor indexed by a bare b/h/q/kv."""
    out: dict[int, str] = {}
    for e in (p.score, p.mask, p.sink, p.row_scale):
        if e is None:
            continue
        for n in walk(e):
            if n.op == "load" and n.attr == name:
                for i, ix in enumerate(n.args):
                    if ix.op == "var" and ix.attr in _FOLLOW:
                        out[i] = _FOLLOW[ix.attr]
    return out


def _sample(ex: torch.Tensor, n: int = 1 << 16) -> torch.Tensor:
    """A strided sample of `ex`'s values: statistics for a redraw need no pass over a 16 GB mask."""
    flat = ex.detach().flatten()
    return flat[:: max(1, flat.numel() // n)]


def few_values(ex: torch.Tensor, most: int = 3) -> torch.Tensor | None:
    """The distinct values of `ex` where it has at most `most` of them (a mask's), else None. A strided
    sample decides first (sorting every value of a paged KV cache, 16M floats, cost 27 s of a 48 s first
    call on the CPU), then every value is checked against the sample's in chunks (a unique over a
    [8, 1, 32k, 32k] mask asked the GPU for 7 GiB)."""
    flat = ex.detach().flatten()
    vals = _sample(flat, 4096).unique()
    if vals.numel() > most:
        return None
    step = 1 << 24
    for i in range(0, flat.numel(), step):
        part = flat[i:i + step]
        if not torch.isin(part, vals).all():
            vals = torch.cat([vals, part[~torch.isin(part, vals)].unique()]).unique()
            if vals.numel() > most:
                return None
    return vals


def _rows(ex: torch.Tensor, n: int = 256) -> torch.Tensor:
    """At most n rows (last dim) of `ex`, spread over it: whether ids are sorted along the last dim."""
    rows = ex.reshape(-1, ex.shape[-1])
    return rows[:: max(1, rows.shape[0] // n)]


def redraw(example: torch.Tensor, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """A tensor of `shape` on the generator's device, drawn from `example`'s family."""
    dev = gen.device
    ex = example.detach()
    if ex.dtype == torch.bool:
        p = float(_sample(ex).float().mean()) if ex.numel() else 0.5
        p = min(max(p, 0.15), 0.85)
        return torch.rand(shape, generator=gen, device=dev) < p
    if not ex.dtype.is_floating_point:
        lo, hi = (int(ex.min()), int(ex.max())) if ex.numel() else (0, 1)
        x = torch.randint(lo, hi + 1, shape, generator=gen, dtype=torch.int64, device=dev)
        if ex.dim() and ex.numel() > 1 and bool((_rows(ex).diff(dim=-1) >= 0).all()):
            x = x.sort(dim=-1).values  # sorted ids (document masks) stay sorted
        return x.to(ex.dtype)
    vals = few_values(ex)
    if vals is not None and 1 <= vals.numel() and (vals.isinf().any() or vals.abs().max() > 1e4 or vals.numel() == 1):
        pick = torch.randint(0, vals.numel(), shape, generator=gen, device=dev)
        if vals.numel() > 1:  # keep most entries unmasked, as in the example
            pick = torch.where(torch.rand(shape, generator=gen, device=dev) < 0.7,
                               torch.full_like(pick, int(vals.abs().argmin())), pick)
        return vals.to(dev)[pick].to(ex.dtype)
    std = float(_sample(ex).float().std()) if ex.numel() > 1 else 1.0
    mean = float(_sample(ex).float().mean()) if ex.numel() else 0.0
    return (torch.randn(shape, generator=gen, device=dev) * (std if std > 0 else 1.0) + mean).to(ex.dtype)


# The fills a mask meets in real code: -inf, finfo.min of each float dtype (transformers' masks),
# -1e9 (older models), -finfo.max (GPT-2's second fill).
FILLS = (-math.inf, torch.finfo(torch.float16).min, torch.finfo(torch.bfloat16).min,
         torch.finfo(torch.float32).min, -1e9, -torch.finfo(torch.float32).max)
WINDOWS = (3, 40, 1 << 30)  # narrower than a 64-key tile, a few tiles, wider than any length
STRUCTURED = 6  # patterns: every fill once, every window twice, whole rows masked in the even ones


def _is_mask_family(ex: torch.Tensor) -> bool:
    if ex.dtype == torch.bool:
        return True
    if not ex.dtype.is_floating_point:
        return False
    vals = few_values(ex)
    return vals is not None and 1 <= vals.numel() and bool(vals.isinf().any() or vals.abs().max() > 1e4)


def structured_mask(like: torch.Tensor, q_dim: int, k_dim: int, pattern: int) -> torch.Tensor:
    """A band (bottom-right aligned) of width WINDOWS[pattern % 3], with the first two and the last
    query rows fully masked in even patterns; bool keeps, or 0 kept and FILLS[pattern] masked."""
    Sq, Skv = like.shape[q_dim], like.shape[k_dim]
    i = torch.arange(Sq, device=like.device)[:, None] + (Skv - Sq)
    j = torch.arange(Skv, device=like.device)[None, :]
    keep = (j <= i) & (j > i - WINDOWS[pattern % len(WINDOWS)])
    if pattern % 2 == 0:
        keep[:2] = False
        keep[-1:] = False
    shape = [1] * like.dim()
    shape[q_dim], shape[k_dim] = Sq, Skv
    keep = keep.view(shape).expand(like.shape)
    if like.dtype == torch.bool:
        return keep.clone()
    fill = torch.tensor(FILLS[pattern % len(FILLS)], dtype=torch.float64).to(like.dtype)
    return torch.zeros(like.shape, dtype=like.dtype, device=like.device).masked_fill(~keep, fill.to(like.device))


def make_inputs(p: Program, example: dict[str, Any], sizes: dict[str, int], seed: int,
                magnitude: float = 1.0, dtype: torch.dtype | None = None,
                pattern: int | None = None, values: bool = True,
                device: torch.device = torch.device("cpu")) -> dict[str, Any]:
    """A bound-argument dict like `example`, at new sizes and with new values.

    pattern: a structured case (see structured_mask) for every mask-like tensor argument that
    follows both the query and the key axis; random redraws otherwise.
    values=False: shapes only (uninitialised tensors), for capture and guards, which read no
    values; drawing them at a 4k call's sizes took seconds per probe.
    device: where redrawn tensors are made (verify.reference.reference_device).
    """
    gen = torch.Generator(device).manual_seed(seed)
    out = dict(example)
    for name, op in (("q", p.q), ("k", p.k), ("v", p.v)):
        if op.step:  # computed by the prologue from arguments redrawn below
            continue
        ex = example[op.arg]
        shape = operand_shape(op, sizes, name)
        if not values:
            out[op.arg] = torch.empty(shape, dtype=dtype or ex.dtype)
            continue
        t = torch.randn(shape, generator=gen, device=device) * magnitude
        out[op.arg] = t.to(dtype or ex.dtype)
    copied: dict[str, Any] = {}
    for x in p.extras:
        if x.arg is None:
            continue
        head, _, attr = x.arg.partition(".")
        if values and x.arg not in example and isinstance(example.get(head), torch.nn.Module):
            # a module's own tensor (e.g. sinks): redraw it on a private copy of the module
            mod = copied.setdefault(head, copy.deepcopy(example[head]))
            t = functools.reduce(getattr, attr.split("."), mod)  # a submodule's tensor: attention.bias
            with torch.no_grad():
                t.copy_(redraw(t, tuple(t.shape), gen))
            out[head] = mod
            continue
    loaded = _loaded(p)
    ex_sizes = example_sizes(p, example)
    lengths = length_dims(p, sizes)
    fed = operand_inputs(p) if lengths else set()
    for path, ex in example.items():
        if not isinstance(ex, torch.Tensor) or path in (p.q.arg, p.k.arg, p.v.arg):
            continue
        # every other tensor argument is redrawn, read by the program or not: a program
        # that baked example values into itself must disagree with the spec here
        follow = _arg_follow(p, loaded, ex_sizes, path, ex)
        shape = tuple(sizes[follow[i]] if follow.get(i) and ex.shape[i] != 1 else ex.shape[i] for i in range(ex.dim()))
        if path in fed:  # an input of a computed operand: only the dims its length rule moves, and the batch
            shape = tuple(lengths.get(path, {}).get(i, sizes["B"] if (path, i) in p.batch else n)
                          for i, n in enumerate(ex.shape))
        if not values:
            out[path] = torch.empty(shape, dtype=ex.dtype)
            continue
        if tuple(shape) == tuple(ex.shape) and ex.numel() >= BIG and not _is_mask_family(ex):
            # its size is pinned and it is large (a page pool: 2 x 268M elements at 32k): one draw serves
            # every trial of this verification, which still differ in everything else (the table, q)
            out[path] = once(("draw", id(ex), tuple(shape), gen.device), ex, lambda: redraw(ex, shape, gen))
        else:
            out[path] = redraw(ex, shape, gen)
        axes = _mask_axes(ex, follow) if pattern is not None else None
        if axes is not None:
            out[path] = structured_mask(out[path], axes["Sq"], axes["Skv"], pattern)
    return out


def _loaded(p: Program) -> dict[str, str]:
    """argument path -> the name the program loads it by (its extras)."""
    return {x.arg: x.name for x in p.extras if x.arg is not None}


def _arg_follow(p: Program, loaded: dict[str, str], ex_sizes: dict[str, int], path: str,
                ex: torch.Tensor) -> dict[int, str]:
    """dim -> the size (B, H, Sq, Skv) a tensor argument's dim follows when the sizes change."""
    if path in loaded:
        follow = _follow_dims(p, loaded[path])
    else:  # guessed by size, except where the trace told the batch's dims (a head count may equal B)
        follow = {i: n for i, n in enumerate(_guess_follow(ex, ex_sizes)) if not (p.batch and n == "B")}
    follow |= {i: "B" for pp, i in p.batch if pp == path}
    # a dim follows its size only where the example's has that size: a buffer longer than the
    # sequence (a causal mask of the model's context, sliced by the spec) keeps its length
    return {i: n for i, n in follow.items() if n and ex.shape[i] == ex_sizes.get(n, ex.shape[i])}


def _mask_axes(ex: torch.Tensor, follow: dict[int, str]) -> dict[str, int] | None:
    """size -> dim of a mask-like argument over both the query and the key axis, which structured cases
    shape; None for any other argument."""
    axes = {n: i for i, n in follow.items() if n and ex.shape[i] != 1}
    return axes if "Sq" in axes and "Skv" in axes and _is_mask_family(ex) else None


def length_dims(p: Program, sizes: dict[str, int]) -> dict[str, dict[int, int]]:
    """path -> {dim: size} for the argument dims computed operands' lengths follow (Operand.length),
    at target lengths `sizes`. ValueError where no size of that dim gives the target (a cache of no
    keys cannot make fewer keys than the new ones; whole pages make a multiple of the page size)."""
    out: dict[str, dict[int, int]] = {}
    for name, op in (("Sq", p.q), ("Skv", p.k), ("Skv", p.v)):
        rule = length_rule(op)
        if rule is None:
            continue
        path, d, off, moved, scale = rule
        if path == FIXED:
            if sizes[name] != off:
                raise ValueError(f"{name}={sizes[name]}: this program's operand always has {off}")
            continue
        n, r = divmod(sizes[name] - off, scale)
        if n < 1 or r:
            raise ValueError(f"{name}={sizes[name]} is no length this program's operand can have "
                             f"({path}.shape[{d}] * {scale} + {off})")
        for mp, md in moved or ((path, d),):
            out.setdefault(mp, {})[md] = n
    return out


def length_steps(p: Program) -> dict[str, int]:
    """How far apart the lengths a program can take lie: 1, a computed operand's scale (pages), or 0
    for a fixed length."""
    out = {"Sq": 1, "Skv": 1}
    for name, op in (("Sq", p.q), ("Skv", p.k)):
        rule = length_rule(op)
        if rule is not None:
            out[name] = 0 if rule[0] == FIXED else rule[4]
    return out


def snap(p: Program, sizes: dict[str, int]) -> dict[str, int]:
    """`sizes` with each length moved down to one the program's operands can have (whole pages), and
    up to the smallest such where it is below."""
    out = dict(sizes)
    for name, op in (("Sq", p.q), ("Skv", p.k)):
        rule = length_rule(op)
        if rule is not None and rule[0] == FIXED:
            out[name] = rule[2]
        elif rule is not None and rule[4] != 1:
            off, scale = rule[2], rule[4]
            out[name] = off + scale * max(1, (sizes[name] - off) // scale)
    return out


def has_structured(p: Program, example: dict[str, Any]) -> bool:
    """Whether some tensor argument is a mask over (query, key) that structured cases can shape: the rule
    make_inputs applies, asked of the arguments without drawing any (drawing them redrew a paged decode's
    2 x 268M-element page pool twice: 12 s of a 32k first call, H100)."""
    ex_sizes = example_sizes(p, example)
    loaded = _loaded(p)
    return any(_mask_axes(ex, _arg_follow(p, loaded, ex_sizes, path, ex)) is not None for path, ex in example.items()
               if isinstance(ex, torch.Tensor) and path not in (p.q.arg, p.k.arg, p.v.arg))


def batch_moved(p: Program, example: dict[str, Any], shapes: list[dict[str, int]]) -> list[dict[str, int]]:
    """`shapes`, and where the program moves with the batch (`Program.batch`) but every shape is at the
    call's batch size, the first again at one sequence more: a literal fitted to B is then run at another."""
    ex_b = example_sizes(p, example)["B"]
    if not p.batch or not shapes or any(s["B"] != ex_b for s in shapes):
        return shapes
    more = dict(shapes[0], B=ex_b + 1)
    return shapes + [more] if within_guards(p, example, more) else shapes


def within_guards(p: Program, example: dict[str, Any], sizes: dict[str, int]) -> bool:
    """Inputs at these sizes satisfy the program's guards (verification stays where the program holds)."""
    if not p.guards:
        return True
    from ..ir.guards import bound_failing
    try:
        bound = make_inputs(p, example, sizes, seed=0, values=False)
    except ValueError:  # no inputs make these lengths (length_dims)
        return False
    return bound_failing(p.guards, bound) is None


def _guess_follow(ex: torch.Tensor, sizes: dict[str, int]) -> list[str | None]:
    by_size = {}
    for name in ("B", "Sq", "Skv"):
        by_size.setdefault(sizes[name], name)
    return [by_size.get(n) if n > 1 else None for n in ex.shape]


def example_sizes(p: Program, example: dict[str, Any]) -> dict[str, int]:
    from ..ir.bind import to_canonical
    from ..ir.prologue import operand_shapes
    ops = operand_shapes(p, example)
    q = to_canonical(ops["q"], p.q)
    k = to_canonical(ops["k"], p.k)
    v = to_canonical(ops["v"], p.v)
    return {"B": q.shape[0], "H": q.shape[1], "Hkv": k.shape[1], "Sq": q.shape[2], "Skv": k.shape[2],
            "D": q.shape[3], "Dv": v.shape[3]}
