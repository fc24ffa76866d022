"""On a GPU, the specs the CPU fixes let through are served by the kernel, not the spec: GPT-2-style
-1e9 additive masks (judged in float32 where float64 resolves a filled row) and einsum decoding with
B = 1 (size-1 dims named by position)."""
import pytest
import torch

import torch_cubridge as tc
from helpers import rel_err
from test_unit_dims_transfer import einsum_repeat_interleave, einsum_style
from test_verify_float32_fills import gpt2_float

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_gpt2_style_minus_1e9_mask_is_kernel_served():
    B, H, S, Dh = 2, 4, 300, 64
    q, k, v = (torch.randn(B, H, S, Dh, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    keep = torch.ones(S, S, dtype=torch.bool, device="cuda").tril()
    keep[:2] = False  # fully masked rows: uniform in float32, like the kernel
    mask = torch.zeros(B, 1, S, S, device="cuda").masked_fill(~keep, -1e9).to(q.dtype)
    f = tc.compile(gpt2_float, fallback="raise")
    out = f(q, k, v, mask)
    assert f.served["kernel"] == 1 and f.served["spec"] == 0
    ref = gpt2_float(q.float(), k.float(), v.float(), mask.float())
    assert rel_err(out.float(), ref) < 2e-2
    assert rel_err(out[:, :, :2].float(), v.float().mean(2, keepdim=True).expand(-1, -1, 2, -1)) < 2e-2


@pytest.mark.parametrize("spec", [einsum_style, einsum_repeat_interleave])
def test_einsum_decode_with_batch_one_is_kernel_served(spec):
    H, Hkv = 8, (2 if spec is einsum_repeat_interleave else 8)
    q = torch.randn(1, H, 1, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, Hkv, 257, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    f = tc.compile(spec, fallback="raise")
    out = f(q, k, v)
    assert f.served["kernel"] == 1 and f.served["spec"] == 0
    assert rel_err(out.float(), spec(q.double(), k.double(), v.double())) < 2e-2
