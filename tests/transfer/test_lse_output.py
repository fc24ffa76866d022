"""A spec that returns the rows' log-sum-exp beside the output (flash-attention's `lse`, ring attention's
merge input): the program returns it too, in the spec's layout and dtype, and verification holds it to
the spec's (a wrong one is refused). Values of the scores that are not the softmax's log-sum-exp, or one
returned beside an output computed after the attention, are refused by name."""
from dataclasses import replace

import pytest
import torch

import torch_cubridge as tc
from helpers import to64
from torch_cubridge.capture.trace import bind_example
from torch_cubridge.errors import UnsupportedSpec
from torch_cubridge.ir.program import Program
from torch_cubridge.verify import cpu as vcpu


def lse_logsumexp(q, k, v):
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, dim=-1)


def lse_logprobs(q, k, v):  # exp(s - lse) is the softmax
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    lse = s.logsumexp(-1, keepdim=True)
    return torch.exp(s - lse) @ v, lse.squeeze(-1)


def lse_causal_bshd(q, k, v):  # einsum, a causal mask, float32 softmax, output [B, S, H, D], lse kept [B, H, S, 1]
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) / q.shape[-1] ** 0.5
    n = s.shape[-1]
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    p = torch.softmax(s.float(), -1).to(q.dtype)
    return (p @ v).transpose(1, 2), torch.logsumexp(s.float(), dim=-1, keepdim=True)


def lse_gqa_weights(q, k, v):  # (output, weights, lse): weights served as None, as ever
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    p = s.softmax(-1)
    return p @ v, p, s.logsumexp(-1)


SPECS = [lse_logsumexp, lse_logprobs, lse_causal_bshd]


def _inputs(spec, B=2, H=4, S=40, D=16):
    hkv = 2 if spec is lse_gqa_weights else H
    return torch.randn(B, H, S, D), torch.randn(B, hkv, S, D), torch.randn(B, hkv, S, D)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spec", SPECS + [lse_gqa_weights])
def test_the_log_sum_exp_is_returned_and_matches_fp64(spec, dtype):
    """bf16: `s.float()` written twice is two cast nodes, two equal values (found on the H100)."""
    args = tuple(x.to(dtype) for x in _inputs(spec))
    p = tc.transfer(spec, *args)
    assert p.out.lse_index == (2 if spec is lse_gqa_weights else 1)
    got, ref = p.run(*to64(args)), spec(*to64(args))
    assert len(got) == len(ref)
    for i, (g, r) in enumerate(zip(got, ref)):
        if spec is lse_gqa_weights and i == 1:
            assert g is None  # the weights
            continue
        assert g.shape == r.shape
        assert (g.double() - r.double()).abs().max() < 1e-5
    assert Program.from_json(p.to_json()) == p


@pytest.mark.parametrize("spec", SPECS)
def test_a_wrong_log_sum_exp_fails_verification(spec):
    args = _inputs(spec)
    p = tc.transfer(spec, *args)
    bound = bind_example(spec, args, {})
    assert vcpu.verify_program(spec, p, bound).ok
    dims = p.out.lse_dims
    i, j = dims.index("h"), dims.index("s")
    swapped = list(dims)
    swapped[i], swapped[j] = dims[j], dims[i]
    assert not vcpu.verify_program(spec, replace(p, out=replace(p.out, lse_dims=tuple(swapped))), bound).ok
    # a program whose rows' LSE would be of the scores without the scale
    assert not vcpu.verify_program(spec, replace(p, score=p.score.args[0] if p.score.op == "mul" else p.score), bound).ok \
        or p.score.op != "mul"


def test_log_sum_exp_of_other_scores_is_refused():
    def other(q, k, v):
        s = q @ k.transpose(-1, -2)
        return torch.softmax(s * 0.25, -1) @ v, torch.logsumexp(s, -1)
    with pytest.raises(UnsupportedSpec, match="log-sum-exp"):
        tc.transfer(other, *_inputs(other))


def test_log_sum_exp_beside_an_epilogue_is_refused():
    """Before this, the epilogue's tuple served None in the log-sum-exp's place: a wrong answer."""
    def projected(q, k, v):
        s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
        lse = torch.logsumexp(s, dim=-1)  # before the output: walked, so on the score path
        return (torch.softmax(s, -1) @ v) * 2.0, lse
    with pytest.raises(UnsupportedSpec, match="log-sum-exp"):
        tc.transfer(projected, *_inputs(projected))
