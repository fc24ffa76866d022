"""The compiled kernel as a callable with the spec's signature.

Per call: bind arguments, view q/k/v in canonical order (no copies for any
permutation whose last dim is contiguous), allocate the output in the spec's
layout, pack arguments, launch on the current stream. No host sync.
"""
from __future__ import annotations

import itertools
import struct
from typing import Any

import torch

from ..config import hopper_kernel_enabled
from ..errors import UnsupportedSpec
from ..ir.bind import as_result, bind_args, call_device, lookup, operand_value, scalar_values, to_canonical
from ..ir.paged import PagedRead
from ..ir.segments import KVSegments
from ..ir.expr import ROW_LSE, free_vars
from ..ir.expr import scalars as scalars_of
from ..ir.interpreter import index_env, row_factor
from ..ir.interval import interval
from ..ir.program import Program
from ..ir.prologue import run_epilogue, run_prologue
from ..lower import Lowered
from ..lower.tiles import decode_ctas_per_sm, paged_tma_rows, value_dim_of
from . import decoder, hotpath
from .launch import CubinKernel
from ..ir.bounds import load_sites, out_of_bounds
from .errors import NeedsAutograd, SpecServes
from .fastpath import Plan, canon
from .splitkv import NO_SCRATCH, PAGED_SPLIT_MIN_BLOCKS, Scratch, decode_split, sm_count
from .pack import NO_PAGES, SEG_PIECES, pack_fwd_raw, pack_paged, pack_params, pack_seg, page_div_word, params_format, \
    per_call_words
from .rules import pool_fits, rows_aligned, shapes_fit
from .tma import no_broadcast, tensor_map

DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}  # what the kernel computes in


class KernelRunner:
    def __init__(self, p: Program, low: Lowered, kernel: CubinKernel, head_dim: int, info: dict,
                 aux: dict[str, CubinKernel] | None = None, value_dim: int | None = None,
                 paged: tuple[PagedRead, PagedRead] | None = None, segments: KVSegments | None = None) -> None:
        self.p = p
        self.paged = paged  # K and V read in place from pages (low.paged), not gathered by the prologue
        self.segments = segments  # K and V read in place as the pieces the spec concatenates (low.segmented)
        if (paged is not None) != low.paged or (segments is not None) != low.segmented:
            raise ValueError("a kernel that reads K and V in place needs its reads, and only it")
        self.low = low
        self.kernel = kernel
        self.aux = aux or {}  # helper kernels by role (kernel.load_kernel)
        self.head_dim = head_dim
        self.value_dim = value_dim_of(head_dim, value_dim)
        self.info = info
        self.fmt = params_format(low.params)
        self.dtype = getattr(torch, low.dtype)
        self.plan = Plan(p)
        self._consts: dict[tuple, torch.Tensor] = {}
        self._lit = {s.name: s.value for s in p.scalars} if self.plan.literal_scalars else None
        self._mask_vars = free_vars(p.mask) if p.mask is not None else set()
        self._row_lse = p.row_scale is not None and ROW_LSE in free_vars(p.row_scale)  # the kernel writes it
        self._lse_out = p.out.lse_index >= 0  # the spec returns the rows' log-sum-exp: the kernel writes it
        # what a call must work out, decided once: most programs need none of it per call
        self._fast = self.plan.simple and not any(s.arg is not None for s in p.scalars) and not p.prologue \
            and not p.epilogue
        self._extra_paths = [(x.name, x.arg) for x in p.extras if x.arg is not None]
        self._needs_sizes = bool(p.requires) or self._lit is None
        self._layouts: dict[tuple, tuple] = {}
        # decode: per (device, stream), the partial O, partial (max, sum) and split counters, and their
        # pointers packed as kernel words
        self._scratch: dict[tuple, Scratch] = {}
        self._tma = low.tile.kernel == "sm90"
        self._decode = low.tile.kernel == "decode"
        self._sites = load_sites(p)
        self._in_bounds: set[tuple] = set()  # (sizes, scalars, extra shapes) already checked
        self._params_const = None
        if self._lit is not None and not p.extras and low.prepass is None:
            self._params_const = pack_params(self.fmt, low.params, {}, self._lit)
        self._scale_const = 1.0 if low.scale is None else None  # 1.0: the score hook applies its own scale
        # one launch whose blocks differ between calls only in what q, k and v give (their layout and
        # pointers) and the output's pointer: no extra tensor, no argument scalar, no prologue or epilogue,
        # no row scale, no returned LSE, K and V in one piece each, the output in q's dtype
        one_launch = self._fast and self._params_const is not None and not aux and p.row_scale is None \
            and not self._row_lse and not self._lse_out and paged is None and segments is None and p.out.dtype == "q"
        if low.scale is not None and not (free_vars(low.scale) or scalars_of(low.scale) - set(self._lit or {})):
            self._scale_const = self._scale({}, self._lit or {})
        # the C Decoder (ops/decoder.py) launches a decode call for any sizes where the scale is fixed and the
        # call's arguments are all it reads (q, K and V or their pages and tables, extra tensors); sizes the
        # program holds, such as Sq = 1, it checks itself; made at the first call it may serve
        self._c_args = decoder.arguments(self) if self._decode else None
        self.decodable = self._c_args is not None
        self._c_at: tuple[int, ...] | None = None  # their positions, where all are named parameters
        self._c_last = 0  # the last of them
        if self._c_args is not None and all(n in self.plan.positions for n in self._c_args):
            self._c_at = tuple(self.plan.positions[n] for n in self._c_args)
            self._c_last = max(self._c_at)
        self._decoder_ok = self.decodable and hotpath.enabled()
        self._decoder: Any = None
        # Params words of the extra tensors the Decoder reads (and a record patches): their pointers, strides, sizes
        self.per_call_ranks = {x.name: x.rank for x in decoder.per_call_extras(p)} if self.decodable else {}
        self.per_call_words = per_call_words(low.params, self.per_call_ranks) if self.decodable else ()
        # the host fast path may replay such a launch for calls of its exact layout (ops/hotpath.py; a record
        # returns the output alone): a decode launch the Decoder could make, whose only per-call words are
        # the arguments' pointers at that layout; _last holds the latest such launch
        qkv = self.plan.qkv_at
        self._replay_at = self._c_at if self.decodable else qkv[:3] if one_launch and qkv is not None else None
        self.replayable = self._replay_at is not None and not p.out.tuple_len
        self._last: tuple | None = None

    # -- calls -----------------------------------------------------------------
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

    @property
    def decoder_hits(self) -> int:
        """Calls the C Decoder launched (tests, benchmarks)."""
        return 0 if self._decoder is None else self._decoder.hits

    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        if self._fast:
            plan = self.plan
            if plan.qkv_at is not None and len(args) > plan.qkv_at[3] and not self._extra_paths:
                at = plan.qkv_at  # all three positional in this call: the common case, read directly
                return self._execute(args[at[0]], args[at[1]], args[at[2]], plan.perms, {}, None, False)
            try:
                q = plan.get(args, kwargs, plan.paths[0])
                k = plan.get(args, kwargs, plan.paths[1])
                v = plan.get(args, kwargs, plan.paths[2])
                extras = {n: plan.get(args, kwargs, a) for n, a in self._extra_paths} if self._extra_paths else {}
            except (KeyError, IndexError):
                return self.run_bound(bind_args(self.p.signature, args, kwargs))
            return self._execute(q, k, v, plan.perms, extras, None, False)
        return self.run_bound(bind_args(self.p.signature, args, kwargs))

    def run_bound(self, bound: dict[str, Any], poison: bool = False) -> Any:
        out = self._attention(bound, poison)
        return run_epilogue(self.p, out, bound) if self.p.epilogue else out

    def _attention(self, bound: dict[str, Any], poison: bool) -> Any:
        """The attention output in the spec's layout (before any epilogue)."""
        p = self.p
        if self.paged is not None:
            made = run_prologue(p, bound, call_device(bound), in_place=("k", "v"))
            kv = self._pages(bound)
            return self._execute(operand_value(bound, p.q, made), kv[0], kv[1], self.plan.perms,
                                 self._extras(bound, made), bound, poison, paged=kv[2:])
        if self.segments is not None:
            made = run_prologue(p, bound, call_device(bound), in_place=("k", "v"), also=self.segments.steps())
            piece = lambda x: made[x[1]] if x[0] == "@step" else lookup(bound, x[1])  # noqa: E731
            kv = self._pieces([piece(x) for x in self.segments.k], [piece(x) for x in self.segments.v])
            return self._execute(operand_value(bound, p.q, made), kv[0], kv[1], self.plan.perms,
                                 self._extras(bound, made), bound, poison, paged=kv[2:])
        made = run_prologue(p, bound, call_device(bound)) if p.prologue else {}
        q, k, v = (operand_value(bound, op, made) for op in (p.q, p.k, p.v))
        return self._execute(q, k, v, self.plan.perms, self._extras(bound, made), bound, poison)

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
        maps = None
        if self._tma:  # [pages, Hkv, P, D] in boxes inside one page (fwd_kernel_sm90.cuh)
            rows = paged_tma_rows(P, self.low.tile.block_n)
            if rows is None:  # kernel_choice gathers such pages; a program guarded to P never meets them
                raise SpecServes(f"pages of {P} rows are too small for the Hopper kernel's boxes")
            maps = tuple(
                tensor_map(t.data_ptr(), (t.shape[0], hkv, P, d), (t.stride(0), sh, ss, 1), self.dtype, rows)
                for t, ((_, hkv, _, d), (_, sh, ss, _)) in ((kp, kl), (vp, vl)))
        return kp, vp, kl, vl, words, maps

    def _extras(self, bound: dict[str, Any], made: dict[str, Any]) -> dict[str, Any]:
        """Extra tensors by name: call arguments, prologue results; None for captured constants."""
        return {x.name: made[x.step] if x.step is not None else lookup(bound, x.arg) if x.arg is not None else None
                for x in self.p.extras}

    # -- the custom op (torch.compile) ------------------------------------------------
    @property
    def kernel_id(self) -> str:
        return self.info["key"] + "/" + self.info.get("program", "")

    def op_call(self, args: tuple, kwargs: dict) -> Any:
        """Route a call through torch.ops.cubridge.attention (traceable by torch.compile)."""
        from . import custom_op
        bound = bind_args(self.p.signature, args, kwargs)
        in_place = ("k", "v") if self.paged is not None else ()  # pieces: the op takes K and V joined
        made = run_prologue(self.p, bound, call_device(bound), in_place) if self.p.prologue else {}
        q = operand_value(bound, self.p.q, made)
        ex = self._extras(bound, made)
        extras = [ex[x.name] if ex[x.name] is not None else self._const(x, q.device) for x in self.p.extras]
        if self.paged is not None:  # the op takes the pages as k and v, and the tables after the extras
            k, v = (lookup(bound, r.pages) for r in self.paged)
            extras += [lookup(bound, r.table) for r in self.paged]
        else:
            k, v = (operand_value(bound, op, made) for op in (self.p.k, self.p.v))
        scal = [float(lookup(bound, s.arg)) for s in self.p.scalars if s.arg is not None]
        lse = None
        if self._lse_out:  # the spec returns the rows' log-sum-exp too: the op that gives the kernel's
            out, lse = custom_op.attention_lse(q, k, v, extras, scal, self.kernel_id)
        else:
            out = custom_op.attention(q, k, v, extras, scal, self.kernel_id)
        out = out if self.p.out.dtype == "q" else out.to(getattr(torch, self.p.out.dtype))
        return as_result(self.p, out, lse, q.dtype)

    def op_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, extras: list, scalars: list) -> Any:
        """The custom op's body: the output in the kernel's layout, with the rows' log-sum-exp where the
        spec returns it (the op `attention_lse`)."""
        it = iter(scalars)
        bound = {s.arg: next(it) for s in self.p.scalars if s.arg is not None}
        ex = {x.name: t for x, t in zip(self.p.extras, extras)}
        if self.paged is not None:
            (kr, vr), (kt, vt) = self.paged, extras[-2:]
            kv = self._pages({kr.pages: k, vr.pages: v, kr.table: kt, vr.table: vt})
            return self._execute(q, k, v, self.plan.perms, ex, bound, False, raw=True, paged=kv[2:])
        if self.segments is not None:  # one piece each
            kv = self._pieces([k], [v])
            return self._execute(q, kv[0], kv[1], self.plan.perms, ex, bound, False, raw=True, paged=kv[2:])
        return self._execute(q, k, v, self.plan.perms, ex, bound, False, raw=True)

    def _const(self, x: Any, dev: torch.device) -> torch.Tensor:
        key = (x.name, dev)
        if key not in self._consts:
            self._consts[key] = torch.tensor(x.value, dtype=getattr(torch, x.dtype), device=dev)
        return self._consts[key]

    # -- the launch ----------------------------------------------------------------
    def _execute(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, perms: tuple, extras: dict,
                 bound: dict | None, poison: bool, raw: bool = False, paged: tuple | None = None) -> Any:
        """paged: K's and V's canonical sizes and strides over their pages (or pieces) and the PagedKV (or
        SegKV) words (k and v are then the pages, or the first pieces)."""
        p = self.p
        self._last = None
        qn, qs = canon(q, perms[0])
        if paged is not None:
            (kn, ks), (vn, vs) = paged[0], paged[1]
        else:
            kn, ks = canon(k, perms[1])
            vn, vs = canon(v, perms[2])
        (B, H, Sq, D), Hkv, Skv, Dv = qn, kn[1], kn[2], vn[3]
        dt = self.dtype
        if q.dtype != dt or k.dtype != dt or v.dtype != dt:
            raise TypeError(f"query/key/value must all be {dt}; got {q.dtype}, {k.dtype}, {v.dtype}")
        di = q.get_device()
        if di < 0 or k.get_device() != di or v.get_device() != di:
            raise ValueError("query, key and value must be CUDA tensors on one device")
        if not shapes_fit(qn, kn, vn, self.head_dim, self.value_dim):
            if not (D == kn[3] == self.head_dim and Dv == self.value_dim):
                raise ValueError(f"head dims must be {self.head_dim} for query and key, {self.value_dim} for value")
            raise ValueError(f"incompatible shapes: query {tuple(q.shape)}, key {tuple(k.shape)}, value {tuple(v.shape)}")
        tma = self._tma
        if paged is not None:  # the pages are read where they lie (checked in _pages); q may be copied
            if not rows_aligned(q.data_ptr(), qs):
                q = _readable_copy(q)
                qs = canon(q, perms[0])[1]
        elif not (rows_aligned(q.data_ptr(), qs) and rows_aligned(k.data_ptr(), ks) and rows_aligned(v.data_ptr(), vs)) \
                or tma and not (  # cp.async/TMA need 16-byte rows
                no_broadcast((B, H, Sq, D), qs) and no_broadcast((B, Hkv, Skv, D), ks)
                and no_broadcast((B, Hkv, Skv, Dv), vs)):
            q, k, v = (_readable_copy(t) for t in (q, k, v))
            qs, ks, vs = (canon(t, pm)[1] for t, pm in zip((q, k, v), perms))
        sizes = None
        hkv_spec = self.paged[0].heads if self.paged is not None else Hkv  # the kernel packs paged heads its own way
        if self._needs_sizes or self._scale_const is None:
            sizes = {"B": B, "H": H, "Hkv": hkv_spec, "Sq": Sq, "Skv": Skv, "D": D}
            for name, val in p.requires:
                if sizes[name] != val:
                    raise ValueError(f"this program was captured with {name}={val} and is only valid there "
                                     f"(got {name}={sizes[name]})")
        scal = self._lit if self._lit is not None else scalar_values(p, bound or {}, sizes)
        tensors = self._tensors(extras, q.device) if p.extras else {}
        if self._sites:
            self._check_bounds(B, H, hkv_spec, Sq, Skv, D, scal, tensors)
        if torch.is_grad_enabled() and not raw and (q.requires_grad or k.requires_grad or v.requires_grad or any(
                t.requires_grad for t in tensors.values())):
            raise NeedsAutograd("the kernel has no backward yet")
        lay = self._layouts.get((B, H, Sq, Dv))  # O has V's head dim
        if lay is None:
            lay = self._layouts[(B, H, Sq, Dv)] = self.plan.out_layout(B, H, Sq, Dv)
        out = q.new_empty(lay[0])
        if poison:
            out.fill_(float("nan"))
        scale = self._scale_const if self._scale_const is not None else self._scale(sizes, scal)
        # [B, H, Sq] natural-log LSE for a row scale that reads it; every key empty: -inf, as the kernel writes
        lse = torch.full((B, H, Sq), float("-inf"), dtype=torch.float32, device=q.device) \
            if self._row_lse or self._lse_out else None
        if Sq and Skv:
            stream = torch._C._cuda_getCurrentRawStream(di)
            fwd = pack_fwd_raw((q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                                0 if lse is None else lse.data_ptr()), qs[:3], ks[:3],
                               vs[:3], lay[1][:3], (B, H, Hkv, Sq, Skv), scale)
            if self._params_const is not None:
                params = self._params_const
            else:
                runtime = self._prepass(fwd, tensors, scal, B, H, Sq, Skv, q.device, stream) if "prepass" in self.aux else None
                params = pack_params(self.fmt, self.low.params, tensors, scal, runtime)
            blocks: tuple = (fwd, params)
            if tma:
                tile = self.low.tile
                blocks += (tensor_map(q.data_ptr(), (B, H, Sq, D), qs, dt, tile.block_m),)
                if paged is not None:  # K's and V's maps over their pages, then the PagedKV words
                    blocks += paged[3] + (paged[2],)
                else:
                    blocks += (tensor_map(k.data_ptr(), (B, Hkv, Skv, D), ks, dt, tile.block_n),
                               tensor_map(v.data_ptr(), (B, Hkv, Skv, Dv), vs, dt, tile.block_n))
            if self._decode:
                self._launch_decode(blocks, B, H, Hkv, Sq, Skv, Dv, di, q, stream,
                                    paged[2] if paged is not None else NO_PAGES)
            else:
                nq = -(-Sq // self.low.tile.block_m)
                grid = (nq, H, B)
                if paged is not None and not tma:  # the FA2-class kernel: the PagedKV words after Params
                    blocks += (paged[2],)
                if tma:  # the sm90 kernel numbers tiles itself; persistent: one CTA per SM walks them
                    grid = (min(nq * H * B, sm_count(di)) if self.low.tile.persistent else nq * H * B, 1, 1)
                self.kernel.launch(grid, blocks, stream)
                if self.replayable and not raw and not poison:
                    self._last = (grid, blocks, stream, di, None)
        else:
            out.zero_()
        if p.row_scale is not None:
            self._scale_rows(out, lay[1], (B, H, Sq, Dv), {"B": B, "H": H, "Hkv": hkv_spec, "Sq": Sq, "Skv": Skv,
                                                            "D": D}, scal, tensors, lse)
        return self._result(out, raw, lse)

    def take_launch(self) -> tuple | None:
        """The latest replayable launch (grid, blocks, stream, device, what it needs kept alive), once."""
        last, self._last = self._last, None
        return last

    def replay_sources(self) -> tuple[int, ...] | None:
        """The argument positions whose pointers a replayed launch takes (q, k, v or q, the pages and
        tables, then the extra tensors: the Decoder's order), or None where no launch replays."""
        return self._replay_at if self.replayable else None

    def replay_patches(self) -> tuple[tuple[int, int, int, bool], ...]:
        """Where a replayed launch takes each call's pointers: (source, block, byte offset, tensor map?),
        sources numbered as replay_sources, the output last. q's, k's (or K's pages'), v's and the output's
        go in FwdArgs' first words (pack.FWD_FORMAT); on the Hopper kernel, into the three tensor maps after
        the Params block; the block tables' into the PagedKV words, the decode launch's last block (-1);
        the extra tensors' into Params (block 1)."""
        n = len(self._replay_at or ())
        words = tuple((i, 0, 8 * i, False) for i in range(3)) + ((n, 0, 24, False),)
        if self._tma:
            return words + tuple((i, 2 + i, 0, True) for i in range(3))
        tables = ((3, -1, 0, False), (4, -1, 8, False)) if self.paged is not None else ()
        first = 5 if self.paged is not None else 3
        return words + tables + tuple((first + src, 1, off, False) for off, kind, src, _ in self.per_call_words
                                      if kind == 0)

    def _scale_rows(self, out: torch.Tensor, strides: tuple, shape: tuple, sizes: dict, scal: dict,
                    tensors: dict, lse: torch.Tensor | None) -> None:
        """The program's row scale on the output, in place, by PyTorch after the kernel (on its stream)."""
        B, H, Sq, _ = shape
        env = index_env(sizes, scal, tensors, B, H, out.device)
        if lse is not None:
            env[ROW_LSE] = lse.unsqueeze(-1)
        o = out.as_strided(shape, strides)
        o.mul_(row_factor(self.p.row_scale, env, B, H, Sq, torch.float32).to(o.dtype))

    def _result(self, out: torch.Tensor, raw: bool, lse: torch.Tensor | None = None) -> Any:
        p = self.p
        if raw:
            return (out, lse) if self._lse_out else out
        return as_result(p, out if p.out.dtype == "q" else out.to(getattr(torch, p.out.dtype)), lse, self.dtype)

    def _launch_decode(self, blocks: tuple, B: int, H: int, Hkv: int, Sq: int, Skv: int, Dv: int, di: int,
                       q: torch.Tensor, stream: int, pages: bytes) -> None:
        """Split-KV: (chunk of keys, KV head, row tile, batch) CTAs, about two per multiprocessor; the
        last chunk of a tile to finish merges the chunks' partial O and LSE (decode_kernel.cuh)."""
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
        grid, blocks = (n_split, Hkv * row_tiles, B), blocks + words + (_I64(per * tile.block_n), pages)
        self.kernel.launch(grid, blocks, stream)
        if self.replayable and not _capturing():  # a graph's scratch is its own: never replayed
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

    def _check_bounds(self, B: int, H: int, Hkv: int, Sq: int, Skv: int, D: int, scal: dict,
                      tensors: dict) -> None:
        """Every extra-tensor read in range: the kernel reads through raw pointers."""
        shapes = {n: tuple(t.shape) for n, t in tensors.items()}
        key = (B, H, Hkv, Sq, Skv, D, tuple(sorted(scal.items())), tuple(sorted(shapes.items())))
        if key in self._in_bounds:
            return
        bad = out_of_bounds(self._sites, dict(zip(decoder.SIZES, (B, H, Hkv, Sq, Skv, D))), scal, shapes)
        if bad:
            raise SpecServes(bad)
        self._in_bounds.add(key)

    def _prepass(self, fwd: bytes, tensors: dict, scal: dict, B: int, H: int, Sq: int, Skv: int,
                 dev: torch.device, stream: int) -> dict[str, int]:
        tile = self.low.tile
        nq, nk = -(-Sq // tile.block_m), -(-Skv // tile.block_n)
        bb = B if "b" in self._mask_vars else 1
        hb = H if "h" in self._mask_vars else 1
        rows = bb * hb * nq
        table = torch.empty(rows * (nk + 1), dtype=torch.int32, device=dev)  # block_prepass.cuh's layout
        rt = {"blk": table.data_ptr(), "blk_sb": hb * nq * (nk + 1) if bb > 1 else 0,
              "blk_sh": nq * (nk + 1) if hb > 1 else 0, "blk_nk": nk + 1}
        params = pack_params(self.fmt, self.low.params, tensors, scal, rt)
        classify, scan = self.aux["prepass"], self.aux["scan"]
        classify.launch((nk, nq, bb * hb), (fwd, params, struct.pack("<q", hb)), stream)
        warps = classify.threads // 32
        scan.launch((-(-rows // warps), 1, 1), (struct.pack("<Q", table.data_ptr()), struct.pack("<q", rows), struct.pack("<q", nk)), stream)
        self._table = table  # keep the buffer alive until the launch is enqueued on the stream
        return rt

    def _scale(self, sizes: dict, scal: dict) -> float:
        if self.low.scale is None:
            return 1.0
        env = {kk: (float(vv), float(vv)) for kk, vv in {**sizes, **scal}.items()}
        scale = interval(self.low.scale, env)[0]
        if not scale > 0:  # the kernel folds the scale into exp2 after the row max: needs scale > 0
            raise ValueError(f"score scale {scale} must be positive for this kernel")
        return scale

    def _tensors(self, extras: dict, dev: torch.device) -> dict[str, torch.Tensor]:
        out = {}
        for x in self.p.extras:
            t = extras.get(x.name)
            if t is None:
                out[x.name] = self._const(x, dev)
                continue
            if not isinstance(t, torch.Tensor) or t.device != dev:
                raise ValueError(f"{x.arg} must be a tensor on {dev}")
            if str(t.dtype) != "torch." + x.dtype:
                raise TypeError(f"{x.arg} has dtype {t.dtype}; the kernel was built for torch.{x.dtype}")
            if t.dim() != x.rank:
                raise ValueError(f"{x.arg} must have rank {x.rank}")
            out[x.name] = t
        return out


_I64 = struct.Struct("<q").pack


_capturing = torch._C._cuda_isCurrentStreamCapturing if hasattr(torch._C, "_cuda_isCurrentStreamCapturing") \
    else torch.cuda.is_current_stream_capturing  # the C call itself: this runs on every decode call


def _readable_copy(t: torch.Tensor) -> torch.Tensor:
    """A dense copy the kernel reads: `contiguous()` returns a dense view as it is, even one whose
    pointer is not 16-byte aligned (a slice one element in), which cp.async and TMA cannot read."""
    c = t.contiguous()
    return c if c.data_ptr() % 16 == 0 else c.clone()


def arch_for(device: torch.device) -> str:
    """The arch this kernel is built for on `device`: sm_80 class, or sm_90a (Hopper: wgmma, TMA)."""
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        raise UnsupportedSpec(f"the kernel needs sm_80 or newer; this GPU is sm_{major}{minor}", op="kernel")
    if major == 9:
        return "sm_90a" if minor == 0 and hopper_kernel_enabled() else "sm_90"
    return f"sm_{major}{minor}" if major == 8 else "sm_80"


# the split rule's CTAs per multiprocessor where set; None: the tile's own (lower/tiles.py decode_ctas_per_sm).
# benchmarks/bench_decode.py --ab sets it; the C Decoder takes the value when it is made.
DECODE_CTAS_PER_SM: int | None = None
