"""Which kernel a program lowers to: worked out once, as one frozen value that lower() takes as given.

A choice names the kernel (prefill for sm_80 or Hopper, or split-KV decode), its tile, the head dims, how
K and V are read (contiguous, in place from pages, or as the pieces the spec concatenates) and, where no
kernel takes the program, why. `choose` makes one from stated flags (what a caller naming the kernel by
hand asks for); `choose_kernel` makes the one a call gets on an arch.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ..errors import UnsupportedSpec
from ..ir.bind import lookup
from ..ir.paged import PagedRead, paged_operands
from ..ir.program import Program
from ..ir.prologue import operand_shapes
from ..ir.segments import KVSegments, segment_operands
from .tiles import (Tile, decode_call, decode_dims_refusal, decode_tile, padded_head_dims, pages_in_place, tile_for,
                    value_dim_of)
from .variant import default_scale

C_TYPES = {"bfloat16": "__nv_bfloat16", "float16": "__half"}  # the dtypes a kernel computes in, as C types


@dataclass(frozen=True)
class KernelChoice:
    """The kernel one program lowers to. `refusal` says why none does (lower() raises it); `tile` is then None."""
    arch: str
    dtype: str                # "bfloat16" or "float16" (where not refused)
    head_dim: int             # Q's and K's
    value_dim: int            # V's
    decode: bool              # the split-KV decode kernel, else the prefill kernel of `arch`
    paged: bool = False       # K and V read in place from pages through block tables (ir/paged.py)
    segmented: bool = False   # decode: K and V read in place as the pieces the spec concatenates (ir/segments.py)
    tile: Tile | None = None
    refusal: str | None = None
    reads: tuple[PagedRead, PagedRead] | KVSegments | None = None  # the call's in-place reads, for the runner
    # the call's own head dims (Q's and K's, V's) where head_dim and value_dim pad them to the kernel's step of 8:
    # the runner zero-pads q, k and v to those and cuts the output back (tiles.padded_head_dims)
    pad_from: tuple[int, int] | None = None

    @property
    def kind(self) -> str | None:
        """The kernel: "sm80", "sm90" (Hopper) or "decode"; None where refused."""
        return self.tile.kernel if self.tile is not None else None

    def readers(self) -> dict[str, Any]:
        """KernelRunner's paged reads and K/V pieces."""
        return {"paged": self.reads if isinstance(self.reads, tuple) else None,
                "segments": self.reads if isinstance(self.reads, KVSegments) else None}


def decode_refusal(p: Program, head_dim: int, value_dim: int | None = None, paged: bool = False) -> str | None:
    """Why the decode kernel cannot serve this program at these head dims; None when it can. paged: K
    and V read in place (pages or pieces)."""
    return decode_dims_refusal(head_dim, value_dim) or (in_place_refusal(p) if paged else None)


def in_place_refusal(p: Program) -> str | None:
    """Why no kernel reads this program's K and V in place (pages or pieces); None where one may."""
    if p.empty_rows == "mean_v":
        return "rows with every key masked take the mean of V, which the kernels read in one piece only"
    return None


def program_tile(p: Program, arch: str, head_dim: int, value_dim: int | None = None, decode: bool = False,
                 paged: bool = False) -> Tile:
    """The tile of this program's kernel; raises UnsupportedSpec for head dims no kernel takes."""
    if decode:
        return decode_tile(head_dim, value_dim, paged)
    return tile_for(head_dim, arch, value_dim, plain_scores=p.mask is None and default_scale(p) is not None)


def choose(p: Program, arch: str, dtype: str, head_dim: int, value_dim: int | None = None, decode: bool = False,
           paged: bool = False, segmented: bool = False) -> KernelChoice:
    """The kernel for stated flags, or the first reason none serves them."""
    c = KernelChoice(arch, dtype, head_dim, value_dim_of(head_dim, value_dim), decode, paged, segmented)
    if dtype not in C_TYPES:
        return replace(c, refusal=f"the kernel computes in bfloat16 or float16, not {dtype}")
    if segmented and not decode:
        return replace(c, refusal="K and V are read in place as pieces only by the decode kernel")
    padded = padded_head_dims(head_dim, c.value_dim)
    if padded is not None and not (paged or segmented):
        # head dims off the step of 8: the prefill kernel at the padded dims, with few queries too (the
        # decode kernel reads K and V in place, and these are copied padded)
        return _with_tile(p, KernelChoice(arch, dtype, padded[0], padded[1], False, pad_from=(head_dim, c.value_dim)))
    why = decode_refusal(p, head_dim, c.value_dim, paged or segmented) if decode else \
        in_place_refusal(p) if paged else None
    return replace(c, refusal=why) if why else _with_tile(p, c)


def choose_kernel(p: Program, bound: dict[str, Any], arch: str) -> KernelChoice:
    """The kernel a call of `p` with `bound` gets on `arch`. Calls with few queries get the split-KV decode
    kernel where it takes the program. It reads pages and pieces in place; a prefill kernel reads the pages
    tiles.pages_in_place takes, and the prologue gathers the rest. Paged reads hold at the call's shapes:
    their program is guarded to them. Raises UnsupportedSpec for inputs in a dtype no kernel computes in."""
    ops = operand_shapes(p, bound)
    q = ops["q"]
    dtype = str(q.dtype).removeprefix("torch.")
    if dtype not in C_TYPES:
        raise UnsupportedSpec(f"the kernel computes in bfloat16 or float16; the inputs are {q.dtype}", op="kernel")
    head_dim = q.shape[p.q.dims.index("d")]
    dv = ops["v"].shape[p.v.dims.index("d")]
    if padded_head_dims(head_dim, dv) is not None:  # K and V copied padded, never read in place
        return choose(p, arch, dtype, head_dim, dv)
    in_place = in_place_refusal(p)  # each rule is asked once: the choices below follow from its answer
    if decode_call(q.shape[p.q.dims.index("s")]) and decode_dims_refusal(head_dim, dv) is None:
        reads = (paged_operands(p, bound) or segment_operands(p)) if in_place is None else None
        return _with_tile(p, KernelChoice(arch, dtype, head_dim, dv, True, isinstance(reads, tuple),
                                          isinstance(reads, KVSegments), reads=reads))
    c = _with_tile(p, KernelChoice(arch, dtype, head_dim, dv, False))  # a prefill tile whatever the reads
    pages = paged_operands(p, bound) if in_place is None and c.tile is not None else None
    if pages is None or not pages_in_place(lookup(bound, pages[0].pages).shape[pages[0].slot_dim], c.tile):
        return c  # contiguous, or gathered by the prologue
    return replace(c, paged=True, reads=pages)


def _with_tile(p: Program, c: KernelChoice) -> KernelChoice:
    """The choice with its tile, or with the refusal of head dims no kernel takes."""
    try:
        # the decode kernel's ring depth follows page reads only; pieces keep the contiguous one
        return replace(c, tile=program_tile(p, c.arch, c.head_dim, c.value_dim, c.decode, c.paged))
    except UnsupportedSpec as e:
        return replace(c, refusal=e.reason)
