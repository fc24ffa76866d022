"""One query token against a longer KV cache (decoding), in several writing styles.

make_fx views a [B, H, 1, D] query as [B*H, 1, D]; the size-1 query axis must stay an axis of its
own (it was folded away, refusing every decode step). Programs stay generic in the cache length.
"""
import importlib

import pytest
import torch
import torch.nn.functional as F

import torch_cubridge as tc
from helpers import rel_err, to64
from test_transformers import FakeAttention


def matmul_style(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, -1) @ v


def einsum_style(q, k, v):
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) / q.shape[-1] ** 0.5
    return torch.einsum("bhqk,bhkd->bhqd", s.softmax(-1), v)


def sdpa_style(q, k, v):
    return F.scaled_dot_product_attention(q, k, v)


@pytest.mark.parametrize("Sq", [1, 3])
@pytest.mark.parametrize("spec", [matmul_style, einsum_style, sdpa_style])
def test_decode_styles_transfer_and_stay_generic_in_the_cache(spec, Sq):
    mk = lambda S: (torch.randn(2, 4, Sq, 16), torch.randn(2, 4, S, 16), torch.randn(2, 4, S, 16))
    p = tc.transfer(spec, *mk(37))
    for S in (37, 50, 129):
        args = mk(S)
        assert rel_err(p.run(*args), spec(*to64(args))) < 1e-6


@pytest.mark.parametrize("model", ["llama", "gemma2", "gpt_oss"])
def test_transformers_decode_step(model):
    fn = importlib.import_module(f"transformers.models.{model}.modeling_{model}").eager_attention_forward
    B, H, Hkv, D = 2, 4, 2, 16
    mod = FakeAttention(H // Hkv, D, H, sinks=model == "gpt_oss")
    kw = {"scaling": D ** -0.5}
    mk = lambda S: (torch.randn(B, H, 1, D), torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D),
                    torch.zeros(B, 1, 1, S).masked_fill(torch.rand(B, 1, 1, S) < 0.2, torch.finfo(torch.float32).min))
    p = tc.transfer(fn, mod, *mk(30), **kw)
    for S in (30, 31, 64):
        args = mk(S)
        got = p.run(mod, *args, **kw)[0]
        ref = fn(mod.double(), *to64(args), **kw)[0]
        assert rel_err(got, ref) < 1e-6
