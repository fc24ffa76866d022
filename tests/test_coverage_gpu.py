"""On a CUDA device: specs whose off-score values PyTorch computes (the prologue), and layouts beyond
[B, H, S, D] (rank-3 keys shared by all heads), served by the kernel and checked against the spec in
float64."""
import pytest
import torch

import torch_cubridge as tc
from helpers import first, rel_err, to64
from zoo import LAYOUTS, PROLOGUE

pytestmark = pytest.mark.gpu


def _cuda(args):
    return tuple(a.cuda() if isinstance(a, (torch.Tensor, torch.nn.Module)) else a for a in args)


def _cpu64(args):
    return to64(tuple(a.cpu() if isinstance(a, (torch.Tensor, torch.nn.Module)) else a for a in args))


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("case", PROLOGUE + LAYOUTS, ids=[c.name for c in PROLOGUE + LAYOUTS])
def test_served_by_kernel(case, D):
    f = tc.compile(case.fn, fallback="raise")
    for seed in (0, 1):  # the second call: new values, the same kernel, the prologue run again
        torch.manual_seed(seed)
        args = _cuda(case.make(2, 4, 2, 333, D, torch.bfloat16))
        with torch.no_grad():
            out = first(f(*args))
        assert f.served["spec"] == 0 and f.served["kernel"] == seed + 1, [e.reasons or e.reason for e in f.entries()]
        ref = first(case.fn(*_cpu64(args)))
        assert rel_err(out.float().cpu(), ref) < 1e-2


@pytest.mark.parametrize("new", [1, 4])
def test_growing_cache_concatenated_in_the_spec_is_one_program(new):
    """A decode loop whose spec concatenates its KV cache with the new keys: every step is served by
    the decode kernel under one program (its length tied to the cache's), none captured again."""
    from zoo import kv_cache_concat
    f = tc.compile(kv_cache_concat, fallback="raise")
    B, H, D = 2, 8, 128
    for step, cached in enumerate((1500, 1501, 1502, 2047, 3001)):
        torch.manual_seed(step)
        args = tuple(torch.randn(B, H, n, D, device="cuda", dtype=torch.bfloat16)
                     for n in (new, new, new, cached, cached))
        with torch.no_grad():
            out = f(*args)
        assert f.served["spec"] == 0 and f.served["kernel"] == step + 1, [e.reasons or e.reason for e in f.entries()]
        assert rel_err(out.float().cpu(), kv_cache_concat(*_cpu64(args))) < 1e-2
    assert len(f.entries()) == 1, [e.reason for e in f.entries()]
