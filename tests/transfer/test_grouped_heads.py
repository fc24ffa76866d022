"""GQA written by splitting the query heads into (kv head, group) against keys with the kv heads
(Grok-1's grouped einsum): one query-head axis, keys and values read through a group map, and a
per-head table indexed by the two digits read through the query head."""
import torch

import torch_cubridge as tc
from helpers import rel_err, to64


def grouped_alibi(q, k, v, slopes):
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    g = H // Hkv
    qg = q.view(B, Hkv, g, T, D)
    s = torch.einsum("bkgtd,bksd->bkgts", qg, k) * D ** -0.5
    i = torch.arange(T)[:, None]
    j = torch.arange(k.shape[2])[None, :]
    s = s - slopes.view(Hkv, g)[None, :, :, None, None] * (i - j).abs()  # per (kv head, group)
    s = s.masked_fill(j > i, float("-inf"))
    return torch.einsum("bkgts,bksd->bkgtd", s.softmax(-1), v).reshape(B, H, T, D)


def _args(B=2, H=8, Hkv=2, S=40, D=32):
    return (torch.randn(B, H, S, D), torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D), torch.rand(H))


def test_grouped_query_heads_become_one_head_axis_with_a_group_map():
    p = tc.transfer(grouped_alibi, *_args())
    assert p.head_map == "group" and p.q.dims == ("b", "h", "s", "d")
    args = _args(1, 8, 2, 57, 32)  # other values and sizes
    assert rel_err(p.run(*args), grouped_alibi(*to64(args))) < 1e-5
