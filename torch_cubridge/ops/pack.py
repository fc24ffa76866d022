"""Packing kernel arguments: FwdArgs and Params as flat arrays of 8-byte words."""
from __future__ import annotations

import struct
from typing import Any

import torch

from ..ir.segments import MAX_PIECES
from ..lower.variant import ParamField

# FwdArgs: 5 pointers, 12 strides, 5 sizes, 1 double (csrc/cubridge/variant.cuh)
FWD_FORMAT = struct.Struct("<5Q12q5qd")


# PagedKV: 2 table pointers, 11 integers (csrc/cubridge/paged.cuh); all zero where unpaged. Packed here by
# runner._pages and in C by the Decoder (csrc/host/decoder.h): a change to the struct changes all three;
# tests/test_decoder_gpu.py holds the two packings' launches equal bit for bit
PAGED_FORMAT = struct.Struct("<2Q11q")
NO_PAGES = PAGED_FORMAT.pack(*([0] * 13))


def page_div_word(page: int) -> int:
    """PagedKV::page_div for pages of `page` keys (paged.cuh PageDiv): n // page == (umulhi(n, m) + n) >> l for
    0 <= n < 2^31, with l = ceil(log2(page)) and m = 2^32 (2^l - page) // page + 1 (below 2^32), as m | l << 32.
    The C Decoder (csrc/host/decoder.h) makes the same word."""
    if page < 1:
        raise ValueError(f"pages of {page} keys")
    log = (page - 1).bit_length()
    return ((1 << 32) * ((1 << log) - page) // page + 1) | log << 32


# SegKV: K's and V's piece pointers, their b/h/s strides, their cumulative ends (decode_kernel.cuh)
SEG_PIECES = MAX_PIECES
SEG_FORMAT = struct.Struct(f"<{2 * SEG_PIECES}Q{8 * SEG_PIECES}q")


def pack_fwd_raw(ptrs: tuple[int, int, int, int, int], q_st: tuple, k_st: tuple, v_st: tuple, o_st: tuple,
                 sizes: tuple[int, int, int, int, int], scale: float) -> bytes:
    """The same FwdArgs from plain ints (the per-call fast path builds no views)."""
    return FWD_FORMAT.pack(*ptrs, *q_st, *k_st, *v_st, *o_st, *sizes, scale)


def params_format(fields: tuple[ParamField, ...]) -> struct.Struct:
    if not fields:
        return struct.Struct("<q")
    return struct.Struct("<" + "".join("d" if f.kind == "f64" else ("Q" if f.kind in ("ptr", "rt_ptr") else "q") for f in fields))


def pack_params(fmt: struct.Struct, fields: tuple[ParamField, ...], tensors: dict[str, torch.Tensor],
                scalars: dict[str, Any], runtime: dict[str, int] | None = None) -> bytes:
    if not fields:
        return fmt.pack(0)
    vals: list[Any] = []
    for f in fields:
        if f.kind == "ptr":
            vals.append(tensors[f.source].data_ptr())
        elif f.kind == "stride":
            vals.append(tensors[f.source].stride(f.dim))
        elif f.kind == "size":
            vals.append(tensors[f.source].shape[f.dim])
        elif f.kind == "f64":
            vals.append(float(scalars[f.source]))
        elif f.kind in ("rt_ptr", "rt_i64"):
            vals.append(int(runtime[f.source]))
        else:
            vals.append(int(scalars[f.source]))
    return fmt.pack(*vals)


_PER_CALL_KINDS = ("ptr", "stride", "size")


def per_call_words(fields: tuple[ParamField, ...], per_call: dict[str, int]) -> tuple[tuple[int, int, int, int], ...]:
    """Where the words of the `per_call` extra tensors (name: rank) go in Params: (byte offset, kind: 0
    pointer, 1 stride, 2 size, the tensor's index in per_call, dim). Every word is 8 bytes (params_format)."""
    names = list(per_call)
    return tuple((8 * i, _PER_CALL_KINDS.index(f.kind), names.index(f.source),
                  f.dim % per_call[f.source] if f.kind != "ptr" else 0)
                 for i, f in enumerate(fields) if f.source in per_call and f.kind in _PER_CALL_KINDS)


def params_template(fmt: struct.Struct, fields: tuple[ParamField, ...], tensors: dict[str, torch.Tensor],
                    scalars: dict[str, Any], per_call: dict[str, int]) -> bytes:
    """Params with the words of the `per_call` extra tensors (per_call_words) left for each call to fill."""
    stand_in = {n: torch.empty((0,) * r) for n, r in per_call.items()}  # its words are overwritten per call
    return pack_params(fmt, fields, {**tensors, **stand_in}, scalars)
