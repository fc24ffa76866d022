"""On a CUDA device: the pointwise-op specs (sin, cos, exp2, log2, log1p, expm1, reciprocal, sign,
nan_to_num) served by a kernel in bf16, against the spec in float64."""
import pytest
import torch

import torch_cubridge as tc
from helpers import rel_err, to64
from test_pointwise_ops import SPECS

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("fn", SPECS, ids=[f.__name__ for f in SPECS])
def test_pointwise_spec_served_by_kernel(fn, D):
    f = tc.compile(fn, fallback="raise")
    for S in (333, 200):  # a second length: the program is generic, the kernel the same
        args = tuple(torch.randn(2, 4, S, D, dtype=torch.bfloat16) for _ in range(3))
        out = f(*(a.cuda() for a in args))
        assert f.served["spec"] == 0, [e.reasons or e.reason for e in f.entries()]
        assert rel_err(out.float().cpu(), fn(*to64(args))) < 1e-2
    assert len(f.kernels()) == 1
