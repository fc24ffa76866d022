"""The NaN found on an H100: finfo.min sliding-window masks where a row's first visited tiles are all fill."""
import importlib

import pytest
import torch

import torch_cubridge as tc
from helpers import rel_err, to64
from test_numerics import additive_mask_attention, window_mask

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("S, W, fill", [(512, 40, torch.finfo(torch.bfloat16).min),
                                        (512, 40, torch.finfo(torch.float32).min), (512, 40, -1e9),
                                        (8192, 4096, torch.finfo(torch.bfloat16).min)])
def test_windowed_finite_fill_is_never_nan(S, W, fill):
    f = tc.compile(additive_mask_attention, fallback="raise")
    args = tuple(torch.randn(1, 2, S, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    mask = window_mask(S, W, fill).to("cuda", torch.bfloat16)
    out = f(*args, mask)
    assert f.served["kernel"] == 1 and f.served["spec"] == 0
    assert not torch.isnan(out).any()
    ref = additive_mask_attention(*to64(tuple(a.cpu() for a in args) + (mask.cpu(),)))
    assert rel_err(out.float().cpu(), ref) < 2e-2


def test_mistral_window_mask_through_kernel():
    from test_transformers import FakeAttention
    fn = importlib.import_module("transformers.models.mistral.modeling_mistral").eager_attention_forward
    B, H, Hkv, S, D, W = 2, 8, 2, 600, 64, 40
    mod = FakeAttention(H // Hkv, D, H, sinks=False).cuda()
    f = tc.compile(fn, fallback="raise")
    q = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, Hkv, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    mask = window_mask(S, W, torch.finfo(torch.bfloat16).min).expand(B, 1, S, S).to("cuda", torch.bfloat16)
    with torch.no_grad():
        out, _ = f(mod, q, k, v, mask, scaling=D ** -0.5)
    assert not torch.isnan(out).any() and f.served["spec"] == 0
    ref, _ = fn(mod.double().cpu(), *to64((q.cpu(), k.cpu(), v.cpu(), mask.cpu())), scaling=D ** -0.5)
    assert rel_err(out.float().cpu(), ref) < 2e-2
