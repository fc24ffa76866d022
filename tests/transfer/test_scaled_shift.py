"""A softmax over (x - rowmax(x)) * c, c a positive constant (CogView's overflow guard, as LayoutLMv3 writes
it: scores / a, shifted by their row max, times a) is softmax(c * x): the shift is constant along the row.
A c that is not positive is refused, since the spec's exp may overflow where the kernel's shift does not."""
import pytest
import torch

import torch_cubridge as tc
from helpers import first, rel_err
from torch_cubridge.errors import UnsupportedSpec


def cogview(q, k, v):
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    a = s / 32
    return torch.softmax((a - a.amax(dim=-1).unsqueeze(-1)) * 32, dim=-1) @ v


def cogview_by_hand(q, k, v, mask):
    s = (q @ k.transpose(-1, -2) + mask) * 0.25
    a = s / 8
    e = ((a - a.amax(dim=-1, keepdim=True)) * 8).exp()
    return (e / e.sum(-1, keepdim=True)) @ v


def negative(q, k, v):
    s = q @ k.transpose(-1, -2)
    return torch.softmax((s - s.amax(dim=-1, keepdim=True)) * -0.5, dim=-1) @ v


def _qkv(S=24):
    return tuple(torch.randn(2, 4, S, 32) for _ in range(3))


def test_a_scaled_shift_is_the_softmax_of_the_scaled_scores():
    torch.manual_seed(0)
    p = tc.transfer(cogview, *_qkv())
    torch.manual_seed(1)
    args = _qkv(40)
    got = first(p.run(*args)).double()
    assert rel_err(got, cogview(*(a.double() for a in args))) < 1e-5


def test_written_out_by_hand_with_a_mask():
    torch.manual_seed(0)
    q, k, v = _qkv()
    mask = torch.zeros(2, 1, 24, 24).masked_fill(torch.rand(2, 1, 24, 24) < 0.3, -1e4)
    p = tc.transfer(cogview_by_hand, q, k, v, mask)
    want = cogview_by_hand(q.double(), k.double(), v.double(), mask.double())
    assert rel_err(first(p.run(q, k, v, mask)).double(), want) < 1e-5


def test_a_shift_scaled_by_a_negative_number_is_refused():
    with pytest.raises(UnsupportedSpec, match="shifted"):
        tc.transfer(negative, *_qkv())
