"""The per-call fast path: arguments to kernel words with no tensor views.

Everything that depends only on the program (argument positions, layout
permutations, literal scalars, output layout) is worked out once here; a
call then reads shapes and strides, allocates the output and packs ints.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from ..ir.program import Operand, Program


IDENTITY = (0, 1, 2, 3)  # the [B, H, S, D] layout itself, the common case: read as is


def _perm(op: Operand) -> tuple[int | None, int | None, int, int]:
    """Positions of b, h, s, d in the operand's dims (None: no batch dim, or no head dim)."""
    d = op.dims
    perm = (d.index("b") if "b" in d else None, d.index("h") if "h" in d else None, d.index("s"), d.index("d"))
    return IDENTITY if perm == IDENTITY else perm


def canon(t: torch.Tensor, perm: tuple) -> tuple[tuple[int, int, int, int], tuple[int, int, int, int]]:
    """Canonical [B, H, S, D] sizes and strides of t, read without making a view (a missing batch or
    head dim is one of stride 0)."""
    if perm is IDENTITY:
        return t.shape, t.stride()
    sh, st = t.shape, t.stride()
    b, h, s, d = perm
    nb, sb = (1, 0) if b is None else (sh[b], st[b])
    nh, sh_ = (1, 0) if h is None else (sh[h], st[h])
    return (nb, nh, sh[s], sh[d]), (sb, sh_, st[s], st[d])


class Plan:
    def __init__(self, p: Program) -> None:
        self.p = p
        plain = []
        for name in p.signature:
            if name.startswith("*"):
                break
            plain.append(name)
        self.positions = {n: i for i, n in enumerate(plain)}
        self.perms = (_perm(p.q), _perm(p.k), _perm(p.v))
        self.paths = (p.q.arg, p.k.arg, p.v.arg)
        at = [self.positions.get(a) for a in self.paths]
        # q's, k's and v's positions and the largest of them, where all three are named parameters
        self.qkv_at = None if None in at else (at[0], at[1], at[2], max(at))
        self.simple = all(a in self.positions or "." not in a for a in self.paths) and all(
            x.arg is None or "." not in x.arg for x in p.extras)
        self.literal_scalars = all(s.arg is None and s.expr is None for s in p.scalars)
        parts = [x.split("*") for x in p.out.dims]
        self.out_parts = parts
        flat = [c for g in parts for c in g]
        self.out_flat = flat

    def get(self, args: tuple, kwargs: dict, path: str) -> Any:
        i = self.positions.get(path)
        if i is not None and i < len(args):
            return args[i]
        return kwargs[path]

    def out_layout(self, B: int, H: int, S: int, D: int) -> tuple[list[int], tuple[int, int, int, int]]:
        """Shape to allocate, and the canonical strides of that allocation."""
        ext = {"b": B, "h": H, "s": S, "d": D}
        flat = self.out_flat
        strides: dict[str, int] = {}
        acc = 1
        for c in reversed(flat):
            strides[c] = acc
            acc *= ext[c]
        shape = [math.prod(ext[c] for c in g) for g in self.out_parts]
        return shape, (strides.get("b", 0), strides["h"], strides["s"], strides["d"])
