"""On a CUDA device: a row scale after the softmax (rows zeroed or gated) is applied to the kernel's
output by PyTorch, prefill and decode alike, every output against float64."""
import pytest
import torch

import torch_cubridge as tc
from helpers import assert_rows_close, to64
from test_row_scale import gated_rows, sink_per_query_column, sink_per_query_sigmoid, zeroed_rows

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("fn", [zeroed_rows, gated_rows])
@pytest.mark.parametrize("Sq,Skv", [(300, 300), (1, 900)])
def test_row_scale_on_the_kernel_output(fn, Sq, Skv):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, Sq, 64, generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(2, 4, Skv, 64, generator=g, dtype=torch.bfloat16) for _ in range(2))
    extra = torch.rand(2, Sq, generator=g) < 0.3 if fn is zeroed_rows else torch.rand(2, 4, Sq, generator=g) + 0.5
    args = (q, k, v, extra)
    f = tc.compile(fn, fallback="raise")
    out = f(*(a.cuda() for a in args))
    assert f.served["spec"] == 0, [e.reasons or e.reason for e in f.entries()]
    assert f.kernels()[-1].p.row_scale is not None
    assert_rows_close(out, fn(*to64(args)), torch.bfloat16)


# the column form's causal mask is written for square calls: it runs at the square pair only
SINKS = [(fn, sq, skv) for fn in (sink_per_query_column, sink_per_query_sigmoid)
         for sq, skv in ((300, 300), (1, 900), (4, 3000)) if fn is not sink_per_query_column or sq == skv]


@pytest.mark.parametrize("fn,Sq,Skv", SINKS, ids=[f"{f.__name__}-{q}-{k}" for f, q, k in SINKS])
def test_a_sink_per_query_row_reads_the_kernels_lse(fn, Sq, Skv):
    """The kernel writes each row's LSE (prefill, decode in one split and merged from several), and
    PyTorch scales the output by sigmoid(lse - c)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, Sq, 64, generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(2, 4, Skv, 64, generator=g, dtype=torch.bfloat16) for _ in range(2))
    c = torch.randn((2, 4, Sq, 1) if fn is sink_per_query_column else (2, Sq, 4), generator=g) * 2
    args = (q, k, v, c.to(torch.bfloat16) if fn is sink_per_query_column else c)
    f = tc.compile(fn, fallback="raise")
    out = f(*(a.cuda() for a in args))
    assert f.served["spec"] == 0, [e.reasons or e.reason for e in f.entries()]
    r = f.kernels()[-1]
    if Sq > 1:  # (one query row: the logit is one per batch and head, the kernel's own sink hook)
        assert r.p.sink is None and r.p.row_scale is not None and r._row_lse
    assert r.low.tile.kernel == ("decode" if Sq < 16 else r.low.tile.kernel)
    assert_rows_close(out, fn(*to64(args)), torch.bfloat16)
