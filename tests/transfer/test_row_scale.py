"""Probabilities scaled or zeroed per query row after the softmax (Longformer zeroes padded queries'
rows; a per-row gate): (f P) V = f (P V), so the factor becomes the program's row scale, applied to
the output. A factor that varies along the keys is refused with that reason."""
import pytest
import torch

from helpers import rel_err
from torch_cubridge.capture.trace import bind_example
from torch_cubridge.errors import UnsupportedSpec
from torch_cubridge.ir.program import Program
from torch_cubridge.pipeline import transfer_stage


def zeroed_rows(q, k, v, pad):
    p = (q @ k.transpose(-1, -2) / 8).softmax(-1)
    return p.masked_fill(pad[:, None, :, None], 0.0) @ v


def gated_rows(q, k, v, gate):
    p = torch.softmax(q @ k.transpose(-1, -2) * 0.125, dim=-1, dtype=torch.float32).to(q.dtype)
    return (p * gate[..., None]) @ v


def kept_rows_where(q, k, v, keep):
    p = (q @ k.transpose(-1, -2) / 8).softmax(-1)
    return torch.where(keep[:, None, :, None], p, 0.0) @ v


def divided_rows(q, k, v, temp):
    p = (q @ k.transpose(-1, -2) / 8).softmax(-1)
    return (p / temp[None, :, None, None]) @ v


def zeroed_keys(q, k, v, pad):
    p = (q @ k.transpose(-1, -2) / 8).softmax(-1)
    return p.masked_fill(pad[:, None, None, :], 0.0) @ v


def _args(extra):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 40, 16, generator=g) for _ in range(3))
    return q, k, v, extra


@pytest.mark.parametrize("fn,extra", [
    (zeroed_rows, torch.rand(2, 40) < 0.3),
    (gated_rows, torch.rand(2, 3, 40) + 0.5),
    (kept_rows_where, torch.rand(2, 40) < 0.7),
    (divided_rows, torch.rand(3) + 0.5),
])
def test_a_row_factor_moves_to_the_output(fn, extra):
    args = _args(extra)
    p = transfer_stage(fn, bind_example(fn, args, {})).program
    assert p.row_scale is not None
    assert Program.from_json(p.to_json()) == p
    want = fn(*(a.double() if a.is_floating_point() else a for a in args))
    got = p.run(*(a.double() if a.is_floating_point() else a for a in args))
    assert rel_err(got, want) < 1e-6  # the model holds scores in float32, as the kernel does


def test_a_factor_along_the_keys_is_refused():
    args = _args(torch.rand(2, 40) < 0.3)
    with pytest.raises(UnsupportedSpec, match="along the key axis after the softmax"):
        transfer_stage(zeroed_keys, bind_example(zeroed_keys, args, {}))


def sink_per_query_column(q, k, v, sinks):
    """inkling2's eager attention: a sink logit projected from each token ([B, H, Sq, 1]), one more
    column of the softmax, dropped after it."""
    s = torch.matmul(q, k.transpose(2, 3)) * 0.25
    s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    p = torch.softmax(torch.cat([s, sinks], dim=-1).float(), dim=-1)[..., :-1].to(q.dtype)
    return torch.matmul(p, v)


def sink_per_query_sigmoid(q, k, v, c):
    """The same written as granite_swa writes a sink, with the logit varying over query rows ([B, Sq, H])."""
    s = q @ k.transpose(-1, -2) / 4
    o = s.softmax(-1) @ v
    return o * torch.sigmoid(torch.logsumexp(s, dim=-1, keepdim=True) - c.permute(0, 2, 1)[..., None])


@pytest.mark.parametrize("fn,extra", [(sink_per_query_column, torch.randn(2, 3, 40, 1) * 2),
                                      (sink_per_query_sigmoid, torch.randn(2, 40, 3) * 2)])
def test_a_sink_per_query_row_scales_the_output_by_the_rows_lse(fn, extra):
    """A sink c(b, h, q): sum e^x V / (sum e^x + e^c) = O * sigmoid(lse - c), the kernel's LSE read by
    the row scale; fully masked rows (the first causal rows have few keys) and x8 scores included."""
    args = _args(extra)
    res = transfer_stage(fn, bind_example(fn, args, {}))
    p = res.program
    assert p.sink is None and p.row_scale is not None and "lse" in str(p.row_scale)
    assert res.generic and Program.from_json(p.to_json()) == p
    want = fn(*(a.double() for a in args))
    assert rel_err(p.run(*(a.double() for a in args)), want) < 1e-6

