"""Which decode runners the C Decoder may serve (KernelRunner.decodable), decided on the CPU from the program alone.

The first device run of the Decoder found it never used: decode programs hold B = 1 and Sq = 1 (unit dims
are in the call's signature), which the rule read as "sizes needed per call". These cases keep that from
coming back without a GPU; tests/test_decoder_gpu.py checks the launches themselves."""
import pytest
import torch

import torch_cubridge as tc
from torch_cubridge.lower import lower
from torch_cubridge.ops.runner import KernelRunner


def gqa_decode(q, k, v):
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    return (q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5).softmax(-1) @ v


def eager_style(module, query, key, value, attention_mask, scaling=None, dropout=0.0):
    """transformers' eager function: a module argument, keywords, (output in [B, S, H, D], weights)."""
    g = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(g, 1), value.repeat_interleave(g, 1)
    w = (query @ key.transpose(2, 3) * scaling).softmax(-1)
    return (w @ value).transpose(1, 2).contiguous(), w


def key_padding(q, k, v, pad):
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    return s.masked_fill(~pad[:, None, None, :], float("-inf")).softmax(-1) @ v


def _runner(fn, *args, **kwargs):
    p = tc.transfer(fn, *args, **kwargs)
    q = next(a for a in args if isinstance(a, torch.Tensor))
    low = lower(p, arch="sm_90a", head_dim=q.shape[-1], decode=True)
    return KernelRunner(p, low, None, q.shape[-1], {})


@pytest.mark.parametrize("B", [1, 2])
def test_plain_decode_programs_are_served_by_the_decoder(B):
    q, k, v = torch.randn(B, 8, 1, 64), torch.randn(B, 2, 300, 64), torch.randn(B, 2, 300, 64)
    r = _runner(gqa_decode, q, k, v)
    assert r.p.requires and r.decodable  # B = 1 and/or Sq = 1 held: the Decoder checks them itself


def test_the_drop_in_s_eager_function_is_served_by_the_decoder():
    q, k, v = torch.randn(1, 8, 1, 64), torch.randn(1, 2, 300, 64), torch.randn(1, 2, 300, 64)
    r = _runner(eager_style, torch.nn.Module(), q, k, v, None, scaling=0.125)
    assert r.p.out.tuple_len == 2 and r.decodable


def test_a_program_with_an_extra_tensor_takes_the_python_runner():
    q, k, v = torch.randn(1, 8, 1, 64), torch.randn(1, 8, 300, 64), torch.randn(1, 8, 300, 64)
    r = _runner(key_padding, q, k, v, torch.rand(1, 300) > 0.2)
    assert r.p.extras and not r.decodable
