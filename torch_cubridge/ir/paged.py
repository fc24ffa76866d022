"""Keys and values gathered from pages through a block table, read in place.

A spec that writes vLLM-style paged decode gathers its cache, `k_pages[block_table]`, and reshapes
the result into [B, H, S, D]. The prologue would replay that gather on every call: a copy of the
whole cache (and of every query head's share of it, where the spec repeats KV heads for GQA). When
the operand's prologue chain is that gather followed only by ops that move data (permute, reshape,
expand, clone), key s of sequence b is row s % P of page table[b, s // P], and the kernel can read
it there. This module proves that from the chain: every axis of the result is tracked as digits of
the pages' and the table's axes through each op. Anything else (a slice, a cast, an index of a
computed tensor) gives None, and the prologue's gather serves.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch

from .bind import lookup
from .program import Operand, Program, Step
from .prologue import call_lengths, sized

# A digit of an axis: (source, source dim, size, divisor): its value is (index along the source dim
# // divisor) % size. Sources: "p" the pages, "t" the block table, "x" a broadcast (expand).
Digit = tuple[str, int, int, int]
_MOVES = {"aten.clone.default", "aten.alias.default", "aten.contiguous.default"}


@dataclass(frozen=True)
class PagedRead:
    """How the kernel reads one operand in place: [B, H, S, D] element (b, h, s, d) is
    pages[table[b, s // P], kv_head(h), s % P, d], with the pages' dims as named here."""
    pages: str                # call argument: [num_pages, ...], the page dim first
    table: str                # call argument: [B, pages per sequence], integer
    head_dim: int | None      # the pages' KV head dim (None: one KV head)
    slot_dim: int             # the dim of a key within its page (its size is the page size P)
    head_map: str             # "group": kv head = h // (H // Hkv); "tile": h % Hkv
    heads: int                # the operand's own head count (the spec's Hkv; H where it repeats heads)


def paged_operands(p: Program, bound: dict[str, Any]) -> tuple[PagedRead, PagedRead] | None:
    """How K and V are read in place, where both are such gathers; else None."""
    lengths = call_lengths(p, bound)  # a generic program's reshapes name the lengths ("@size")
    steps = {s.name: replace(s, args=sized(s.args, lengths), kwargs=sized(s.kwargs, lengths)) for s in p.prologue}
    k = _paged(p.k, steps, bound)
    v = _paged(p.v, steps, bound)
    if k is None or v is None or not k.head_map == v.head_map == p.head_map:  # the kernel maps heads as p does
        return None
    kp, vp = lookup(bound, k.pages), lookup(bound, v.pages)
    kt, vt = lookup(bound, k.table), lookup(bound, v.table)
    if kp.shape[k.slot_dim] != vp.shape[v.slot_dim] or kt.shape != vt.shape:
        return None
    if (kp.shape[k.head_dim] if k.head_dim is not None else 1) != (vp.shape[v.head_dim] if v.head_dim is not None else 1):
        return None
    return k, v


def _paged(op: Operand, steps: dict[str, Step], bound: dict[str, Any]) -> PagedRead | None:
    if op.step is None or "b" not in op.dims or "h" not in op.dims:
        return None
    chain = _chain(op.step, steps)
    if chain is None:
        return None
    first = chain[0]
    pages_ref, idx = first.args[0], first.args[1]
    table_ref = idx[0]
    pages, table = lookup(bound, pages_ref[1]), lookup(bound, table_ref[1])
    if not (isinstance(pages, torch.Tensor) and isinstance(table, torch.Tensor)) or table.dim() != 2 \
            or table.dtype not in (torch.int32, torch.int64) or pages.dim() not in (3, 4):
        return None
    axes = [_axis("t", i, n) for i, n in enumerate(table.shape)] + \
           [_axis("p", i, n) for i, n in enumerate(pages.shape) if i > 0]
    sizes = list(table.shape) + list(pages.shape[1:])
    for s in chain[1:]:
        got = _apply(s, axes, sizes)
        if got is None:
            return None
        axes, sizes = got
    if len(axes) != len(op.dims):
        return None
    ax = dict(zip(op.dims, axes))
    heads = sizes[op.dims.index("h")]
    B, per = table.shape
    d_dim = pages.dim() - 1
    if ax["b"] != ([("t", 0, B, 1)] if B > 1 else []) or ax["d"] != [("p", d_dim, pages.shape[d_dim], 1)]:
        return None
    s = ax["s"]
    slot = s[-1] if s and s[-1][0] == "p" and s[-1][3] == 1 and s[-1][2] == pages.shape[s[-1][1]] else None
    if slot is None or s[:-1] != ([("t", 1, per, 1)] if per > 1 else []):
        return None
    head_dim, head_map = _heads(ax["h"], pages)
    if head_map is None:
        return None
    used = {0, slot[1], d_dim} | ({head_dim} if head_dim is not None else set())
    if used | {i for i, n in enumerate(pages.shape) if n == 1} != set(range(pages.dim())):
        return None  # a pages dim read at a fixed index
    return PagedRead(pages_ref[1], table_ref[1], head_dim, slot[1], head_map, heads)


def _heads(h: list[Digit], pages: torch.Tensor) -> tuple[int | None, str | None]:
    """The pages' head dim and the query-head mapping from the h axis's digits."""
    heads = [d for d in h if d[0] == "p"]
    if any(d[0] == "t" or d[3] != 1 for d in h) or len(heads) > 1 or len(h) > 2:
        return None, None
    if not heads:  # one KV head (MQA), broadcast to every query head or a single head
        return None, "group"
    hd = heads[0]
    if hd[2] != pages.shape[hd[1]]:
        return None, None
    if len(h) == 1:
        return hd[1], "group"
    return hd[1], "group" if h.index(hd) == 0 else "tile"  # h = hkv * G + g, or g * Hkv + hkv


def _axis(src: str, dim: int, n: int) -> list[Digit]:
    return [(src, dim, n, 1)] if n > 1 else []


def _chain(name: str, steps: dict[str, Step]) -> list[Step] | None:
    """The steps from the gather to `name`, each reading only the one before it."""
    out = []
    while True:
        s = steps.get(name)
        if s is None:
            return None
        out.append(s)
        if s.op == "aten.index.Tensor":
            a = s.args
            if len(a) == 2 and _is_arg(a[0]) and isinstance(a[1], tuple) and len(a[1]) == 1 and _is_arg(a[1][0]):
                return out[::-1]
            return None
        if not s.args or not (isinstance(s.args[0], tuple) and len(s.args[0]) == 2 and s.args[0][0] == "@step"):
            return None
        name = s.args[0][1]


def _is_arg(x: Any) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and x[0] == "@arg"


def _apply(s: Step, axes: list[list[Digit]], sizes: list[int]) -> tuple[list, list] | None:
    """One data-moving op on the digit lists; None for any other op or argument form."""
    op, a = s.op, s.args
    kw = dict(s.kwargs)
    if op in _MOVES:
        return axes, sizes
    if op == "aten.permute.default":
        dims = [d % len(axes) for d in a[1]]
        return [axes[d] for d in dims], [sizes[d] for d in dims]
    if op == "aten.transpose.int":
        i, j = a[1] % len(axes), a[2] % len(axes)
        axes, sizes = list(axes), list(sizes)
        axes[i], axes[j] = axes[j], axes[i]
        sizes[i], sizes[j] = sizes[j], sizes[i]
        return axes, sizes
    if op == "aten.unsqueeze.default":
        d = a[1] % (len(axes) + 1)
        return axes[:d] + [[]] + axes[d:], sizes[:d] + [1] + sizes[d:]
    if op == "aten.expand.default":
        new = list(a[1])
        if not all(isinstance(n, int) for n in new) or len(new) != len(axes) or kw.get("implicit"):
            return None
        out_axes, out_sizes = [], []
        for ax, n, m in zip(axes, sizes, new):
            if m == -1 or m == n:
                out_axes.append(ax)
                out_sizes.append(n)
            elif n == 1:
                out_axes.append([("x", 0, m, 1)])
                out_sizes.append(m)
            else:
                return None
        return out_axes, out_sizes
    if op in ("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default"):
        return _regroup(axes, sizes, list(a[1]))
    return None


def _regroup(axes: list[list[Digit]], sizes: list[int], new: list) -> tuple[list, list] | None:
    """A reshape: the row-major digits, regrouped into the new sizes (splitting a digit where a new
    size divides it)."""
    if not all(isinstance(n, int) for n in new):
        return None
    total = math.prod(sizes)
    if new.count(-1) == 1:
        rest = math.prod(n for n in new if n != -1)
        new[new.index(-1)] = total // rest if rest else 0
    if math.prod(new) != total or any(n < 0 for n in new):
        return None
    digits = [d for ax in axes for d in ax]
    out = []
    for n in new:
        ax: list[Digit] = []
        need = n
        while need > 1:
            if not digits:
                return None
            src, dim, m, div = digits.pop(0)
            if m <= need:
                if need % m:
                    return None
                ax.append((src, dim, m, div))
                need //= m
            elif m % need == 0:  # split: the outer `need` of this digit here, the inner rest next
                ax.append((src, dim, need, div * (m // need)))
                digits.insert(0, (src, dim, m // need, div))
                need = 1
            else:
                return None
        out.append(ax)
    if digits:
        return None
    return out, list(new)
