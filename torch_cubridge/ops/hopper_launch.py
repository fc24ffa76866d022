"""The Hopper (sm_90a) prefill kernel's runner part (ops/runner.py HopperRunner): Q, K and V read by TMA
through tensor maps passed after the Params block, and the tiles numbered by the kernel itself.

Mixed into KernelRunner, whose state it reads (the lowered tile, the kernel, the dtype).
"""
from __future__ import annotations

import torch

from ..lower.tiles import paged_tma_rows
from .errors import SpecServes
from .splitkv import sm_count
from .tma import tensor_map


class HopperLaunch:
    """TMA reads: q's, then K's and V's tensor maps (over their pages where paged, then the PagedKV words);
    a persistent grid of one CTA per multiprocessor walks the tiles where the tile says so."""

    # the copy engine also refuses broadcast (zero-stride) dims: KernelRunner._execute copies such operands
    _tma = True

    def _page_maps(self, kp: torch.Tensor, vp: torch.Tensor, kl: tuple, vl: tuple, P: int) -> tuple:
        """K's and V's pages [pages, Hkv, P, D] as tensor maps, in boxes inside one page (fwd_kernel_sm90.cuh)."""
        rows = paged_tma_rows(P, self.low.tile.block_n)
        if rows is None:  # choose_kernel gathers such pages; a program guarded to P never meets them
            raise SpecServes(f"pages of {P} rows are too small for the Hopper kernel's boxes")
        return tuple(tensor_map(t.data_ptr(), (t.shape[0], hkv, P, d), (t.stride(0), sh, ss, 1), self.dtype, rows)
                     for t, ((_, hkv, _, d), (_, sh, ss, _)) in ((kp, kl), (vp, vl)))

    def _launch(self, blocks: tuple, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qs: tuple, ks: tuple,
                vs: tuple, B: int, H: int, Hkv: int, Sq: int, Skv: int, D: int, Dv: int, di: int, stream: int,
                paged: tuple | None, keep: bool) -> None:
        tile, dt = self.low.tile, self.dtype
        blocks += (tensor_map(q.data_ptr(), (B, H, Sq, D), qs, dt, tile.block_m),)
        if paged is not None:  # K's and V's maps over their pages, then the PagedKV words
            blocks += paged[3] + (paged[2],)
        else:
            blocks += (tensor_map(k.data_ptr(), (B, Hkv, Skv, D), ks, dt, tile.block_n),
                       tensor_map(v.data_ptr(), (B, Hkv, Skv, Dv), vs, dt, tile.block_n))
        nq = -(-Sq // tile.block_m)
        grid = (min(nq * H * B, sm_count(di)) if tile.persistent else nq * H * B, 1, 1)
        self.kernel.launch(grid, blocks, stream)
        if self.replayable and keep:
            self._last = (grid, blocks, stream, di, None)

    def replay_patches(self) -> tuple[tuple[int, int, int, bool], ...]:
        """As KernelRunner's, but k's and v's (and the pages') pointers go also into the three tensor maps
        after the Params block, and nothing else is patched."""
        return self._pointer_patches() + tuple((i, 2 + i, 0, True) for i in range(3))
