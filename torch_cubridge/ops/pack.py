"""Packing kernel arguments: FwdArgs, PagedKV, SegKV and Params as flat arrays of 8-byte words.

The structs' layouts are the kernel headers' own (ops/layout.py reads them); each packer here takes the
words in the order named beside it, by field name, so a reordered struct still packs right and a field
added to one is an error at import, not a shifted word.
"""
from __future__ import annotations

import functools
import struct
from typing import Any

import torch

from ..ir.segments import MAX_PIECES
from ..lower.variant import ParamField
from . import layout
from .rules import page_div

FWD_LAYOUT = layout.read("FwdArgs")
FWD_FORMAT = FWD_LAYOUT.format
# the order the runners supply FwdArgs' words in (the backward's BwdArgs begins with them)
FWD_WORDS = ("q", "k", "v", "o", "lse", "q_sb", "q_sh", "q_ss", "k_sb", "k_sh", "k_ss", "v_sb", "v_sh", "v_ss", "o_sb",
             "o_sh", "o_ss", "B", "Hq", "Hkv", "Sq", "Skv", "scale")
_pack_fwd = FWD_LAYOUT.packer(FWD_WORDS)

# PagedKV, all zero where unpaged. Packed here for the Python runner (runner._pages) and in C by the Decoder
# (csrc/host/decoder.h) into the struct rendered from the same header (ops/host_header.py);
# tests/ops/test_decoder_gpu.py holds the two packings' launches equal bit for bit
PAGED_LAYOUT = layout.read("PagedKV")
PAGED_FORMAT = PAGED_LAYOUT.format
pack_paged = PAGED_LAYOUT.packer(("k_table", "v_table", "kt_sb", "kt_sp", "vt_sb", "vt_sp", "k_sp", "v_sp", "k_pages",
                            "v_pages", "page", "page_div", "table64"))
NO_PAGES = PAGED_FORMAT.pack(*([0] * len(PAGED_LAYOUT.words)))


@functools.lru_cache(maxsize=None)
def page_div_word(page: int) -> int:
    """PagedKV::page_div for pages of `page` keys (rules.page_div, which the C Decoder shares); kept per
    page size, so a call pays a cache lookup."""
    if page < 1:
        raise ValueError(f"pages of {page} keys")
    return page_div(page)


# SegKV: K's and V's piece pointers, their b/h/s strides, their cumulative ends (decode_kernel.cuh)
_SEG = layout.read("SegKV")
SEG_PIECES = _SEG.fields[0].count
if SEG_PIECES != MAX_PIECES:
    raise layout.LayoutError(f"SegKV holds {SEG_PIECES} pieces; ir/segments.py MAX_PIECES is {MAX_PIECES}")
SEG_FORMAT = _SEG.format
pack_seg = _SEG.packer(tuple(f"{name}[{i}]" for name in ("k", "v", "k_sb", "k_sh", "k_ss", "v_sb", "v_sh", "v_ss",
                                                         "k_end", "v_end") for i in range(SEG_PIECES)))


def pack_fwd_raw(ptrs: tuple[int, int, int, int, int], q_st: tuple, k_st: tuple, v_st: tuple, o_st: tuple,
                 sizes: tuple[int, int, int, int, int], scale: float) -> bytes:
    """The same FwdArgs from plain ints (the per-call fast path builds no views)."""
    return _pack_fwd(*ptrs, *q_st, *k_st, *v_st, *o_st, *sizes, scale)


def params_format(fields: tuple[ParamField, ...]) -> struct.Struct:
    if not fields:
        return struct.Struct("<q")
    return struct.Struct("<" + "".join("d" if f.kind == "f64" else ("Q" if f.kind in ("ptr", "rt_ptr", "grad_ptr") else "q") for f in fields))


def pack_params(fmt: struct.Struct, fields: tuple[ParamField, ...], tensors: dict[str, torch.Tensor],
                scalars: dict[str, Any], runtime: dict[str, int] | None = None,
                grads: dict[str, torch.Tensor] | None = None) -> bytes:
    """Params' words. grads: the backward's float32 gradients of learnable extras, by the extra's name (null
    where not given: the block pre-pass, which adds none)."""
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
        elif f.kind in ("grad_ptr", "grad_stride", "grad_size"):
            g = (grads or {}).get(f.source)
            vals.append(0 if g is None else g.data_ptr() if f.kind == "grad_ptr" else
                        g.stride(f.dim) if f.kind == "grad_stride" else g.shape[f.dim])
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
