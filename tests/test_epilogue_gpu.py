"""On a CUDA device: specs with ops after the attention output (and projections before it) served by
the kernel, the epilogue run by PyTorch on its output, against float64."""
import pytest
import torch

import epilogue_specs as es
import torch_cubridge as tc
from helpers import rel_err

pytestmark = pytest.mark.gpu


def _serve(fn, args):
    f = tc.compile(fn, fallback="raise")
    cuda = tuple(a.cuda() if isinstance(a, (torch.Tensor, torch.nn.Module)) else a for a in args)
    with torch.no_grad():
        out = f(*cuda)
    assert f.served["spec"] == 0, [e.reasons or e.reason for e in f.entries()]
    with torch.no_grad():
        ref = fn(*(a.cpu().double() if isinstance(a, (torch.Tensor, torch.nn.Module)) else a for a in cuda))
    assert rel_err(out.float().cpu(), ref) < 1e-2
    return f


@pytest.mark.parametrize("S", [333, 1])
def test_merged_and_projected(S):
    w = es.weights(64 * 2, 1, torch.bfloat16)[0]
    _serve(es.merged_and_projected, es.qkv(2, 2, S, 64, torch.bfloat16) + (w,))


def test_gate_and_scale_shift():
    args = es.qkv(2, 4, 200, 64, torch.bfloat16)
    _serve(es.gated_output, args + (torch.randn(2, 4, 200, 64, dtype=torch.bfloat16),))
    _serve(es.scale_shift, args)


def test_nanogpt_attention_module_in_bf16():
    torch.manual_seed(0)
    m = es.CausalSelfAttention(256, 4).to(torch.bfloat16)
    f = _serve(es.nanogpt_forward, (m, es.hidden(2, 300, 256, torch.bfloat16)))
    _serve(es.nanogpt_forward, (m, es.hidden(2, 77, 256, torch.bfloat16)))  # a new compile, same spec
    assert f.kernels()[-1].p.epilogue
