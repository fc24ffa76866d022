"""K and V read where they lie (ops/runner.py KernelRunner): from pages through block tables, or as the
pieces a spec concatenates. Each gives the kernel K's and V's canonical [B, Hkv, S, D] sizes and strides
over what it reads and the words that describe it (PagedKV, SegKV: ops/pack.py), after the checks the
kernels need (rules.pool_fits, rules.rows_aligned).

Mixed into KernelRunner, whose state it reads (the program, the reads, the dtype).
"""
from __future__ import annotations

import itertools
from typing import Any

import torch

from ..ir.bind import lookup, to_canonical
from ..ir.paged import PagedRead
from .errors import SpecServes
from .pack import SEG_PIECES, pack_paged, pack_seg, page_div_word
from .rules import pool_fits, rows_aligned


class KVReads:
    def _pieces(self, ks: list[torch.Tensor], vs: list[torch.Tensor]) -> tuple:
        """(K's first piece, V's, K's and V's canonical [B, Hkv, S, D] sizes and strides, the SegKV
        words): key s lies in the piece whose span holds it (ir/segments.py). Pieces the kernel cannot
        read where they lie (rows not 16-byte aligned, another dtype) are joined here, as the spec does."""
        ck = [to_canonical(t, self.p.k) for t in ks]
        cv = [to_canonical(t, self.p.v) for t in vs]
        if not (self._readable(ck) and self._readable(cv)):
            ck, cv = [torch.cat(ck, 2).contiguous()], [torch.cat(cv, 2).contiguous()]
        n = SEG_PIECES
        ends = lambda ts: list(itertools.accumulate(t.shape[2] for t in ts))  # noqa: E731
        ke, ve = ends(ck), ends(cv)
        pad = lambda xs, fill: xs + [fill] * (n - len(xs))  # noqa: E731
        st = lambda ts, i: pad([t.stride(i) for t in ts], 0)  # noqa: E731
        words = pack_seg(*pad([t.data_ptr() for t in ck], ck[0].data_ptr()),
                         *pad([t.data_ptr() for t in cv], cv[0].data_ptr()),
                         *st(ck, 0), *st(ck, 1), *st(ck, 2), *st(cv, 0), *st(cv, 1), *st(cv, 2),
                         *pad(ke, ke[-1]), *pad(ve, ve[-1]))
        (B, H, _, D), (_, _, _, Dv) = ck[0].shape, cv[0].shape
        return ck[0], cv[0], ((B, H, ke[-1], D), ck[0].stride()), ((B, cv[0].shape[1], ve[-1], Dv), cv[0].stride()), words

    def _readable(self, ts: list[torch.Tensor]) -> bool:
        """Pieces of one [B, Hkv, *, D] shape the decode kernel's 16-byte copies read where they lie."""
        B, H, _, D = ts[0].shape
        return all(t.shape[0] == B and t.shape[1] == H and t.shape[3] == D and t.dtype == self.dtype
                   and t.device == ts[0].device and t.stride(3) == 1 and t.data_ptr() % 16 == 0
                   and all(t.stride(i) % 8 == 0 for i in range(3)) for t in ts)

    def _pages(self, bound: dict[str, Any]) -> tuple:
        """(K pages, V pages, their canonical [B, Hkv, S, D] sizes and strides, the PagedKV words, and on
        the Hopper kernel the tensor maps of K's and V's pages): key s of sequence b is row s % P of page
        table[b, s // P] (ir/paged.py)."""
        kr, vr = self.paged
        kp, vp = lookup(bound, kr.pages), lookup(bound, vr.pages)
        kt, vt = lookup(bound, kr.table), lookup(bound, vr.table)
        if kt.dtype != vt.dtype or kt.device != kp.device or vt.device != vp.device:
            raise SpecServes("the block tables differ in dtype or lie on another device than the pages")
        B, per = kt.shape
        P = kp.shape[kr.slot_dim]
        if not pool_fits(kp.shape[0], vp.shape[0]):  # an empty pool: the spec's own gather raises
            raise SpecServes("a pool of 2^31 pages or more: the kernels read table entries in 32 bits"
                             if max(kp.shape[0], vp.shape[0]) >= 2 ** 31 else "an empty pool of pages")

        def layout(t: torch.Tensor, r: PagedRead) -> tuple:
            st = t.stride()
            hkv, sh = (t.shape[r.head_dim], st[r.head_dim]) if r.head_dim is not None else (1, 0)
            if not rows_aligned(t.data_ptr(), (st[0], sh, st[r.slot_dim], st[-1])):
                raise SpecServes("the pages' rows are not 16-byte aligned for the paged kernel")
            return (B, hkv, per * P, t.shape[-1]), (0, sh, st[r.slot_dim], 1)

        words = pack_paged(kt.data_ptr(), vt.data_ptr(), kt.stride(0), kt.stride(1), vt.stride(0), vt.stride(1),
                           kp.stride(0), vp.stride(0), kp.shape[0], vp.shape[0], P, page_div_word(P),
                           int(kt.dtype == torch.int64))
        kl, vl = layout(kp, kr), layout(vp, vr)
        return kp, vp, kl, vl, words, self._page_maps(kp, vp, kl, vl, P)

    def _page_maps(self, kp: torch.Tensor, vp: torch.Tensor, kl: tuple, vl: tuple, P: int) -> tuple | None:
        """What the kind reads K's and V's pages through besides the PagedKV words (HopperLaunch: tensor maps)."""
        return None
