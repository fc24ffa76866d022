"""The backward kernel (lower/backward.py, csrc/cubridge/bwd_*.cuh) for one program at one head dim, dtype and
arch: built once, then launched per backward as three kernels (the preprocess: delta, the LSE in padded rows
and dQ's float32 accumulator; the main kernel: a CTA per key tile, on sm_90a the Hopper one, which reads Q,
K, V and dO through tensor maps; the postprocess: dQ in the input dtype).

It reads q, k, v, O, dO as [B, H, S, D] with the last dim contiguous, the forward's LSE [B, H, Sq] in
float32, and writes dQ, dK, dV straight into tensors in the operands' own layouts.
"""
from __future__ import annotations

import torch

from ..ir.bind import scalar_values, sizes_of, to_canonical
from ..ir.interval import interval
from ..ir.program import Program
from .backward_reference import canonical_out
from ..lower.backward import SQ_PAD
from . import layout
from .backward_shares import plan_shares, share_words
from .block_table import prepass_kernels, run_block_prepass
from .pack import FWD_FORMAT, FWD_WORDS
from .rules import rows_aligned
from .tma import no_broadcast, tensor_map

# BwdArgs, read from bwd_config.cuh (ops/layout.py), packed by name: FwdArgs' words, then dO and its strides,
# delta, dQ's accumulator, dQ, dK, dV and their strides, the padded LSE rows and their count, the deterministic
# mode's counters
BWD_LAYOUT = layout.read("BwdArgs")
_pack_bwd = BWD_LAYOUT.packer(tuple(f"f.{w}" for w in FWD_WORDS) + (
    "dout", "do_sb", "do_sh", "do_ss", "delta", "dq_acc", "dq", "dq_sb", "dq_sh", "dq_ss", "dk", "dk_sb", "dk_sh",
    "dk_ss", "dv", "dv_sb", "dv_sh", "dv_ss", "lse_pad", "sq_pad", "dq_sem", "b0", "hk0", "h0", "slot_heads",
    "slot_base"))


def refusal(p: Program, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, has_lse: bool) -> str | None:
    """Why the kernel cannot take this call (before lower_backward's own refusals); None where it can."""
    if not q.is_cuda:
        return "the tensors are not on a CUDA device"
    if not has_lse:
        return "the forward saved no log-sum-exp"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"the backward kernel computes in bfloat16 or float16, not {q.dtype}"
    qc, kc, vc = (to_canonical(t, op) for t, op in ((q, p.q), (k, p.k), (v, p.v)))
    if not (kc.shape[0] == vc.shape[0] == qc.shape[0]) or 0 in (*kc.stride()[:2], *vc.stride()[:2]):
        return "K or V is broadcast over the batch or the heads"
    return None


# A call's shares (ops/backward_shares.py): each share's scratch within SCRATCH_OF_Q of q's bytes, with at
# least WAVES waves of CTAs, STREAMS shares in flight. dQ's accumulator for a whole call is twice q's bytes
# (half again FlexAttention's peak above its inputs, which holds O, dQ, dK and dV alone). At B 8, H 16, S 4k
# (bwd_check --shares) the split costs the causal backward 2% at D 128 and 1% at D 64 with two shares in
# flight, and 20% with one (each launch's tail idles the machine).
SCRATCH_OF_Q = 0.15
WAVES = 2
STREAMS = 2


class GpuBackward:
    """The three kernels of one program's backward, at one head dim, dtype and arch."""

    def __init__(self, p: Program, arch: str, dtype: torch.dtype, head_dim: int, kernel: str | None = None,
                 value_dim: int | None = None, deterministic: bool = False, stages: int | None = None,
                 learnable: tuple[str, ...] = ()) -> None:
        """learnable: the extras that get gradients; the kernel adds those of the ones the score reads
        (LoweredBackward.sites)."""
        from ..lower.backward import PREPOST_THREADS, lower_backward
        from ..build.early import backward_cubin
        from ..ops.kernel import backward_key
        from ..ops.launch import CubinKernel
        from ..ops.pack import params_format
        self.p = p
        # value_dim: V's head dim, refused by lower_backward where the kernels take none but Q's
        self.low = low = lower_backward(p, arch, str(dtype).removeprefix("torch."), head_dim, value_dim,
                                        kernel=kernel, deterministic=deterministic, stages=stages,
                                        learnable=learnable)
        # through the disk cache, as the forward's: a training job's ranks, and its next run, build it once
        # (the early build of it, where the forward's call wanted gradients: build/early.py)
        cub, self.info = backward_cubin(backward_key(low, arch), low.source, arch, low.kernels[1])
        self.rows_per_cta = low.prepost_rows
        self.pre = CubinKernel(cub, low.kernels[0], threads=PREPOST_THREADS, smem_bytes=0)
        self.main = CubinKernel(cub, low.kernels[1], threads=low.tile.threads, smem_bytes=low.smem_bytes)
        self.post = CubinKernel(cub, low.kernels[2], threads=PREPOST_THREADS, smem_bytes=0)
        self.fmt = params_format(low.params)
        # the block-class pre-pass and scan of a mask that reads data, at this kernel's tile
        self.blocks = prepass_kernels(cub) if low.prepass else None
        # how a call is split into shares (ops/backward_shares.py); benchmarks try others
        self.scratch_of_q, self.waves, self.streams = SCRATCH_OF_Q, WAVES, STREAMS

    def scratch_budget(self, q: torch.Tensor) -> int:
        """The most scratch one share may hold: a fraction of q's own bytes."""
        return int(q.numel() * q.element_size() * self.scratch_of_q)

    def min_ctas(self, device: torch.device) -> int:
        """The fewest main-kernel CTAs a share keeps: `waves` CTAs per SM (one CTA fills an SM)."""
        return self.waves * torch.cuda.get_device_properties(device).multi_processor_count

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, extras: list[torch.Tensor],
                 scalars: list[float], out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """dQ, dK, dV in q's, k's and v's layouts (out and dout in the kernel's layout; lse [B, H, Sq]), and the
        float32 gradients of the learnable extras the score reads, by name."""
        from ..ops.pack import pack_params
        p = self.p
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        rows = _tma_rows if self.low.tile.kernel == "sm90" else _rows
        qc, kc, vc = (rows(to_canonical(t, op)) for t, op in ((q, p.q), (k, p.k), (v, p.v)))
        dqc, dkc, dvc = (to_canonical(t, op) for t, op in ((dq, p.q), (dk, p.k), (dv, p.v)))
        B, H, Sq, D = qc.shape
        Hkv, Skv = kc.shape[1], kc.shape[2]
        oc = _rows(canonical_out(p, out, B, H, Sq, vc.shape[-1]))
        doc = rows(canonical_out(p, dout, B, H, Sq, vc.shape[-1]))
        lse = lse.float().contiguous()
        sizes = sizes_of(p, qc, kc)
        it = iter(scalars)
        scal = scalar_values(p, {s.arg: next(it) for s in p.scalars if s.arg is not None}, sizes)
        scale = 1.0
        if self.low.scale is not None:
            scale = interval(self.low.scale, {n: (float(x), float(x)) for n, x in {**sizes, **scal}.items()})[0]
        tensors = {x.name: t for x, t in zip(p.extras, extras)}
        cur = torch.cuda.current_stream(q.device)
        sq_pad = -(-Sq // SQ_PAD) * SQ_PAD
        group, sm90 = H // Hkv, self.low.tile.kernel == "sm90"
        acc_cols = -(-D // 64) * 64 if sm90 else D  # 64 x 64 blocks on Hopper (bwd_prepost.cuh dq_tiled_at)
        row_floats = (acc_cols + 2) if sm90 else 2  # per padded row: the accumulator's, delta and the LSE
        pair_bytes = 4 * group * (sq_pad * row_floats + (0 if sm90 else Sq * D))
        n_tiles = -(-Skv // self.low.tile.block_n)
        shares = plan_shares(B, Hkv, pair_bytes, self.scratch_budget(qc), n_tiles, self.min_ctas(q.device))
        # the kernels write dQ, dK, dV through [B, H, S, D] strides: where the operand's layout has its last
        # dim strided, they write a dense buffer copied over after
        bufs = [t if t.stride(-1) == 1 else torch.empty(t.shape, dtype=t.dtype, device=t.device)
                for t in (dqc, dkc, dvc)]
        outs = tuple(x for b in bufs for x in (b.data_ptr(), *_st(b)))
        fwd = (qc.data_ptr(), kc.data_ptr(), vc.data_ptr(), oc.data_ptr(), lse.data_ptr(), *_st(qc), *_st(kc),
               *_st(vc), *_st(oc), B, H, Hkv, Sq, Skv, scale, doc.data_ptr(), *_st(doc))
        grads = {n: torch.zeros(tensors[n].shape, device=q.device, dtype=torch.float32) for n in self.low.sites}
        rt, table = {}, None
        if self.blocks is not None:  # BwdArgs begins with FwdArgs, which the pre-pass reads
            words = _pack_bwd(*fwd, 0, 0, *outs, 0, sq_pad, 0, 0, 0, 0, H, 0)
            rt, table = run_block_prepass(*self.blocks, words[:FWD_FORMAT.size], self.fmt, self.low.params,
                                          tensors, scal, B, H, Sq, Skv, self.low.tile.block_m,
                                          self.low.tile.block_n, p.mask, q.device, cur.cuda_stream)
        params = pack_params(self.fmt, self.low.params, tensors, scal, rt, grads)
        maps = ()
        if sm90:  # Q and dO in boxes of 64 rows, K and V of the CTA's keys
            m, n, dt = self.low.tile.block_m, self.low.tile.block_n, q.dtype
            maps = tuple(tensor_map(t.data_ptr(), tuple(t.shape), (*t.stride()[:3], 1), dt, r)
                         for t, r in ((qc, m), (kc, n), (vc, n), (doc, m)))
        # two shares in flight where there are several, on the caller's stream and a second one, each with its
        # own scratch: one launch's tail overlaps the next one's body
        lanes = [cur] if len(shares) == 1 or self.streams == 1 else [cur, _side_stream(q.device)]
        most = max(s.nb * s.nhk for s in shares) * group
        scratch = [(torch.empty(most, sq_pad, device=q.device, dtype=torch.float32),
                    torch.empty(most, sq_pad, device=q.device, dtype=torch.float32),
                    torch.empty(most * (sq_pad * acc_cols if sm90 else Sq * D), device=q.device,
                                dtype=torch.float32)) for _ in lanes]
        # the deterministic mode's counters, one per 64 x 64 block of a share's accumulator, zeroed per share
        det = sm90 and self.low.tile.deterministic
        sems = [torch.zeros(s.nb * s.nhk * group * sq_pad * acc_cols // 4096, device=q.device, dtype=torch.int32)
                if det else None for s in shares]
        if len(lanes) > 1:  # after every allocation and zeroing on the caller's stream
            lanes[1].wait_stream(cur)
        for i, (sh, sem) in enumerate(zip(shares, sems)):
            st, (delta, lse_pad, dq_acc) = lanes[i % len(lanes)].cuda_stream, scratch[i % len(lanes)]
            heads = sh.nhk * group
            args = _pack_bwd(*fwd, delta.data_ptr(), dq_acc.data_ptr(), *outs, lse_pad.data_ptr(), sq_pad,
                             sem.data_ptr() if det else 0, *share_words(sh, group))
            self.pre.launch((-(-sq_pad // self.rows_per_cta), heads, sh.nb), (args,), st)
            self.main.launch((n_tiles, sh.nhk, sh.nb), (args, params, *maps), st)
            self.post.launch((-(-Sq // self.rows_per_cta), heads, sh.nb), (args,), st)
        if len(lanes) > 1:  # the caller's later work, and the allocator's reuse of what is freed here, after both
            cur.wait_stream(lanes[1])
        del table, scratch, sems  # enqueued: the allocator reuses them only for later work on this stream
        for t, b in zip((dqc, dkc, dvc), bufs):
            if b is not t:
                t.copy_(b)
        return dq, dk, dv, grads


_SIDE: dict[int, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The second stream shares alternate onto, one per device (made once: a stream is a driver object)."""
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _SIDE:
        _SIDE[i] = torch.cuda.Stream(device=i)
    return _SIDE[i]


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t with its last dim contiguous (the kernel reads rows of D elements)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _tma_rows(t: torch.Tensor) -> torch.Tensor:
    """t as the copy engine reads it where it lies, as the forward's runner asks (rules.rows_aligned, and
    tma.no_broadcast); else a contiguous copy."""
    ok = rows_aligned(t.data_ptr(), tuple(t.stride())) and no_broadcast(tuple(t.shape), tuple(t.stride()))
    return t if ok else t.contiguous()


def _st(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)
