"""A correct half-precision attention kernel, simulated on the CPU, and its float64 reference.

The kernel's arithmetic: inputs in the call's dtype, scores, softmax statistics and P V sums in
float32, P rounded to the call's dtype before P V (as a tensor-core kernel feeds it), the output
rounded to the call's dtype. The reference: the same maths in float64 on the same inputs. The row
judge (torch_cubridge/verify/judge.py) must accept every such output and reject the mutations."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

Score = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (s, h, i, j) -> s
Mask = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]                 # (b, i, j) -> keep


@dataclass(frozen=True)
class Variant:
    name: str
    score: Score
    mask: Mask | None


def _slopes(H: int) -> torch.Tensor:
    return torch.tensor([2 ** (-8 * (h + 1) / H) for h in range(H)], dtype=torch.float64)


def _causal(b, i, j):
    return (i + (j.max() - i.max()).clamp_min(0) >= j)  # bottom-right aligned when Skv > Sq


VARIANTS = (
    Variant("plain", lambda s, h, i, j: s, None),
    Variant("causal", lambda s, h, i, j: s, _causal),
    Variant("sliding", lambda s, h, i, j: s, lambda b, i, j: _causal(b, i, j) & (i - j < 64)),
    Variant("softcap", lambda s, h, i, j: 30.0 * torch.tanh(s / 30.0), _causal),
    Variant("alibi", lambda s, h, i, j: s - _slopes(h.shape[0]).to(s.dtype)[:, None, None] * (i - j).abs(), None),
    Variant("padded", lambda s, h, i, j: s, lambda b, i, j: j < (j.shape[-1] - 17 * (b + 1))),
)


def inputs(B: int, H: int, Hkv: int, Sq: int, Skv: int, D: int, mag: float, dtype: torch.dtype,
           seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, H, Sq, D, generator=g) * mag).to(dtype)
    k = (torch.randn(B, Hkv, Skv, D, generator=g) * mag).to(dtype)
    v = torch.randn(B, Hkv, Skv, D, generator=g).to(dtype)
    return q, k, v


def attention(q, k, v, variant: Variant, compute: torch.dtype, round_p: torch.dtype | None = None,
              mask_shift: tuple[int, int, int] | None = None) -> torch.Tensor:
    """softmax(score(q k^T / sqrt(D)), mask) v in `compute`; P rounded to `round_p` before P V.
    mask_shift (r0, r1, n): rows r0..r1-1 see their mask moved n keys right (a wrong kernel)."""
    B, H, Sq, D = q.shape
    Skv = k.shape[2]
    rep = H // k.shape[1]
    q, k, v = (x.to(compute) for x in (q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)))
    s = (q @ k.transpose(-1, -2)) / math.sqrt(D)
    b = torch.arange(B)[:, None, None, None]
    h = torch.arange(H)
    i = torch.arange(Sq)[:, None]
    j = torch.arange(Skv)[None, :]
    s = variant.score(s, h, i, j).to(compute)
    if variant.mask is not None:
        keep = variant.mask(b, i, j).expand(B, 1, Sq, Skv)
        if mask_shift is not None:
            r0, r1, n = mask_shift
            moved = variant.mask(b, i, j - n).expand(B, 1, Sq, Skv)
            rows = ((i >= r0) & (i < r1)).expand(B, 1, Sq, Skv)
            keep = torch.where(rows, moved, keep)
        s = s.masked_fill(~keep, float("-inf"))
    m = s.amax(-1, keepdim=True).nan_to_num(neginf=0.0).clamp(min=-1e30)
    p = torch.exp(s - m)
    l = p.sum(-1, keepdim=True)
    if round_p is not None:
        p = p.to(round_p).to(compute)
    return torch.where(l > 0, (p @ v) / l.clamp_min(1e-30), torch.zeros(()))


def kernel(q, k, v, variant: Variant, **kw) -> torch.Tensor:
    """The simulated correct kernel's output, in the inputs' dtype."""
    return attention(q, k, v, variant, torch.float32, round_p=q.dtype, **kw).to(q.dtype)


def reference(q, k, v, variant: Variant) -> torch.Tensor:
    return attention(q, k, v, variant, torch.float64)
