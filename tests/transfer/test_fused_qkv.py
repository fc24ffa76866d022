"""A fused qkv projection split the way ViTs write it ([B, N, 3*H*D] viewed [B, N, 3, H, D], permuted to
[3, B, H, N, D], q, k and v selected or unbound): the prologue makes each operand as a view of the one
projection, and the program matches the spec in float64 at other lengths."""
import pytest
import torch

import torch_cubridge as tc
from helpers import first, rel_err


class FusedQKV(torch.nn.Module):
    def __init__(self, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)


def vit_select(module, x):
    B, N, C = x.shape
    qkv = module.qkv(x).reshape(B, N, 3, module.heads, C // module.heads).permute(2, 0, 3, 1, 4)
    q, k, v = qkv[0], qkv[1], qkv[2]
    attn = (q @ k.transpose(-2, -1)) * (C // module.heads) ** -0.5
    return module.proj((attn.softmax(-1) @ v).transpose(1, 2).reshape(B, N, C))


def vit_unbind(module, x):
    B, N, C = x.shape
    q, k, v = module.qkv(x).reshape(B, N, 3, module.heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
    attn = (q * (C // module.heads) ** -0.5) @ k.transpose(-2, -1)
    return module.proj((attn.softmax(-1) @ v).transpose(1, 2).reshape(B, N, C))


@pytest.mark.parametrize("spec", [vit_select, vit_unbind])
def test_a_fused_qkv_split_by_select_or_unbind_transfers(spec):
    torch.manual_seed(0)
    mod = FusedQKV()
    p = tc.transfer(spec, mod, torch.randn(3, 10, 64))
    assert p.prologue  # the operands are views the prologue makes of the one projection
    with torch.no_grad():
        for n in (10, 37):
            x = torch.randn(3, n, 64)
            want = spec(mod.double(), x.double())
            got = first(p.run(mod.float(), x)).double()
            assert rel_err(got, want) < 1e-5, n
