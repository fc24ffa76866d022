"""The decode kernel's launch in C for any sizes (csrc/host/decoder.h), made for one runner.

A decode loop over a growing KV cache changes its key length at every step, so no record of the host
fast path (ops/hotpath.py) ever replays it, and every step took the Python runner (17 us a call on the
H100, of a 35 us drop-in call). A Decoder holds what the runner works out from its program alone and does
the rest of a call in C; a call it does not take as it is returns None and the Python runner serves it.
Made only for runners whose calls need nothing per call but reading their arguments (`arguments`): q, K
and V, or K's and V's pages and block tables, and extra tensors passed as arguments (sequence lengths, a
padding mask), whose words of the Params block the Decoder patches per call.
"""
from __future__ import annotations

from typing import Any

import torch

from . import hotpath
from .pack import NO_PAGES, params_template

SIZES = ("B", "H", "Hkv", "Sq", "Skv", "D")  # the order the Decoder reads a program's required sizes in


def _perm(dims: tuple[str, ...]) -> tuple[int, int, int, int]:
    return tuple(dims.index(c) if c in dims else -1 for c in "bhsd")  # type: ignore[return-value]


def per_call_extras(p: Any) -> list:
    """The program's extra tensors that are call arguments, in order: the Decoder reads each call's, patching
    their words into Params (the others are the runner's constants, fixed in the template)."""
    return [x for x in p.extras if x.arg is not None]


def arguments(runner: Any) -> tuple[str, ...] | None:
    """The call arguments a Decoder reads, in its order: q, k, v (or q, K's pages, V's pages, K's table,
    V's table), then the extra tensors that are arguments; None where a call needs more than that (a
    prologue or epilogue step, an argument scalar, a row scale, a returned LSE, an output cast, pieces)."""
    p, low = runner.p, runner.low
    if runner.aux or low.prepass is not None or p.row_scale is not None or runner._row_lse or runner._lse_out \
            or p.epilogue or p.out.dtype != "q" or runner.segments is not None or runner._scale_const is None \
            or runner._lit is None or any(s.arg is not None for s in p.scalars):
        return None
    if runner.paged is not None:  # the gathers are the kernel's own reads; nothing else may be computed
        kr, vr = runner.paged
        names = (p.q.arg, kr.pages, vr.pages, kr.table, vr.table)
        if p.q.step is not None:
            return None
    elif p.prologue:
        return None
    else:
        names = (p.q.arg, p.k.arg, p.v.arg)
    if any(x.step is not None for x in p.extras):
        return None
    names += tuple(x.arg for x in per_call_extras(p))
    # named parameters (or keyword-only ones), not paths into a container argument
    if not all(n in runner.plan.positions or "." not in n for n in names) or len(names) > 5 + 6:
        return None
    return names


def _pages_perm(r: Any) -> tuple[int, int, int, int]:
    """A page operand's (b, h, s, d) positions: no batch dim (the table gives it), its slot dim as s."""
    rank = max(r.slot_dim, r.head_dim or 0) + 2  # the head dim last (runner._pages reads shape[-1])
    return (-1, -1 if r.head_dim is None else r.head_dim, r.slot_dim, rank - 1)


def make(runner: Any, device: int, capturing: Any, sm_count: int, ctas_per_sm: int, min_blocks: int) -> Any | None:
    """The C Decoder for `runner` on `device`, or None while the host module is not built (or cannot be)."""
    mod = hotpath.module()
    if mod is None:
        return None
    p, tile, kern = runner.p, runner.low.tile, runner.kernel
    out_dims = tuple(tuple("bhsd".index(c) for c in group) for group in runner.plan.out_parts)
    ops = (p.q, p.k, p.v)
    ranks = tuple(len(o.dims) for o in ops)
    perms = tuple(_perm(o.dims) for o in ops)
    paged: tuple = ()
    if runner.paged is not None:
        kv = tuple(_pages_perm(r) for r in runner.paged)
        ranks, perms = (ranks[0],) + tuple(pm[3] + 1 for pm in kv), (perms[0],) + kv
        paged = (runner.paged[0].heads, torch.int32, torch.int64)
    dev = torch.device("cuda", device)
    per_call = per_call_extras(p)
    consts = {x.name: runner._const(x, dev) for x in p.extras if x.arg is None}
    params = params_template(runner.fmt, runner.low.params, consts, runner._lit, runner.per_call_ranks)
    bounds = None
    if runner._sites:
        names, fixed = [x.name for x in per_call], {n: tuple(t.shape) for n, t in consts.items()}

        def in_bounds(B: int, H: int, Hkv: int, Sq: int, Skv: int, D: int, shapes: tuple) -> bool:
            return runner.reads_in_bounds((B, H, Hkv, Sq, Skv, D), {**fixed, **dict(zip(names, shapes))})
        bounds = in_bounds
    return mod.Decoder(torch.Tensor, runner.dtype, ranks, perms, out_dims, runner.head_dim, runner.value_dim,
                       tile.block_m, tile.block_n, kern.handle(device), kern.threads, kern.smem_bytes, device,
                       float(runner._scale_const), params, NO_PAGES, ctas_per_sm, sm_count, min_blocks,
                       torch._C._cuda_getCurrentRawStream, capturing, torch.is_grad_enabled,
                       tuple((SIZES.index(name), val) for name, val in p.requires), paged,
                       tuple((getattr(torch, x.dtype), x.rank) for x in per_call), runner.per_call_words, bounds)
