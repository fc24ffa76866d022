"""The compiled kernel as a callable with the spec's signature.

Per call: bind arguments, view q/k/v in canonical order (no copies for any
permutation whose last dim is contiguous), allocate the output in the spec's
layout, pack arguments, launch on the current stream. No host sync.
"""
from __future__ import annotations

from typing import Any

import torch

from ..ir.bind import as_result, bind_args, call_device, lookup, operand_value, scalar_values
from ..ir.paged import PagedRead
from ..ir.segments import KVSegments
from ..ir.expr import ROW_LSE, free_vars
from ..ir.expr import scalars as scalars_of
from ..ir.interval import interval
from ..ir.program import Program
from ..ir.prologue import run_epilogue, run_prologue
from ..lower import Lowered
from ..lower.tiles import value_dim_of
from . import decoder
from .decode_launch import DecodeLaunch
from .hopper_launch import HopperLaunch
from .kv_reads import KVReads
from .op_calls import CustomOpCalls
from .launch import CubinKernel
from ..ir.bounds import load_sites, out_of_bounds
from .errors import NeedsAutograd, SpecServes
from .block_table import run_block_prepass
from .fastpath import IDENTITY, Plan, canon
from .pack import FWD_LAYOUT, PAGED_LAYOUT, pack_fwd_raw, pack_params, params_format
from .rules import rows_aligned, shapes_fit
from .tma import no_broadcast

DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}  # what the kernel computes in


class KernelRunner(KVReads, CustomOpCalls):
    """A compiled kernel as a callable with the spec's signature. `KernelRunner(...)` makes the runner of
    the lowered tile's kind: the FA2-class prefill kernel (this class), the Hopper one (HopperRunner,
    ops/hopper_launch.py) or the split-KV decode kernel (DecodeRunner, ops/decode_launch.py). The kinds
    share the call path (binding, checks, FwdArgs and Params, pages and pieces; the custom op's calls in
    ops/op_calls.py); each has its own launch."""

    _tma = False  # TMA reads (HopperLaunch): operands with broadcast dims are copied
    decodable = False  # the C Decoder may launch its calls (DecodeLaunch)
    per_call_ranks: dict[str, int] = {}  # the extra tensors whose Params words a call fills (DecodeLaunch)
    per_call_words: tuple = ()
    _decoder: Any = None
    # the launch blocks of FwdArgs, Params and the pages (the kernel's own order; the FA2 kernel's pages last)
    _BLOCK = {"a": 0, "p": 1, "pg": -1}

    def __new__(cls, p: Program | None = None, low: Lowered | None = None, *args: Any, **kwargs: Any) -> "KernelRunner":
        if cls is KernelRunner and low is not None:
            cls = _KINDS.get(low.tile.kernel, KernelRunner)
        return super().__new__(cls)

    def __init__(self, p: Program, low: Lowered, kernel: CubinKernel, head_dim: int, info: dict,
                 aux: dict[str, CubinKernel] | None = None, value_dim: int | None = None,
                 paged: tuple[PagedRead, PagedRead] | None = None, segments: KVSegments | None = None,
                 pad_from: tuple[int, int] | None = None) -> None:
        self.p = p
        # the call's own head dims where the kernel takes them padded to its step of 8 (lower/choice.py): each
        # call's q, k and v are copied zero-padded, and the output cut back (_execute_padded)
        self._pad_from = pad_from
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
        self._row_lse = p.row_scale is not None and ROW_LSE in free_vars(p.row_scale)  # the kernel writes it
        self._lse_out = p.out.lse_index >= 0  # the spec returns the rows' log-sum-exp: the kernel writes it
        # what a call must work out, decided once: most programs need none of it per call
        self._fast = self.plan.simple and not any(s.arg is not None for s in p.scalars) and not p.prologue \
            and not p.epilogue
        self._extra_paths = [(x.name, x.arg) for x in p.extras if x.arg is not None]
        self._needs_sizes = bool(p.requires) or self._lit is None
        self._layouts: dict[tuple, tuple] = {}
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
        # the host fast path may replay such a launch for calls of its exact layout (ops/hotpath.py; a record
        # returns the output alone); _last holds the latest such launch
        qkv = self.plan.qkv_at
        self._replay_at = qkv[:3] if one_launch and qkv is not None and pad_from is None else None
        self._init_kind()
        self.replayable = self._replay_at is not None and not p.out.tuple_len
        self._last: tuple | None = None

    def _init_kind(self) -> None:
        """The kind's own state, made last (DecodeLaunch: the split scratch, the C Decoder's arguments)."""

    # -- calls -----------------------------------------------------------------
    def serve(self, args: tuple, kwargs: dict, record: bool = False) -> Any:
        """A call of the compiled function. `record`: the caller may record this launch for the host fast
        path (DecodeLaunch.serve otherwise launches from C where it can)."""
        return self(*args, **kwargs)

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

    def _extras(self, bound: dict[str, Any], made: dict[str, Any]) -> dict[str, Any]:
        """Extra tensors by name: call arguments, prologue results; None for captured constants."""
        return {x.name: made[x.step] if x.step is not None else lookup(bound, x.arg) if x.arg is not None else None
                for x in self.p.extras}

    def _const(self, x: Any, dev: torch.device) -> torch.Tensor:
        key = (x.name, dev)
        if key not in self._consts:
            self._consts[key] = torch.tensor(x.value, dtype=getattr(torch, x.dtype), device=dev)
        return self._consts[key]

    # -- the launch ----------------------------------------------------------------
    def _execute(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, perms: tuple, extras: dict,
                 bound: dict | None, poison: bool, raw: bool = False, paged: tuple | None = None,
                 want_lse: bool = False, head_dim: int | None = None) -> Any:
        """paged: K's and V's canonical sizes and strides over their pages (or pieces) and the PagedKV
        words (k and v are then the pages, or the first pieces). want_lse: a raw call also returns the
        rows' log-sum-exp (the custom op's autograd saves it for the backward). head_dim: the call's own,
        where q, k and v come padded (_execute_padded): the sizes the program reads take it."""
        if self._pad_from is not None and head_dim is None:
            return self._execute_padded(q, k, v, perms, extras, bound, poison, raw, want_lse)
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
                q = _readable_copy(q, perms[0])
                qs = q.stride()
        elif not (rows_aligned(q.data_ptr(), qs) and rows_aligned(k.data_ptr(), ks) and rows_aligned(v.data_ptr(), vs)) \
                or tma and not (  # cp.async/TMA need 16-byte rows
                no_broadcast((B, H, Sq, D), qs) and no_broadcast((B, Hkv, Skv, D), ks)
                and no_broadcast((B, Hkv, Skv, Dv), vs)):
            q, k, v = (_readable_copy(t, pm) for t, pm in zip((q, k, v), perms))
            qs, ks, vs = q.stride(), k.stride(), v.stride()
        sizes = None
        hkv_spec = self.paged[0].heads if self.paged is not None else Hkv  # the kernel packs paged heads its own way
        if self._needs_sizes or self._scale_const is None:
            sizes = {"B": B, "H": H, "Hkv": hkv_spec, "Sq": Sq, "Skv": Skv, "D": head_dim or D}
            for name, val in p.requires:
                if sizes[name] != val:
                    raise ValueError(f"this program was captured with {name}={val} and is only valid there "
                                     f"(got {name}={sizes[name]})")
        scal = self._lit if self._lit is not None else scalar_values(p, bound or {}, sizes)
        tensors = self._tensors(extras, q.device) if p.extras else {}
        if self._sites:
            self._check_bounds(B, H, hkv_spec, Sq, Skv, head_dim or D, scal, tensors)
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
            if self._row_lse or self._lse_out or want_lse else None
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
            self._launch((fwd, params), q, k, v, qs, ks, vs, B, H, Hkv, Sq, Skv, D, Dv, di, stream, paged,
                         not raw and not poison)
        else:
            out.zero_()
        if p.row_scale is not None and not want_lse:  # with want_lse (the op with autograd) the caller scales
            self._scale_rows(out, lay[1], (B, H, Sq, Dv), {"B": B, "H": H, "Hkv": hkv_spec, "Sq": Sq, "Skv": Skv,
                                                            "D": head_dim or D}, scal, tensors, lse)
        return self._result(out, raw, lse, want_lse)

    def _execute_padded(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, perms: tuple, extras: dict,
                        bound: dict | None, poison: bool, raw: bool, want_lse: bool) -> Any:
        """_execute for head dims off the kernel's step of 8: q, k and v copied as [B, H, S, D] zero-padded to
        the kernel's head dims, the output, made at the padded value dim, copied back cut to the call's."""
        d, dv = self._pad_from
        if not raw and torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                                       for t in (q, k, v, *extras.values())):
            raise NeedsAutograd("the kernel has no backward yet")  # as _execute: the op's autograd serves it
        for t, pm, n in ((q, perms[0], d), (k, perms[1], d), (v, perms[2], dv)):
            if canon(t, pm)[0][3] != n:
                raise ValueError(f"head dims must be {d} for query and key, {dv} for value")
        qp, kp, vp = (torch.nn.functional.pad(t.as_strided(*canon(t, pm)), (0, n - canon(t, pm)[0][3]))
                      for t, pm, n in ((q, perms[0], self.head_dim), (k, perms[1], self.head_dim),
                                       (v, perms[2], self.value_dim)))
        res = self._execute(qp, kp, vp, (IDENTITY,) * 3, extras, bound, poison, raw=True, want_lse=want_lse,
                            head_dim=d)
        out, lse = res if isinstance(res, tuple) else (res, None)
        B, H, Sq = qp.shape[:3]
        shape, strides = self.plan.out_layout(B, H, Sq, dv)
        cut = out.new_empty(shape)
        _, wide = self.plan.out_layout(B, H, Sq, self.value_dim)
        cut.as_strided((B, H, Sq, dv), strides).copy_(out.as_strided((B, H, Sq, self.value_dim), wide)[..., :dv])
        return self._result(cut, raw, lse, want_lse)

    def _launch(self, blocks: tuple, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qs: tuple, ks: tuple,
                vs: tuple, B: int, H: int, Hkv: int, Sq: int, Skv: int, D: int, Dv: int, di: int, stream: int,
                paged: tuple | None, keep: bool) -> None:
        """The FA2-class kernel: one CTA per (row tile, head, batch), the PagedKV words after Params where
        paged; the launch kept for a record where `keep` (no raw op call, no poisoned output)."""
        grid = (-(-Sq // self.low.tile.block_m), H, B)
        if paged is not None:
            blocks += (paged[2],)
        self.kernel.launch(grid, blocks, stream)
        if self.replayable and keep:
            self._last = (grid, blocks, stream, di, None)

    def take_launch(self) -> tuple | None:
        """The latest replayable launch (grid, blocks, stream, device, what it needs kept alive), once."""
        last, self._last = self._last, None
        return last

    def replay_sources(self) -> tuple[int, ...] | None:
        """The argument positions whose pointers a replayed launch takes (q, k, v or q, the pages and
        tables, then the extra tensors: the Decoder's order), or None where no launch replays."""
        return self._replay_at if self.replayable else None

    def _pointer_patches(self) -> tuple[tuple[int, int, int, bool], ...]:
        """q's, k's (or K's pages'), v's and the output's pointers: FwdArgs' q, k, v and o."""
        n, a = len(self._replay_at or ()), self._BLOCK["a"]
        return tuple((src, a, FWD_LAYOUT.offset(w), False) for src, w in ((0, "q"), (1, "k"), (2, "v"), (n, "o")))

    def replay_patches(self) -> tuple[tuple[int, int, int, bool], ...]:
        """Where a replayed launch takes each call's pointers: (source, block, byte offset, tensor map?),
        sources numbered as replay_sources, the output last: FwdArgs' pointers; the block tables' into the
        PagedKV words; the extra tensors' into Params."""
        pg, p = self._BLOCK["pg"], self._BLOCK["p"]
        tables = tuple((src, pg, PAGED_LAYOUT.offset(w), False) for src, w in ((3, "k_table"), (4, "v_table"))) \
            if self.paged is not None else ()
        first = 5 if self.paged is not None else 3
        return self._pointer_patches() + tables + tuple(
            (first + src, p, off, False) for off, kind, src, _ in self.per_call_words if kind == 0)

    def _scale_rows(self, out: torch.Tensor, strides: tuple, shape: tuple, sizes: dict, scal: dict,
                    tensors: dict, lse: torch.Tensor | None) -> None:
        """The program's row scale on the output, in place, by PyTorch after the kernel (on its stream)."""
        o = out.as_strided(shape, strides)
        o.mul_(self._row_factor(sizes, scal, tensors, lse, shape[:3], out.device).to(o.dtype))

    def _result(self, out: torch.Tensor, raw: bool, lse: torch.Tensor | None = None, want_lse: bool = False) -> Any:
        p = self.p
        if raw:
            return (out, lse) if self._lse_out or want_lse else out
        return as_result(p, out if p.out.dtype == "q" else out.to(getattr(torch, p.out.dtype)), lse, self.dtype)

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
        rt, self._table = run_block_prepass(self.aux["prepass"], self.aux["scan"], fwd, self.fmt, self.low.params,
                                            tensors, scal, B, H, Sq, Skv, tile.block_m, tile.block_n,
                                            self.p.mask, dev, stream)
        return rt  # self._table: the buffer kept alive until the launch is enqueued on the stream

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


def _readable_copy(t: torch.Tensor, perm: tuple) -> torch.Tensor:
    """A dense [B, H, S, D] copy of operand t (read through `perm`) that the kernel reads: rows of D
    contiguous, whatever t's own layout (a key given transposed, [B, H, D, S], is contiguous in S, and its
    own `contiguous()` keeps it so), on a 16-byte boundary (`contiguous()` returns a dense view as it is,
    even a slice one element in, which cp.async and TMA cannot read)."""
    c = t.as_strided(*canon(t, perm)).contiguous()
    return c if c.data_ptr() % 16 == 0 else c.clone()


class DecodeRunner(DecodeLaunch, KernelRunner):
    """The split-KV decode kernel's runner (ops/decode_launch.py)."""


class HopperRunner(HopperLaunch, KernelRunner):
    """The Hopper prefill kernel's runner (ops/hopper_launch.py)."""


_KINDS = {"decode": DecodeRunner, "sm90": HopperRunner}  # by Tile.kernel; the rest: KernelRunner (FA2-class)
