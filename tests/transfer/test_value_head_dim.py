"""A value head dim other than the query's: transfer, verification and the interpreter."""
import torch

import torch_cubridge as tc
from helpers import rel_err


def value_dim_differs(q, k, v):
    S = q.shape[-2]
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    s = s.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    return s.softmax(-1) @ v


def test_value_head_dim_may_differ_from_the_query():
    """Dv != D transfers and verifies (the verifier drew K with Dv and the interpreter sized O with D)."""
    q, k = (torch.randn(2, 4, 70, 32, dtype=torch.float64) for _ in range(2))
    v = torch.randn(2, 4, 70, 16, dtype=torch.float64)
    p = tc.transfer(value_dim_differs, q, k, v)
    out = p.run(q, k, v)
    assert out.shape == (2, 4, 70, 16) and rel_err(out, value_dim_differs(q, k, v)) < 1e-6
