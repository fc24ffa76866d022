"""Pointwise ops beyond the first zoo (sin, cos, exp2, log2, log1p, expm1, reciprocal, sign, nan_to_num): each
transfers, its program matches the spec in float64, and its CUDA lowering compiles."""
import math
import shutil

import pytest
import torch

import torch_cubridge as tc
from helpers import rel_err
from torch_cubridge.build import compile_cubin
from torch_cubridge.config import csrc_dir
from torch_cubridge.lower import lower


def _ij(q, k):
    i = torch.arange(q.shape[-2], device=q.device)[:, None]
    j = torch.arange(k.shape[-2], device=q.device)[None, :]
    return i, j


def cos_sin_bias(q, k, v):
    i, j = _ij(q, k)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = s + 0.5 * torch.cos((i - j).float() * 0.05) + 0.1 * torch.sin(i.float() * 0.01)
    return s.softmax(-1) @ v


def exp2_alibi(q, k, v):
    H = q.shape[1]
    slopes = torch.exp2(-8.0 * (torch.arange(H, device=q.device) + 1) / H)
    i, j = _ij(q, k)
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 - slopes[:, None, None] * (i - j).abs()
    return s.masked_fill(j > i, float("-inf")).softmax(-1) @ v


def log_distance(q, k, v):
    i, j = _ij(q, k)
    d = (i - j).abs().float()
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 - 0.3 * torch.log1p(d) + 0.05 * torch.log2(d + 2)
    return torch.softmax(s + 0.01 * torch.expm1(-d / 64), dim=-1) @ v


def sign_causal_reciprocal(q, k, v):
    i, j = _ij(q, k)
    s = q @ k.transpose(-1, -2) * torch.reciprocal(torch.tensor(float(q.shape[-1]))).sqrt()
    s = s * (1 + 0.1 * torch.reciprocal(1.0 + (i - j).abs().float()))
    return s.masked_fill(torch.sign(i - j) < 0, float("-inf")).softmax(-1) @ v


def nan_to_num_causal(q, k, v):
    """Differential attention's guard (unilm): NaN and infinities in the scores replaced before the mask."""
    i, j = _ij(q, k)
    s = torch.nan_to_num(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5)
    return (s + torch.zeros_like(s).masked_fill(j > i, float("-inf"))).softmax(-1) @ v


def nan_to_num_fills(q, k, v):
    """nan_to_num with its fills given, positionally and by keyword; the -inf mask becomes a finite fill."""
    i, j = _ij(q, k)
    s = (q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5).masked_fill(j > i + 3, float("-inf"))
    return torch.nan_to_num(s, 0.0, posinf=1e4, neginf=-3.0).softmax(-1) @ v


SPECS = [cos_sin_bias, exp2_alibi, log_distance, sign_causal_reciprocal, nan_to_num_causal, nan_to_num_fills]


@pytest.mark.parametrize("fn", SPECS, ids=[f.__name__ for f in SPECS])
def test_transfers_and_matches_in_float64(fn):
    args = tuple(torch.randn(2, 4, 70, 32, dtype=torch.float64) for _ in range(3))
    p = tc.transfer(fn, *args)
    assert rel_err(p.run(*args), fn(*args)) < 1e-6
    args2 = tuple(torch.randn(1, 4, 133, 32, dtype=torch.float64) for _ in range(3))  # other sizes
    assert rel_err(p.run(*args2), fn(*args2)) < 1e-6


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("fn", SPECS, ids=[f.__name__ for f in SPECS])
def test_lowering_compiles(fn):
    p = tc.transfer(fn, *(torch.randn(2, 4, 70, 64) for _ in range(3)))
    for arch in ("sm_80", "sm_90a"):
        assert compile_cubin(lower(p, arch=arch, head_dim=64).source, arch, include_dirs=[csrc_dir()])


@pytest.mark.parametrize("op", ["sin", "cos", "exp2", "log2", "log1p", "expm1", "reciprocal", "sign"])
def test_interval_rules_contain_every_value(op):
    """Block classification is only sound if each op's interval holds every value it can take."""
    from torch_cubridge.ir.expr import Expr, var
    from torch_cubridge.ir.interval import interval
    e = Expr(op, (var("q"),))
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        lo, hi = sorted((torch.rand(2, generator=g) * 40 - 20).tolist())
        if op in ("log2", "log1p"):
            lo, hi = abs(lo) + (1e-3 if op == "log2" else 0.0), abs(lo) + abs(hi) + 1e-2
        x = torch.linspace(lo, hi, 101, dtype=torch.float64)
        got = {"sin": torch.sin, "cos": torch.cos, "exp2": torch.exp2, "log2": torch.log2, "log1p": torch.log1p,
               "expm1": torch.expm1, "reciprocal": torch.reciprocal, "sign": torch.sign}[op](x)
        a, b = interval(e, {"q": (lo, hi)})
        assert a <= got.min().item() + 1e-9 and got.max().item() <= b + 1e-9, (op, lo, hi, a, b)

