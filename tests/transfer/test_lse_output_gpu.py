"""On a CUDA device: a spec that returns the rows' log-sum-exp gets the kernel's own (prefill on the
Hopper and the FA2-class kernels, decode in one split and merged from several), in the spec's layout and
dtype, both outputs against float64; GPU verification refuses a kernel whose log-sum-exp is wrong."""
import pytest
import torch

import torch_cubridge as tc
from helpers import assert_rows_close, rel_err, to64
from test_lse_output import lse_causal_bshd, lse_gqa_weights, lse_logprobs, lse_logsumexp

pytestmark = pytest.mark.gpu


def _check(spec, args, kernel=None):
    f = tc.compile(spec, fallback="raise")
    got = f(*(a.cuda() for a in args))
    assert f.served["spec"] == 0, [e.reasons or e.reason for e in f.entries()]
    r = f.kernels()[-1]
    assert r._lse_out and not r.replayable
    if kernel is not None:
        assert r.low.tile.kernel == kernel
    ref = spec(*to64(args))
    for i, (g, x) in enumerate(zip(got, ref)):
        if x is None or (spec is lse_gqa_weights and i == 1):
            continue
        assert g.shape == x.shape and g.dtype == spec(*args)[i].dtype
        if i == 0:  # the attention output: every row within bf16's rounding of its own scale
            assert_rows_close(g, x, torch.bfloat16)
        else:
            assert rel_err(g.float().cpu(), x) < 1e-2, i
    return f


# lse_causal_bshd's causal mask is written for square calls: it runs at the square pair only
SHAPES = [(300, 300), (1, 900), (4, 5000)]
CASES = [(spec, sq, skv) for spec in (lse_logsumexp, lse_logprobs, lse_causal_bshd, lse_gqa_weights)
         for sq, skv in SHAPES if spec is not lse_causal_bshd or sq == skv]


@pytest.mark.parametrize("spec,Sq,Skv", CASES, ids=[f"{s.__name__}-{q}-{k}" for s, q, k in CASES])
def test_the_kernels_log_sum_exp_is_returned(spec, Sq, Skv):
    g = torch.Generator().manual_seed(0)
    hkv = 2 if spec is lse_gqa_weights else 4
    q = torch.randn(2, 4, Sq, 64, generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(2, hkv, Skv, 64, generator=g, dtype=torch.bfloat16) for _ in range(2))
    _check(spec, (q, k, v), "decode" if Sq < 16 else None)


def test_on_the_fa2_kernel(monkeypatch):
    """The sm_80-class kernel (the one an A100 runs) writes the log-sum-exp too."""
    monkeypatch.setenv("CUBRIDGE_KERNEL", "sm80")
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 4, 333, 64, generator=g, dtype=torch.bfloat16) for _ in range(3))
    f = _check(lse_logsumexp, (q, k, v))
    assert f.kernels()[-1].low.tile.kernel == "sm80"


def test_a_wrong_kernel_log_sum_exp_is_refused(monkeypatch):
    """GPU verification holds the returned log-sum-exp to the spec's: a runner that shifts it is refused
    and the spec serves."""
    from torch_cubridge.ops.runner import KernelRunner
    real = KernelRunner._result
    monkeypatch.setattr(KernelRunner, "_result",
                        lambda self, out, raw, lse=None: real(self, out, raw, None if lse is None else lse + 0.05))
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 4, 200, 64, generator=g, dtype=torch.bfloat16).cuda() for _ in range(3))
    f = tc.compile(lse_logsumexp, fallback="silent")
    out, lse = f(q, k, v)
    assert f.served["kernel"] == 0 and f.served["spec"] == 1
    ref = lse_logsumexp(q.double(), k.double(), v.double())[1]
    assert (lse.double() - ref).abs().max() < 0.05


@pytest.mark.parametrize("spec,Sq", [(lse_logsumexp, 1), (lse_logsumexp, 300), (lse_causal_bshd, 300)],
                         ids=["lse_logsumexp-1", "lse_logsumexp-300", "lse_causal_bshd-300"])
def test_torch_compile_returns_the_kernels_log_sum_exp(spec, Sq):
    """Under torch.compile(fullgraph=True) the kernel serves through the op that returns the log-sum-exp
    too (cubridge::attention_lse): both outputs equal the eager kernel's bit for bit (the traced spec's
    would differ in rounding), in the spec's layout and dtype. (lse_causal_bshd's mask is written for
    square calls.)"""
    import torch_cubridge.ops.custom_op  # noqa: F401  (registers the ops, for opcheck)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, Sq, 64, generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(2, 4, 300, 64, generator=g, dtype=torch.bfloat16) for _ in range(2))
    args = tuple(a.cuda() for a in (q, k, v))
    f = _check(spec, (q, k, v))
    eager = f(*args)
    runner = f.kernels()[-1]
    torch.library.opcheck(torch.ops.cubridge.attention_lse.default, (*args, [], [], runner.kernel_id))
    calls = []
    real = runner.op_forward
    runner.op_forward = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    try:
        got = torch.compile(lambda *a: f(*a), fullgraph=True)(*args)
    finally:
        del runner.op_forward
    assert calls, "the compiled graph did not call the kernel"
    for g_, e in zip(got, eager):
        assert g_.dtype == e.dtype and g_.shape == e.shape and torch.equal(g_, e)
