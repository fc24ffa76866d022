"""Tensor maps for the Hopper kernel's TMA copies (csrc/cubridge/tma.cuh).

Q, K and V are described as 4-D tensors [B][H][S][D] (D innermost, unit
stride), read in boxes of 64 columns x `rows` rows with the 128-byte swizzle
the wgmma descriptors expect; rows past S read as zeros. A map is 128 opaque
bytes passed by value; encoding one is a host-only driver call, cached per
(pointer, sizes, strides) because a serving loop reuses its buffers.
"""
from __future__ import annotations

import ctypes

import torch

from .launch import CudaDriverError, libcuda

_DTYPE = {torch.bfloat16: 9, torch.float16: 6}  # CU_TENSOR_MAP_DATA_TYPE_{BFLOAT16,FLOAT16}
_INTERLEAVE_NONE, _SWIZZLE_128B, _L2_256B, _OOB_ZERO = 0, 3, 3, 0
_CACHE_MAX = 512
_cache: dict[tuple, bytes] = {}


def no_broadcast(sizes: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """What the copy engine adds to the 16-byte alignment the cp.async kernel needs already
    (rules.rows_aligned): no zero-stride dim of size > 1."""
    return all(st > 0 or n == 1 for st, n in zip(strides[:3], sizes[:3]))


def tensor_map(ptr: int, sizes: tuple[int, int, int, int], strides: tuple[int, int, int, int],
               dtype: torch.dtype, rows: int) -> bytes:
    """The tensor map of a [B, H, S, D] view (strides in elements) with boxes of 64 x rows."""
    key = (ptr, sizes, strides, dtype, rows)
    hit = _cache.get(key)
    if hit is not None:
        return hit
    B, H, S, D = sizes
    # innermost first; a size-1 dim's stride is never used, so give it a valid one
    dims = [D, S, H, B]
    el = 2
    st, inner = [], D * el
    for n, s in zip((S, H, B), (strides[2], strides[1], strides[0])):
        b = s * el if n > 1 else inner
        st.append(b)
        inner = max(inner, b * n)
    cu = libcuda()
    if cu.encode_tiled is None:
        raise CudaDriverError("this CUDA driver has no cuTensorMapEncodeTiled (needs CUDA 12)")
    out = (ctypes.c_uint64 * 16)()
    g_dim = (ctypes.c_uint64 * 4)(*dims)
    g_str = (ctypes.c_uint64 * 3)(*st)
    box = (ctypes.c_uint32 * 4)(64, rows, 1, 1)
    one = (ctypes.c_uint32 * 4)(1, 1, 1, 1)
    rc = cu.encode_tiled(ctypes.addressof(out), _DTYPE[dtype], 4, ctypes.c_void_p(ptr), g_dim, g_str, box, one,
                         _INTERLEAVE_NONE, _SWIZZLE_128B, _L2_256B, _OOB_ZERO)
    cu.check(rc, f"cuTensorMapEncodeTiled(sizes={sizes}, strides={strides}, rows={rows})")
    blob = bytes(out)
    if len(_cache) >= _CACHE_MAX:
        _cache.clear()
    _cache[key] = blob
    return blob
