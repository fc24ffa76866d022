"""Size-1 dims in every writing style: a size-1 batch, head and query axis look alike to the analysis
(einsum's bmm views them in any order), so they are named by position, not by the roles their atoms
happened to get. Decoding with B = 1 in einsum style was refused ("key is indexed by an unsupported
head/batch expression"), and a [B, S, H*D] output with H = 1 failed validation.
"""
import itertools
from dataclasses import replace

import pytest
import torch

import torch_cubridge as tc
from torch_cubridge.capture.trace import bind_example
from torch_cubridge.verify import cpu as vcpu
from helpers import rel_err, to64
from test_decode_transfer import einsum_style, matmul_style

D = 16


def bmm_style(q, k, v):
    B, H, Sq, Dh = q.shape
    S = k.shape[2]
    p = torch.bmm(q.reshape(B * H, Sq, Dh), k.reshape(B * H, S, Dh).transpose(1, 2)).mul(Dh ** -0.5).softmax(-1)
    return torch.bmm(p, v.reshape(B * H, S, Dh)).view(B, H, Sq, Dh)


def einsum_repeat_interleave(q, k, v):
    r = q.shape[1] // k.shape[1]
    return einsum_style(q, k.repeat_interleave(r, 1), v.repeat_interleave(r, 1))


def einsum_expand(q, k, v):
    B, Hkv, S, Dh = k.shape
    r = q.shape[1] // Hkv
    grow = lambda x: x[:, :, None].expand(B, Hkv, r, S, Dh).reshape(B, Hkv * r, S, Dh)
    return einsum_style(q, grow(k), grow(v))


def einsum_bshd(q, k, v):  # transformers' layout: heads after the sequence
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v)


def bshd_reshaped_output(q, k, v):  # ... and the output reshaped to [B, S, H * D]
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    o = matmul_style(q, k, v).transpose(1, 2)
    return o.reshape(o.shape[0], o.shape[1], -1)


STYLES = [matmul_style, einsum_style, bmm_style, einsum_repeat_interleave, einsum_expand, einsum_bshd,
          bshd_reshaped_output]
GQA = (einsum_repeat_interleave, einsum_expand)
BSHD = (einsum_bshd, bshd_reshaped_output)


def maker(spec, B, Sq, H):
    Hkv = max(H // 2, 1) if spec in GQA else H

    def make(S, seed=0):
        g = torch.Generator().manual_seed(seed)
        shapes = [(B, H, Sq, D), (B, Hkv, S, D), (B, Hkv, S, D)]
        if spec in BSHD:
            shapes = [(b, s, h, d) for b, h, s, d in shapes]
        return tuple(torch.randn(*s, generator=g) for s in shapes)
    return make


@pytest.mark.parametrize("B,Sq,H", list(itertools.product((1, 2), (1, 5), (1, 4))))
@pytest.mark.parametrize("spec", STYLES)
def test_unit_dims_transfer_and_match_the_spec(spec, B, Sq, H):
    make = maker(spec, B, Sq, H)
    p = tc.transfer(spec, *make(33))  # transfer verifies on the CPU: it raises on a mismatch
    for S in (33, 40):
        args = make(S, seed=S)
        got = p.run(*args)
        ref = spec(*to64(args))
        assert got.shape == ref.shape
        assert rel_err(got, ref) < 1e-6


def test_gqa_decode_keeps_the_head_map():
    p = tc.transfer(einsum_repeat_interleave, *maker(einsum_repeat_interleave, 1, 1, 4)(33))
    assert p.head_map == "group" and p.q.dims == ("b", "h", "s", "d")


@pytest.mark.parametrize("B", [1, 2])
def test_a_wrong_decode_program_is_rejected(B):
    """Verification still tells a wrong head map or a wrong layout from the right one."""
    spec = einsum_repeat_interleave
    args = maker(spec, B, 1, 4)(33)
    good = tc.transfer(spec, *args)
    bound = bind_example(spec, args, {})
    assert vcpu.verify_program(spec, good, bound).ok
    assert not vcpu.verify_program(spec, replace(good, head_map="tile"), bound).ok
    assert not vcpu.verify_program(spec, replace(good, q=replace(good.q, dims=("h", "b", "s", "d"))), bound).ok


def _causal(q, k, v):
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    n = q.shape[-2]
    keep = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    return s.masked_fill(~keep, float("-inf")).softmax(-1) @ v


@pytest.mark.parametrize("spec", [_causal, bmm_style, matmul_style, einsum_style, einsum_bshd])
@pytest.mark.parametrize("B,H", [(1, 4), (2, 2)])
def test_a_one_token_prompt_transfers(spec, B, H):
    """Sq = Skv = 1 (a one-token prompt, no cache): the single key aligned with the single value row was read
    as the constant 0 on one side, so the output matmul found no key axis in v ("a matmul operand is not a
    (scaled) input tensor"). The program holds at that shape and matches fp64. einsum at that shape: its
    views of unit dims left the key atom off the softmax's axis ("softmax must run over the key axis"), and
    its P.v is a broadcast product with the one key summed by a view ("scaled along the key axis")."""
    shape = (B, 1, H, D) if spec is einsum_bshd else (B, H, 1, D)
    q, k, v = (torch.randn(shape) for _ in range(3))
    p = tc.transfer(spec, q, k, v)
    assert dict(p.requires).get("Sq") == 1 and dict(p.requires).get("Skv") == 1
    assert rel_err(p.run(*to64((q, k, v))), spec(*to64((q, k, v)))) < 1e-6


def time_first_projected(x, wq, k, v):
    """fairseq's and FSMT's layout: the query [Sq, B, E] projected and scaled, then viewed [Sq, B*H, D] and
    transposed for bmm against keys kept [B, H, S, D] (a cache's layout)."""
    Sq, B, E = x.shape
    H, Dh = k.shape[1], k.shape[-1]
    q = (x @ wq.t()) * Dh ** -0.5
    q = q.view(-1, B * H, Dh).transpose(0, 1)
    p = torch.bmm(q, k.reshape(B * H, -1, Dh).transpose(1, 2)).softmax(-1)
    return torch.bmm(p, v.reshape(B * H, -1, Dh)).transpose(0, 1).contiguous().view(Sq, B, E)


def time_first_argument(q, k, v):
    """The same with the query an argument: [Sq, B, H*D] read as [B*H, Sq, D] through a view."""
    Sq, B, E = q.shape
    H, Dh = k.shape[1], k.shape[-1]
    q = q.view(Sq, B * H, Dh).transpose(0, 1) * Dh ** -0.5
    p = torch.bmm(q, k.reshape(B * H, -1, Dh).transpose(1, 2)).softmax(-1)
    return torch.bmm(p, v.reshape(B * H, -1, Dh)).transpose(0, 1).reshape(Sq, B, E)


@pytest.mark.parametrize("B,Sq,H", list(itertools.product((1, 2), (1, 5), (1, 4))))
@pytest.mark.parametrize("spec", [time_first_projected, time_first_argument])
def test_a_time_first_query_transfers_at_unit_batch_and_query(spec, B, Sq, H):
    """Decoding one token (Sq = 1) or one sequence (B = 1) in the time-first layout: at Sq = 1 the projected
    query was made by the prologue only at the matmul, after the walk had passed its views, so the split
    view the retry asks for was never made ("query packs dims the spec splits apart"); at B = 1 the query was
    made without its unit batch, and the output's unit batch axis had no name left."""
    g = torch.Generator().manual_seed(B * 100 + Sq * 10 + H)
    x = torch.randn(Sq, B, H * D, generator=g)
    kv = [torch.randn(B, H, 9, D, generator=g) for _ in range(2)]
    args = (x, torch.randn(H * D, H * D, generator=g) / 8, *kv) if spec is time_first_projected else (x, *kv)
    p = tc.transfer(spec, *args)  # transfer verifies on the CPU: it raises on a mismatch
    assert rel_err(p.run(*to64(args)), spec(*to64(args))) < 1e-6
