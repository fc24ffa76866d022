"""The block map of a mask that reads data (document ids, prefix lengths): block_prepass.cuh's pre-pass and
scan, run before a kernel whose block_class reads it, at that kernel's own tile (the forward's, or the
backward's). One table row per (batch, head, query tile) where the mask reads b and h; shared otherwise."""
from __future__ import annotations

import functools
import struct

import torch

from ..ir.expr import Expr, free_vars
from .launch import CubinKernel
from .pack import pack_params


def prepass_kernels(cubin: bytes) -> tuple[CubinKernel, CubinKernel]:
    """The pre-pass and its scan from a cubin whose source holds lower.source.prepass_entries (the forward's
    or the backward's)."""
    from ..lower.source import PREPASS_NAME, PREPASS_THREADS, SCAN_NAME
    return (CubinKernel(cubin, PREPASS_NAME, threads=PREPASS_THREADS, smem_bytes=0),
            CubinKernel(cubin, SCAN_NAME, threads=PREPASS_THREADS, smem_bytes=0))


@functools.lru_cache(maxsize=256)
def mask_axes(mask: Expr) -> frozenset[str]:
    """The index variables the mask reads: the table has a row block per batch entry only where it reads
    "b", per head only where it reads "h" (else one, broadcast)."""
    return frozenset(free_vars(mask))


def run_block_prepass(classify, scan, fwd: bytes, fmt, fields, tensors: dict, scal: dict, B: int, H: int,
                      Sq: int, Skv: int, block_m: int, block_n: int, mask: Expr, dev: torch.device,
                      stream: int) -> tuple[dict[str, int], torch.Tensor]:
    """Launch the pre-pass (`classify`) and its scan on `stream` for the program's `mask`; the runtime Params
    words that point the kernel's block_class at the table, and the table (the caller keeps it alive past the
    kernel's launch)."""
    nq, nk = -(-Sq // block_m), -(-Skv // block_n)
    mask_vars = mask_axes(mask)
    bb = B if "b" in mask_vars else 1
    hb = H if "h" in mask_vars else 1
    rows = bb * hb * nq
    table = torch.empty(rows * (nk + 1), dtype=torch.int32, device=dev)  # block_prepass.cuh's layout
    rt = {"blk": table.data_ptr(), "blk_sb": hb * nq * (nk + 1) if bb > 1 else 0,
          "blk_sh": nq * (nk + 1) if hb > 1 else 0, "blk_nk": nk + 1}
    params = pack_params(fmt, fields, tensors, scal, rt)
    classify.launch((nk, nq, bb * hb), (fwd, params, struct.pack("<q", hb)), stream)
    warps = classify.threads // 32
    scan.launch((-(-rows // warps), 1, 1), (struct.pack("<Q", table.data_ptr()), struct.pack("<q", rows),
                                            struct.pack("<q", nk)), stream)
    return rt, table
