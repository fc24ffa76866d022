"""On a CUDA device: calls with few queries (decode, speculative decoding) go to the split-KV decode
kernel, which packs the query heads of a KV head into one tile; every output against float64."""
import math

import pytest
import torch

import torch_cubridge as tc
from helpers import assert_rows_close, graph_replay, rel_err

pytestmark = pytest.mark.gpu


def gqa_bottom_right_window(q, k, v, window=256):
    """Decode against a cache: the last Sq of Skv positions, a sliding window, GQA by repeat."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    Sq, Skv = q.shape[-2], k.shape[-2]
    i = torch.arange(Sq, device=q.device)[:, None] + (Skv - Sq)
    j = torch.arange(Skv, device=q.device)[None, :]
    keep = (j <= i) & (i - j < window)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return s.masked_fill(~keep, float("-inf")).softmax(-1) @ v


def softcap_alibi_sdpa_gqa(q, k, v, slopes):
    """Softcap and ALiBi with per-head slopes, GQA through SDPA's enable_gqa-free expand."""
    B, H, Sq, D = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    k = k[:, :, None].expand(B, Hkv, H // Hkv, Skv, D).reshape(B, H, Skv, D)
    v = v[:, :, None].expand(B, Hkv, H // Hkv, Skv, D).reshape(B, H, Skv, D)
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * D ** -0.5
    s = 20.0 * torch.tanh(s / 20.0)
    pos = torch.arange(Skv, device=q.device)
    s = s - slopes.view(1, H, 1, 1) * (Skv - 1 - pos).view(1, 1, 1, Skv).float()
    return torch.einsum("bhqk,bhkd->bhqd", s.softmax(-1), v)


def sinks_mqa(q, k, v, sinks):
    """gpt-oss style sinks: one extra logit per head joins the normaliser; MQA (one KV head)."""
    k, v = k.expand(-1, q.shape[1], -1, -1), v.expand(-1, q.shape[1], -1, -1)
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    col = sinks.view(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], 1)
    p = torch.cat([s, col], dim=-1).softmax(-1)[..., :-1]
    return p @ v


def key_padding(q, k, v, pad):
    """A data mask: the decode kernel reads it per element (no block-map pre-pass for a few rows)."""
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    return s.masked_fill(~pad[:, None, None, :], float("-inf")).softmax(-1) @ v


def _inputs(B, H, Hkv, Sq, Skv, D, dtype=torch.bfloat16):
    return tuple(torch.randn(B, h, s, D, dtype=dtype) for h, s in ((H, Sq), (Hkv, Skv), (Hkv, Skv)))


def _check(f, spec, args, kernel="decode"):
    out = f(*(a.cuda() if isinstance(a, torch.Tensor) else a for a in args))
    assert f.served["spec"] == 0, [e.reasons or e.reason for e in f.entries()]
    assert f.kernels()[-1].low.tile.kernel == kernel
    ref = spec(*(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args))
    assert_rows_close(out, ref, args[0].dtype)  # every query row of every head: a wrong split shows there


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("Sq,Skv", [(1, 4099), (4, 777), (16, 1000), (1, 40)])
def test_gqa_window_decode(Sq, Skv, D):
    f = tc.compile(gqa_bottom_right_window, fallback="raise")
    _check(f, gqa_bottom_right_window, _inputs(3, 8, 2, Sq, Skv, D))


@pytest.mark.parametrize("Sq,Skv", [(1, 5000), (8, 300)])
def test_softcap_alibi_decode(Sq, Skv):
    f = tc.compile(softcap_alibi_sdpa_gqa, fallback="raise")
    slopes = torch.rand(16) * 0.1
    _check(f, softcap_alibi_sdpa_gqa, _inputs(2, 16, 4, Sq, Skv, 128) + (slopes,))


def test_sinks_mqa_decode_splits_and_one_split():
    f = tc.compile(sinks_mqa, fallback="raise")
    sinks = torch.randn(8)
    _check(f, sinks_mqa, _inputs(1, 8, 1, 1, 20000, 64) + (sinks,))   # many KV splits, then the combine
    _check(f, sinks_mqa, _inputs(64, 8, 1, 2, 64, 64) + (sinks,))      # many CTAs already: one split


def document_decode(q, k, v, doc):
    """Packed documents, the last Sq tokens decoding: each attends to its own document, causally (GQA)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    Sq, Skv = q.shape[-2], k.shape[-2]
    i = torch.arange(Skv - Sq, Skv, device=q.device)
    j = torch.arange(Skv, device=q.device)
    keep = (doc[:, i][:, :, None] == doc[:, None, :]) & (j[None, None, :] <= i[None, :, None])
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    return s.masked_fill(~keep[:, None], float("-inf")).softmax(-1) @ v


@pytest.mark.parametrize("Sq, Skv", [(1, 500), (4, 3000)])
def test_data_mask_decode(Sq, Skv):
    f = tc.compile(key_padding, fallback="raise")
    q, k, v = _inputs(2, 4, 4, Sq, Skv, 64)
    pad = torch.rand(2, Skv) > 0.3
    pad[1, :1000] = False  # whole blocks masked for one batch row
    _check(f, key_padding, (q, k, v, pad))
    g = tc.compile(document_decode, fallback="raise")
    doc = torch.randint(0, 6, (2, Skv)).sort(-1).values
    _check(g, document_decode, _inputs(2, 8, 2, Sq, Skv, 128) + (doc,))


def test_prefill_then_decode_use_their_own_kernels():
    f = tc.compile(gqa_bottom_right_window, fallback="raise")
    _check(f, gqa_bottom_right_window, _inputs(1, 8, 2, 300, 300, 64), kernel=f"{'sm90' if torch.cuda.get_device_capability() == (9, 0) else 'sm80'}")
    _check(f, gqa_bottom_right_window, _inputs(1, 8, 2, 1, 301, 64))
    assert len({r.low.tile.kernel for r in f.kernels()}) == 2


def test_decode_under_cuda_graph():
    f = tc.compile(gqa_bottom_right_window, fallback="raise")
    q, k, v = (t.cuda() for t in _inputs(2, 8, 2, 1, 3000, 128))
    ref = f(q, k, v).clone()
    assert torch.equal(graph_replay(f, q, k, v), ref)


def packed_additive(query, key, value, attention_mask):
    """A continuous-batching decode step: one query row per sequence, packed, an additive mask over the
    keys of every sequence (transformers' paged eager)."""
    key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
    value = value.repeat_interleave(query.shape[1] // value.shape[1], dim=1)
    w = torch.matmul(query, key.transpose(2, 3)) * query.shape[-1] ** -0.5 + attention_mask
    return torch.matmul(torch.softmax(w, dim=-1, dtype=torch.float32).to(query.dtype), value)


@pytest.mark.parametrize("fill", [torch.finfo(torch.bfloat16).min, -1e9])
def test_rows_of_finite_fills_are_uniform_across_splits(fill):
    """A row with every key filled by a finite value is uniform in the spec (the fill absorbs the scores
    in float32). Across the splits a max times log2(e) overflowed at finfo.min (the row came out 0), and
    a -1e9 row lost each split's sum in its LSE (splits weighted alike): continuous batching's decode
    steps failed GPU verification on the H100 until the splits kept max and sum apart."""
    g = torch.Generator().manual_seed(0)
    lens = [50, 3000, 20, 1029]
    S = sum(lens)
    q = torch.randn(1, 8, len(lens), 64, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(1, 2, S, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    mask = torch.full((1, 1, len(lens), S), fill, dtype=torch.bfloat16)
    s0 = 0
    for i, n in enumerate(lens):
        if i != 2:  # the third row keeps no key: every score is the fill
            mask[..., i, s0:s0 + n] = 0
        s0 += n
    f = tc.compile(packed_additive, fallback="raise")
    out = f(*(t.cuda() for t in (q, k, v, mask)))
    assert f.served["spec"] == 0 and f.kernels()[-1].low.tile.kernel == "decode"
    ref = packed_additive(q.float(), k.float(), v.float(), mask.float())  # float32: the fills absorb
    assert rel_err(out.float().cpu(), ref) < 1e-2
    assert rel_err(out[:, :, 2].float().cpu(), v.float().mean(2).repeat_interleave(4, 1)) < 1e-2


@pytest.mark.parametrize("D", [32, 48, 96, 160])
@pytest.mark.parametrize("B,Skv", [(2, 40), (2, 64), (48, 300)])
def test_one_split_at_head_dims_off_64(D, B, Skv):
    """One split (a single key block, or enough CTAs without splitting: B 48 x 8 KV heads) writes O
    itself: 16-byte stores at head dims that are no multiple of 64 (they were misaligned at 48 and 96,
    a CUDA fault, found by a paged decode's verification at widths of one block)."""
    f = tc.compile(gqa_bottom_right_window, fallback="raise")
    _check(f, gqa_bottom_right_window, _inputs(B, 32, 8, 1, Skv, D))
