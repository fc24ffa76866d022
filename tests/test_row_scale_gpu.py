"""On a CUDA device: a row scale after the softmax (rows zeroed or gated) is applied to the kernel's
output by PyTorch, prefill and decode alike, every output against float64."""
import pytest
import torch

import torch_cubridge as tc
from helpers import rel_err, to64
from test_row_scale import gated_rows, zeroed_rows

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
    assert rel_err(out.float().cpu(), fn(*to64(args))) < 1e-2
