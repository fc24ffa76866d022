"""A decode step's new keys and values written into their pages in one launch (csrc/cubridge/paged_append.cuh),
for the flash API's block-table call. Built once per arch into the kernel cache; where the call's layout is
not one the kernel takes, or no kernel can be had (no CUDA, a read-only cache without it, a build error),
`paged_append` returns False and the caller writes with PyTorch."""
from __future__ import annotations

import functools
import struct
import time
from typing import Any

import torch

from .. import cache, config

_SOURCE = '#include "cubridge/paged_append.cuh"\n'
_THREADS = 128
_ENTRY = {torch.int32: "cubridge_paged_append_i32", torch.int64: "cubridge_paged_append_i64"}
_U64, _I64 = struct.Struct("<Q").pack, struct.Struct("<q").pack


def build(arch: str) -> dict[str, Any]:
    """The append kernel's cubin for `arch` in the kernel cache (built there if missing, no GPU needed), as
    `cubridge build` reports a kernel: {"key", "built", "seconds", "kernel"}; raises where it cannot be built."""
    from ..build import compile_cubin, toolchain_id
    from .kernel import source_key
    key = source_key("append", _SOURCE, arch)
    info = {"key": key, "built": False, "kernel": "cubridge_paged_append"}

    def compile_it():
        info["built"] = True
        cubin = compile_cubin(_SOURCE, arch, include_dirs=[config.csrc_dir()])
        return cubin, {"arch": arch, "toolchain": toolchain_id(), "kernel": "paged_append"}
    t0 = time.perf_counter()
    info["cubin"] = cache.get_or_build(key, compile_it).cubin
    info["seconds"] = time.perf_counter() - t0
    return info


@functools.lru_cache(maxsize=None)
def _kernels(arch: str) -> dict[torch.dtype, Any] | None:
    from .launch import CubinKernel
    try:
        cubin = build(arch)["cubin"]
    except Exception:  # read-only without it, no compiler: PyTorch writes instead
        return None
    return {dt: CubinKernel(cubin, name, threads=_THREADS, smem_bytes=0) for dt, name in _ENTRY.items()}


def _takes(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           block_table: torch.Tensor, pos: torch.Tensor) -> bool:
    """The layouts the kernel copies: pages [N, P, Hkv, D] contiguous and alike, new rows [B, 1, Hkv, D] of
    the pages' dtype with D contiguous and 16-byte aligned pieces, a [B, W] int table whose rows are
    contiguous, int32 positions."""
    if not (k_cache.is_cuda and k_cache.dim() == 4 and k_cache.shape == v_cache.shape and k_cache.is_contiguous()
            and v_cache.is_contiguous() and k_cache.dtype == v_cache.dtype and k_cache.element_size() == 2):
        return False
    B, Hkv, D = k.shape[0], k_cache.shape[2], k_cache.shape[3]
    for t in (k, v):
        if t.shape != (B, 1, Hkv, D) or t.dtype != k_cache.dtype or t.device != k_cache.device or t.stride(3) != 1:
            return False
        if t.data_ptr() % 16 or (t.stride(0) * 2) % 16 or (t.stride(2) * 2) % 16:
            return False
    return (D * 2) % 16 == 0 and k_cache.data_ptr() % 16 == 0 and v_cache.data_ptr() % 16 == 0 \
        and block_table.dtype in _ENTRY and block_table.dim() == 2 and block_table.shape[0] == B \
        and block_table.stride(1) == 1 \
        and block_table.device == k_cache.device and pos.dtype == torch.int32 and pos.shape == (B,) \
        and pos.is_contiguous() and pos.device == k_cache.device and 0 < B <= 2 ** 31 - 1


def paged_append(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 block_table: torch.Tensor, pos: torch.Tensor) -> bool:
    """Write k[b] and v[b] at position pos[b] of sequence b's pages (nothing for pos[b] < 0 or past its table),
    on the current stream; False where the kernel does not take the call (nothing written then)."""
    if not _takes(k_cache, v_cache, k, v, block_table, pos):
        return False
    from ..build.arch import arch_for
    kernels = _kernels(arch_for(k_cache.device))
    if kernels is None:
        return False
    N, P, Hkv, D = k_cache.shape
    # one block per kernel parameter: six pointers, then ten 64-bit integers (strides in bytes)
    words = tuple(_U64(t.data_ptr()) for t in (k_cache, v_cache, k, v, block_table, pos)) + tuple(
        _I64(x) for x in (block_table.stride(0), block_table.shape[1], N, P, Hkv, D * 2 // 16,
                          k.stride(0) * 2, k.stride(2) * 2, v.stride(0) * 2, v.stride(2) * 2))
    with torch.cuda.device(k_cache.device):
        stream = torch.cuda.current_stream().cuda_stream
        kernels[block_table.dtype].launch((k.shape[0], 1, 1), words, stream)
    return True
