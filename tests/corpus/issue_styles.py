"""Corpus: specs whose styles once broke the transfer or its verification: a learnable logit scale clamped by a
tensor (Swin Transformer V2), masks made by arithmetic on bools (neighbourhood and block masks counted as
integers), and a relative-position bias from a small MLP module over the distances (x-transformers'
DynamicPositionBias). Each docstring says where from; each is rewritten by hand as plain dense PyTorch."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from zoo import Case, qkv   # tests/support/zoo.py is on sys.path when tests run


# ---- cosine attention with a learnable, clamped logit scale -----------------------------------------------------
class SwinV2Scale(nn.Module):
    """Swin Transformer V2: models/swin_transformer_v2.py WindowAttention's logit_scale, log(10) per head."""

    def __init__(self, heads: int) -> None:
        super().__init__()
        self.logit_scale = nn.Parameter(torch.log(10 * torch.ones((heads, 1, 1))) + 0.3 * torch.randn(heads, 1, 1))


def swinv2_cosine_tensor_max(module, q, k, v):
    """Swin V2 WindowAttention.forward: cosine similarity times exp(clamp(logit_scale, max=log(1/0.01))), the
    bound a tensor on the parameter's device, as the official code writes it."""
    attn = (F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1))
    logit_scale = torch.clamp(module.logit_scale,
                              max=torch.log(torch.tensor(1. / 0.01)).to(module.logit_scale.device)).exp()
    attn = attn * logit_scale
    attn = attn.softmax(dim=-1)
    return attn @ v


def swinv2_cosine_float_max(module, q, k, v):
    """Swin V2 as timm writes it: the clamp's bound a Python float (math.log(1. / 0.01))."""
    attn = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
    logit_scale = torch.clamp(module.logit_scale, max=math.log(1. / 0.01)).exp()
    return torch.softmax(attn * logit_scale, dim=-1) @ v


def swinv2_cosine_clamp_min_max(q, k, v, logit_scale):
    """Swin V2 with the scale passed in and clamped on both sides by tensors (clamp.Tensor with min and max)."""
    attn = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
    lo, hi = torch.zeros((), device=q.device), torch.tensor(math.log(100.0), device=q.device)
    return torch.softmax(attn * torch.clamp(logit_scale, min=lo, max=hi).exp(), dim=-1) @ v


# ---- masks from arithmetic on bools ------------------------------------------------------------------------------
NEIGHBOURHOOD = 6
BLOCK = 8


def natten_neighbourhood_bool_minus(q, k, v):
    """A neighbourhood mask written with bools made integers: two causal tests subtracted (1 inside the band,
    0 outside), as NATTEN-style reference code counts window membership."""
    S = q.shape[-2]
    i = torch.arange(S, device=q.device)
    causal = i[:, None] >= i[None, :]
    too_far = (i[:, None] - i[None, :]) >= NEIGHBOURHOOD
    keep = causal.int() - too_far.int()
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return s.masked_fill(keep == 0, float("-inf")).softmax(-1) @ v


def block_parity_abs_diff(q, k, v):
    """Block-sparse mask from bool-derived block parities: (a - b).abs() <= 0 keeps a query with the keys of
    its parity, plus the causal diagonal band."""
    S = q.shape[-2]
    i = torch.arange(S, device=q.device)
    odd = ((i // BLOCK) % 2).bool()
    a, b = odd.long()[:, None], odd.long()[None, :]
    keep = ((a - b).abs() <= 0) | ((i[:, None] - i[None, :]).abs() <= 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return torch.softmax(s.masked_fill(~keep, torch.finfo(s.dtype).min), dim=-1) @ v


def counted_masks(q, k, v):
    """Two masks counted as integers (both must hold: the count is 2), and a bool sum (+ of bools is or)."""
    S = q.shape[-2]
    i = torch.arange(S, device=q.device)
    causal = i[:, None] >= i[None, :]
    local = (i[:, None] - i[None, :]) < 2 * NEIGHBOURHOOD
    sink = (i[None, :] < 2) + (i[None, :] == i[:, None])
    keep = ((causal.to(torch.int32) + local.to(torch.int32)) >= 2) | (sink & causal)
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return s.masked_fill(~keep, float("-inf")).softmax(-1) @ v


def morton_neighbourhood(q, k, v):
    """Tokens on a 2-D grid in Morton (Z) order: row and column from the code's bits by integer division,
    neighbours within one cell, the per-axis test a product of bools made integers."""
    S = q.shape[-2]
    i = torch.arange(S, device=q.device)
    col = (i % 2) + 2 * ((i // 4) % 2) + 4 * ((i // 16) % 2)
    row = ((i // 2) % 2) + 2 * ((i // 8) % 2) + 4 * ((i // 32) % 2)
    near_r = ((row[:, None] - row[None, :]).abs() <= 1).long()
    near_c = ((col[:, None] - col[None, :]).abs() <= 1).long()
    keep = near_r * near_c
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return s.masked_fill(keep == 0, float("-inf")).softmax(-1) @ v


# ---- a relative-position bias from an MLP over the distances -----------------------------------------------------
class DynamicPositionBias(nn.Module):
    """x-transformers: x_transformers.py DynamicPositionBias (Linear(1, dim), SiLU, ..., Linear(dim, heads)) over
    the 2n - 1 distances, gathered at i - j + n - 1; einx/einops rewritten as indexing."""

    def __init__(self, dim: int, heads: int, depth: int = 2, log_distance: bool = False) -> None:
        super().__init__()
        self.log_distance = log_distance
        self.mlp = nn.ModuleList([nn.Sequential(nn.Linear(1, dim), nn.SiLU())])
        for _ in range(depth - 1):
            self.mlp.append(nn.Sequential(nn.Linear(dim, dim), nn.SiLU()))
        self.mlp.append(nn.Linear(dim, heads))

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def forward(self, i, j):
        n, device = j, self.device
        seq_arange = torch.arange(n, device=device)
        context_arange = torch.arange(n, device=device)
        indices = seq_arange[:, None] - context_arange[None, :]
        indices += (n - 1)
        pos = torch.arange(-n + 1, n, device=device).float()
        pos = pos[..., None]
        if self.log_distance:
            pos = torch.sign(pos) * torch.log(pos.abs() + 1)
        for layer in self.mlp:
            pos = layer(pos)
        bias = pos[indices]
        return bias.permute(2, 0, 1)


def xtransformers_dynamic_pos_bias(rel_pos, q, k, v):
    """x-transformers Attention with rel_pos = DynamicPositionBias: sim + rel_pos(i, j), causal, softmax."""
    scale = q.shape[-1] ** -0.5
    sim = torch.einsum("b h i d, b h j d -> b h i j", q, k) * scale
    i, j = sim.shape[-2:]
    sim = sim + rel_pos(i, j)
    causal_mask = torch.ones((i, j), device=q.device, dtype=torch.bool).triu(j - i + 1)
    sim = sim.masked_fill(causal_mask, -torch.finfo(sim.dtype).max)
    attn = sim.softmax(dim=-1)
    return torch.einsum("b h i j, b h j d -> b h i d", attn, v)


# ---- cases ------------------------------------------------------------------------------------------------------
def _std(B, H, Hkv, S, D, dt):
    return qkv(B, H, H, S, S, D, dt)


def _with_scale_module(B, H, Hkv, S, D, dt):
    return (SwinV2Scale(H).to(dt),) + _std(B, H, Hkv, S, D, dt)


def _with_scale_tensor(B, H, Hkv, S, D, dt):
    return _std(B, H, Hkv, S, D, dt) + (torch.rand(H, 1, 1, dtype=dt) * 6 - 1,)


def _with_dpb(log_distance):
    def make(B, H, Hkv, S, D, dt):
        return (DynamicPositionBias(16, H, log_distance=log_distance),) + _std(B, H, Hkv, S, D, dt)
    return make


CASES: list[Case] = [
    Case("issue_swinv2_cosine_tensor_max", swinv2_cosine_tensor_max, _with_scale_module),
    Case("issue_swinv2_cosine_float_max", swinv2_cosine_float_max, _with_scale_module),
    Case("issue_swinv2_cosine_clamp_min_max", swinv2_cosine_clamp_min_max, _with_scale_tensor),
    Case("issue_natten_neighbourhood_bool_minus", natten_neighbourhood_bool_minus, _std),
    Case("issue_block_parity_abs_diff", block_parity_abs_diff, _std),
    Case("issue_counted_masks", counted_masks, _std),
    Case("issue_morton_neighbourhood", morton_neighbourhood, _std),
    Case("issue_xtransformers_dynamic_pos_bias", xtransformers_dynamic_pos_bias, _with_dpb(False)),
    Case("issue_xtransformers_dynamic_pos_bias_log", xtransformers_dynamic_pos_bias, _with_dpb(True)),
]
