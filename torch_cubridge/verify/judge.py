"""Row-wise judgement of an attention output against its float64 reference.

A norm over the whole tensor averages a wrong tile, a mask shifted in a few rows, or a
lost bias in one head into millions of right elements; the same error judged against the
row it lives in is as large as the row. So every element is held to a bound made from its
own row: |out - ref| <= u * (ROW_ULPS * scale_row + ELEMENT_ULPS * |ref|), u the output
dtype's unit roundoff.

Why the row's scale. A correct kernel that keeps scores and sums in float32 loses precision
in the output dtype at two points: P rounded to that dtype before P V (each p off by at most
u, so the row is off by about u times the |p v| mass it averages, of the order of the row's
own values), and the output rounded to it (u |out|). Both scale with the row, never with the
largest row elsewhere in the tensor: a row a sink or a gate makes small is judged at its own
size. scale_row is the row's largest |ref|, floored at FLOOR times the median non-zero row's, so that
a row whose values happen to cancel (an average of values of both signs) is not held to less
than the rounding of what it averages.

The constants were calibrated on the CPU by simulating a correct kernel (tests/support/
simulated_kernel.py, tests/verify/test_row_judge.py): bf16 and fp16 inputs, scores, softmax
and sums in float32, P and the output rounded, over plain, causal, sliding, softcapped, ALiBi
and padded masks, GQA and decode shapes, input magnitudes 1 and 4, head dims 8 to 256. The
largest error seen was 1.7 u times the row's scale; ROW_ULPS = 4 leaves more than twice that. Below 8 the
rule is too tight: a row's largest of four values understates what its P rounding averages, and a correct
kernel reaches 1.77 of the bound at head dim 4 (0.50 at 8), so such a kernel may be refused (the spec then
serves: safe, never wrong).
A mistake is far larger in the rows it touches: one key moved in a row of n keys costs about
1/n of the row's scale (3e-3 at n = 300, 17 times the bf16 bound at test shapes;
tests/verify/test_mutations.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

ROW_ULPS = 4.0      # atol per row: units of u times the row's scale (see above)
ELEMENT_ULPS = 2.0  # rtol per element: the output's own rounding and P's, relative to the element
FLOOR = 1 / 32   # a row's scale is at least this fraction of the median row's


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the distance from 1 to the next value: the largest relative error of one rounding."""
    return torch.finfo(dtype).eps / 2


@dataclass(frozen=True)
class RowVerdict:
    ok: bool
    worst: float     # the largest |out - ref| / bound: 1 or less passes
    bad_rows: int    # rows with an element beyond its bound
    rows: int

    def __str__(self) -> str:
        return f"{'ok' if self.ok else 'MISMATCH'}: worst {self.worst:.2f} of the bound, " \
               f"{self.bad_rows} of {self.rows} rows beyond it"


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last dim]: a row is every index but the last (a scalar is one row of one)."""
    if x.numel() == 0:
        return x.reshape(0, 1)
    return x.reshape(1, 1) if x.dim() == 0 else x.reshape(-1, x.shape[-1])


def row_scale(ref: torch.Tensor) -> torch.Tensor:
    """Each row's largest |ref| (NaN taken as 0), floored at FLOOR times the median row's, of the rows that
    are not zero: a row a mask leaves zero is not a typical one (the dK of keys no query keeps under a narrow
    window; most rows there, which made the floor zero and held a key kept by one near one-hot query to less
    than its own rounding)."""
    r = _rows(ref.detach().double()).nan_to_num(nan=0.0).abs().amax(-1)
    live = r[r > 0]
    if live.numel() == 0:
        return r
    return torch.clamp(r, min=FLOOR * float(live.median()))


def element_bound(ref: torch.Tensor, row_tol: float, element_tol: float = 0.0) -> torch.Tensor:
    """row_tol * scale_row + element_tol * |ref| for every element of `ref` (NaN taken as 0), in its shape."""
    a = _rows(ref.detach().double()).nan_to_num(nan=0.0)
    return (row_tol * row_scale(a)[:, None] + element_tol * a.abs()).reshape(ref.shape)  # on ref's device


def dtype_bound(ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """element_bound at a kernel's rounding in `dtype` (see judge_rows_in)."""
    u = unit_roundoff(dtype)
    return element_bound(ref, ROW_ULPS * u, ELEMENT_ULPS * u)


def judge_rows(out: torch.Tensor, ref: torch.Tensor, row_tol: float, element_tol: float = 0.0,
               allowance: torch.Tensor | None = None) -> RowVerdict:
    """Every element of `out` against `ref`: |out - ref| <= row_tol * scale_row + element_tol * |ref|, plus
    allowance_row where given (a bound per row, in ref.shape[:-1], for an error the row rule cannot see).

    Elements where `ref` is NaN (rows the spec leaves undefined) are left to the caller's rule;
    a NaN or infinity in `out` anywhere else fails."""
    a = _rows(ref.detach().double())   # judged where the reference lies (large trials: on the GPU)
    g = _rows(out.detach().to(a.device, torch.float64))
    if a.shape != g.shape:
        return RowVerdict(False, float("inf"), a.shape[0], a.shape[0])
    if a.numel() == 0:
        return RowVerdict(True, 0.0, 0, a.shape[0])
    undefined = torch.isnan(a)
    a, g = a.masked_fill(undefined, 0.0), g.masked_fill(undefined, 0.0)
    bound = element_bound(a, row_tol, element_tol)
    if allowance is not None:
        bound = bound + allowance.detach().to(a.device, torch.float64).reshape(-1, 1)
    err = (g - a).abs().nan_to_num(nan=float("inf"))
    ratio = err / bound.clamp_min(1e-300)
    bad = (err > bound).any(-1)
    worst = float(ratio.max())
    return RowVerdict(not bool(bad.any()), worst, int(bad.sum()), a.shape[0])


def delta_rounding(out: torch.Tensor, dout: torch.Tensor) -> torch.Tensor:
    """Per query row ([..., Sq]), how far a flash-style backward's delta = rowsum(dO * O) may be from float64's:
    it is formed from O rounded to its dtype, off by up to u * sum|dO * O| (with a factor 2 to spare)."""
    u = 2 * unit_roundoff(out.dtype)
    return u * (dout.double() * out.double().nan_to_num()).abs().sum(-1)


def delta_rounding_allowance(out: torch.Tensor, dout: torch.Tensor, k: torch.Tensor, score_grad_bound: float
                             ) -> torch.Tensor:
    """Per query row ([..., Sq]), what a flash-style backward's dQ may differ from float64's by beyond the row
    rule: delta's rounding (delta_rounding) reaches dQ through dS = P (dP - delta) dscore/ds (at most
    score_grad_bound) summed over the row's keys, each at most max|K|. A row that keeps a few keys has a tiny
    dQ, and this term is then most of it."""
    return 4 * delta_rounding(out, dout) * score_grad_bound * float(k.detach().double().abs().max())


def key_delta_rounding_allowance(p_t_rounding: torch.Tensor, q: torch.Tensor, score_grad_bound: float
                                 ) -> torch.Tensor:
    """Per key row ([..., Skv]), the same for dK: dK_j = sum_i dS_ij q_i, so delta's rounding reaches it as
    sum_i P_ij delta_rounding_i, times dscore/ds and max|Q|. p_t_rounding: that sum per key, P^T applied to
    delta_rounding (the dV of a backward handed delta_rounding as every column of dO). A key that few queries
    keep, near one-hot, has a tiny dK made mostly of this."""
    return 4 * p_t_rounding.double() * score_grad_bound * float(q.detach().double().abs().max())


def judge_rows_in(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> RowVerdict:
    """`out`, a kernel's output in `dtype` (float32 sums inside), against the float64 `ref`."""
    u = unit_roundoff(dtype)
    return judge_rows(out, ref, ROW_ULPS * u, ELEMENT_ULPS * u)
