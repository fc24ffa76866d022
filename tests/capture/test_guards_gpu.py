"""The wrong-answer probes of tests/capture/test_guards.py through real kernels on a CUDA device.

Every call must give the spec's answer (bf16 against float64) and, where a
kernel can serve it, be served by a kernel verified for it.
"""
import warnings

import pytest
import torch

import torch_cubridge as tc
from helpers import rel_err, to64
from test_guards import alibi_arange, alibi_from_heads, explicit_scale, nested_floordiv, softcap_attn, windowed_if_long

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def qkv(B=1, H=4, S=128, D=64):
    return tuple(torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))


def _check(f, spec, args, **kw):
    before = f.served["kernel"]
    out = f(*args, **kw)
    ref = spec(*to64(tuple(a.cpu() for a in args)), **kw)
    assert not torch.isnan(out).any()
    assert rel_err(out.float().cpu(), ref) < 2e-2
    assert f.served["kernel"] == before + 1, [e.reasons or e.reason for e in f.entries()]


@pytest.mark.parametrize("spec, calls", [
    (windowed_if_long, [dict(S=128), dict(S=600), dict(S=40), dict(S=300)]),
    (alibi_from_heads, [dict(H=4), dict(H=2), dict(H=4, S=77)]),
    (alibi_arange, [dict(H=4), dict(H=8)]),
    (softcap_attn, [dict(D=64), dict(D=128)]),
    (explicit_scale, [dict(D=64), dict(D=128), dict(D=96)]),
    (nested_floordiv, [dict(S=100), dict(S=333)]),
])
def test_every_call_is_the_specs_answer_from_a_kernel(spec, calls):
    f = tc.compile(spec, fallback="raise")
    for kw in calls:
        _check(f, spec, qkv(**kw))


def test_python_values_under_torch_compile_use_their_own_kernel():
    f = tc.compile(softcap_attn, fallback="raise")
    args = qkv()
    _check(f, softcap_attn, args, softcap=2.0)          # eager: builds the softcap=2 kernel
    ref50 = softcap_attn(*to64(tuple(a.cpu() for a in args)), softcap=50.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.compile(lambda q, k, v: f(q, k, v, softcap=50.0), fullgraph=True)
        out = traced(*args)                              # never the softcap=2 kernel
    assert rel_err(out.float().cpu(), ref50) < 2e-2
    _check(f, softcap_attn, args, softcap=50.0)          # eager builds softcap=50 ...
    torch._dynamo.reset()
    traced = torch.compile(lambda q, k, v: f(q, k, v, softcap=50.0), fullgraph=True)
    before = f.served["kernel"]
    out = traced(*args)                                  # ... which the traced call then uses
    assert rel_err(out.float().cpu(), ref50) < 2e-2
    assert f.served["kernel"] >= before  # the custom op runs outside the counter; the answer is what matters
