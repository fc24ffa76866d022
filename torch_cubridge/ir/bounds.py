"""Bounds of the indices a program reads from its extra tensors.

The kernel reads extra tensors through raw pointers, so every index the
program can form over the whole problem must lie inside the tensor. Interval
analysis over b, h, q, kv gives the range; the spec's own indexing would
have failed (or wrapped a negative index) outside it.

An index that itself reads a tensor (`bias[ids[q], ids[kv]]`) has no static bound: the kernel wraps
it as torch indexing does (a negative index counts from the end) and clamps it into the tensor
(`cb_index`), so a read is never wild. Where the spec's own indexing is in range, that is exactly
the spec's read; an index the spec would reject reads the nearest element instead of raising.
"""
from __future__ import annotations

from .expr import Expr, walk
from .interval import interval
from .program import Program


def load_sites(p: Program) -> list[tuple[str, int, Expr]]:
    sites = []
    for e in (p.score, p.mask, p.sink):
        if e is None:
            continue
        for n in walk(e):
            if n.op == "load":
                sites += [(n.attr, d, ix) for d, ix in enumerate(n.args)]
    return sites


def reads_data(ix: Expr) -> bool:
    """An index that itself reads a tensor: no static bound, clamped in the kernel."""
    return any(n.op == "load" for n in walk(ix))


def data_indexed_dims(p: Program) -> set[tuple[str, int]]:
    """(extra tensor, dim) pairs some read indexes by data: the kernel needs their sizes to clamp."""
    return {(name, d) for name, d, ix in load_sites(p) if reads_data(ix)}


def out_of_bounds(sites: list[tuple[str, int, Expr]], sizes: dict[str, int], scalars: dict[str, float],
                  shapes: dict[str, tuple[int, ...]]) -> str | None:
    """None when every read is inside its tensor, else a message naming the first one that is not."""
    env = {"b": (0.0, sizes["B"] - 1.0), "h": (0.0, sizes["H"] - 1.0), "q": (0.0, sizes["Sq"] - 1.0),
           "kv": (0.0, sizes["Skv"] - 1.0)}
    env.update({k: (float(v), float(v)) for k, v in sizes.items()})
    env.update({k: (float(v), float(v)) for k, v in scalars.items()})
    for name, dim, ix in sites:
        if reads_data(ix):  # wrapped and clamped by the kernel
            continue
        lo, hi = interval(ix, env)
        n = shapes[name][dim]
        if lo < 0 or hi > n - 1:
            return f"{name} has size {n} in dim {dim}, but the program reads indices {lo:g}..{hi:g} there"
    return None
