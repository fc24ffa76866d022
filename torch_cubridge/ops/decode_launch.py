"""The split-KV decode kernel's runner part (ops/runner.py DecodeRunner): how a call splits its keys, the
scratch the splits' partials go to, and the C Decoder that launches a call for any sizes.

Mixed into KernelRunner, whose state it reads (the program, the lowered tile, the kernel, the plan); the
split rule itself is rules.decode_split, which the C Decoder shares.
"""
from __future__ import annotations

import struct
from typing import Any

import torch

from ..ir.bind import as_result
from ..ir.bounds import out_of_bounds
from ..lower.tiles import decode_ctas_per_sm
from . import decoder, hotpath
from .layout import DECODE_PARAMS
from .pack import NO_PAGES, per_call_words
from .rules import PAGED_SPLIT_MIN_BLOCKS, decode_split
from .splitkv import NO_SCRATCH, Scratch, sm_count

_I64 = struct.Struct("<q").pack

_capturing = torch._C._cuda_isCurrentStreamCapturing if hasattr(torch._C, "_cuda_isCurrentStreamCapturing") \
    else torch.cuda.is_current_stream_capturing  # the C call itself: this runs on every decode call

# where the kernel takes each launch block _launch makes (FwdArgs, Params, the scratch words, the keys per
# split, the pages), or None where it takes them in that order: the kernel's order is DECODE_PARAMS', which
# the C Decoder follows too
_ORDER = DECODE_PARAMS.order(("a", "p", "part_o", "part_lse", "counters", "chunk", "pg"))

# the split rule's CTAs per multiprocessor where set; None: the tile's own (lower/tiles.py decode_ctas_per_sm).
# benchmarks/bench_decode.py --ab sets it; the C Decoder takes the value when it is made.
DECODE_CTAS_PER_SM: int | None = None


class DecodeLaunch:
    """Split-KV: (chunk of keys, KV head, row tile, batch) CTAs, about two per multiprocessor; the last chunk
    of a tile to finish merges the chunks' partial O and LSE (decode_kernel.cuh)."""
    # see KernelRunner._BLOCK; the pages counted from the end, as there
    _BLOCK = {"a": DECODE_PARAMS.names.index("a"), "p": DECODE_PARAMS.names.index("p"),
              "pg": DECODE_PARAMS.names.index("pg") - len(DECODE_PARAMS.names)}

    def _init_kind(self) -> None:
        p, low = self.p, self.low
        # decode: per (device, stream), the partial O, partial (max, sum) and split counters, and their
        # pointers packed as kernel words
        self._scratch: dict[tuple, Scratch] = {}
        # the C Decoder (ops/decoder.py) launches a decode call for any sizes where the scale is fixed and the
        # call's arguments are all it reads (q, K and V or their pages and tables, extra tensors); sizes the
        # program holds, such as Sq = 1, it checks itself; made at the first call it may serve
        self._c_args = decoder.arguments(self)
        self.decodable = self._c_args is not None
        self._c_at: tuple[int, ...] | None = None  # their positions, where all are named parameters
        self._c_last = 0  # the last of them
        if self._c_args is not None and all(n in self.plan.positions for n in self._c_args):
            self._c_at = tuple(self.plan.positions[n] for n in self._c_args)
            self._c_last = max(self._c_at)
        self._decoder_ok = self.decodable and hotpath.enabled()
        if self.decodable:
            # Params words of the extra tensors the Decoder reads (and a record patches): their pointers,
            # strides, sizes
            self.per_call_ranks = {x.name: x.rank for x in decoder.per_call_extras(p)}
            self.per_call_words = per_call_words(low.params, self.per_call_ranks)
            # the host fast path may replay a launch the Decoder could make, whose only per-call words are
            # the arguments' pointers at that layout
            self._replay_at = self._c_at

    def serve(self, args: tuple, kwargs: dict, record: bool = False) -> Any:
        """A call of the compiled function. `record`: the caller may record this launch for the host fast
        path (a positional call while records pay), so the Python runner makes it; otherwise a decode call
        launches from C where the Decoder takes it."""
        if self._decoder_ok and not record:
            at = self._c_at
            if at is not None and len(args) > self._c_last:
                vals = [args[i] for i in at]
            else:
                try:
                    vals = [self.plan.get(args, kwargs, name) for name in self._c_args]  # type: ignore[union-attr]
                except (KeyError, IndexError):
                    return self(*args, **kwargs)
            d = self._decoder
            if d is None and type(vals[0]) is torch.Tensor and vals[0].is_cuda:
                d = self._decoder = self._make_decoder(vals[0].get_device())
            if d is not None:
                out = d.serve(*vals)
                if out is not None:
                    return as_result(self.p, out) if self.p.out.tuple_len else out
        return self(*args, **kwargs)

    def _make_decoder(self, device: int) -> Any:
        try:
            return decoder.make(self, device, _capturing, sm_count(device), self._ctas_per_sm(), self._split_min_blocks())
        except ValueError:  # a program the Decoder's tables cannot describe (too many extras): Python serves
            self._decoder_ok = False
            return None

    def reads_in_bounds(self, sizes: tuple[int, int, int, int, int, int], shapes: dict[str, tuple]) -> bool:
        """Whether every extra-tensor read is in range at these (B, H, Hkv, Sq, Skv, D) and extra shapes
        (the Decoder asks once per new ones; _check_bounds answers the Python runner)."""
        return out_of_bounds(self._sites, dict(zip(decoder.SIZES, sizes)), self._lit or {}, shapes) is None

    def _launch(self, blocks: tuple, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qs: tuple, ks: tuple,
                vs: tuple, B: int, H: int, Hkv: int, Sq: int, Skv: int, D: int, Dv: int, di: int, stream: int,
                paged: tuple | None, keep: bool) -> None:
        """FwdArgs and Params in `blocks`, then the scratch words, the keys per split and the PagedKV (or
        SegKV) words, in the kernel's order (DECODE_PARAMS). A launch is kept for a record even where `keep`
        is not (a decode record replays any launch its layout makes), but never while a graph captures: a
        graph's scratch is its own."""
        tile = self.low.tile
        row_tiles = -(-(H // Hkv) * Sq // tile.block_m)
        n_blk = -(-Skv // tile.block_n)
        n_split, per = decode_split(Hkv * row_tiles * B, n_blk, sm_count(di), self._ctas_per_sm(),
                                    self._split_min_blocks())
        words = NO_SCRATCH
        if n_split > 1:  # partial O has V's head dim
            words = self._scratch_for(B * H * Sq * n_split, Dv, B * Hkv * row_tiles, di, q.device, stream)
            sc = self._scratch.get((di, stream))
            if self._decoder is not None and sc is not None and sc.words == words:  # not a graph's own
                self._decoder.set_scratch(stream, sc.o_rows, sc.l_rows, sc.n_counters, b"".join(words), sc)
        pages = paged[2] if paged is not None else NO_PAGES
        grid, blocks = (n_split, Hkv * row_tiles, B), blocks + words + (_I64(per * tile.block_n), pages)
        if _ORDER is not None:
            blocks = tuple(blocks[i] for i in _ORDER)
        self.kernel.launch(grid, blocks, stream)
        if self.replayable and not _capturing():
            # the record keeps this stream's scratch alive: a larger call may replace it in _scratch
            self._last = (grid, blocks, stream, di, self._scratch[(di, stream)] if n_split > 1 else None)

    def _ctas_per_sm(self) -> int:
        return DECODE_CTAS_PER_SM or decode_ctas_per_sm(self.low.tile)

    def _split_min_blocks(self) -> int:
        return PAGED_SPLIT_MIN_BLOCKS if self.low.paged else 1

    def _scratch_for(self, rows: int, D: int, tiles: int, di: int, dev: torch.device, stream: int) -> tuple:
        """The words for the splits' partial O [rows, D] and (max, sum) [rows, 2] in fp32 and the split
        counters of `stream` (zeros; the kernel leaves them zero). One set per stream, kept across calls:
        launches on one stream run in order (an allocation per call cost two trips through the caching
        allocator on a host-bound decode step); launches on two may overlap."""
        if _capturing():  # a graph's own, from its pool: graphs may replay at once
            self._graph_scratch = Scratch(rows * D, rows * 2, tiles, dev)
            return self._graph_scratch.words
        key = (di, stream)
        sc = self._scratch.get(key)
        if sc is None or sc.o_rows < rows * D or sc.l_rows < rows * 2 or sc.n_counters < tiles:
            sc = self._scratch[key] = Scratch(rows * D, rows * 2, tiles, dev)
        return sc.words
