"""A compiled attention function called inside another compiled spec (a model's attention module whose own
forward is routed as a whole, and which itself calls the attention interface: inkling2) is traced through
by the outer capture: it runs its spec's ops on the fake tensors, captures nothing of its own, and leaves
no entry keyed by a fake call."""
import math
import warnings

import torch

import torch_cubridge as tc


def causal(q, k, v):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    n = q.shape[-2]
    keep = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    return s.masked_fill(~keep, float("-inf")).softmax(-1) @ v


inner = tc.compile(causal)


def projected(x, w):
    B, S, _ = x.shape
    q, k, v = (x @ w).view(B, S, 3, 2, 16).permute(2, 0, 3, 1, 4)
    return inner(q, k, v)


def test_an_inner_compiled_function_is_traced_through():
    outer = tc.compile(projected)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 40, 32, generator=g), torch.randn(32, 96, generator=g)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = outer(x, w)
    # the outer capture and verification ran the inner spec itself: at most the one call the outer spec
    # served here (no CUDA) reached the inner table, and nothing was refused
    assert len(inner.entries()) <= 1 and all(e.result is not None for e in inner.entries()), \
        [e.reason for e in inner.entries()]
    assert not [w for w in seen if "internal error" in str(w.message) or "serves calls" in str(w.message)], \
        [str(w.message) for w in seen]
    (e,) = outer.entries()
    assert e.result is not None, e.reason
    q, k, v = (x.double() @ w.double()).view(2, 40, 3, 2, 16).permute(2, 0, 3, 1, 4)
    ref = causal(q, k, v)
    assert float((out.double() - ref).norm() / ref.norm()) < 1e-5
    # called on its own, the inner function captures as usual
    before = inner.served["spec"] + inner.served["kernel"]
    inner(q.float(), k.float(), v.float())
    assert len(inner.entries()) >= 1 and inner.served["spec"] + inner.served["kernel"] == before + 1
