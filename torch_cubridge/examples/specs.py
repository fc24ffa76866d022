"""Attention variants written the way a researcher would; `cubridge explain` demos them.

Each spec has an `<name>_example()` giving example arguments (CPU tensors).
"""
import math

import torch


def softcap_sliding_gqa(q, k, v, softcap: float = 50.0, window: int = 64):
    """Gemma-2 style: GQA by expand, tanh softcap, causal sliding window."""
    B, Hq, S, D = q.shape
    rep = Hq // k.shape[1]
    k = k[:, :, None].expand(B, k.shape[1], rep, S, D).reshape(B, Hq, S, D)
    v = v[:, :, None].expand(B, v.shape[1], rep, S, D).reshape(B, Hq, S, D)
    scores = q @ k.transpose(-1, -2) / math.sqrt(D)
    scores = softcap * torch.tanh(scores / softcap)
    i = torch.arange(S, device=q.device)
    keep = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < window)
    scores = scores.masked_fill(~keep, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def softcap_sliding_gqa_example():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(2, 8, 200, 64, generator=g), torch.randn(2, 2, 200, 64, generator=g),
            torch.randn(2, 2, 200, 64, generator=g))


def alibi_causal(q, k, v):
    """ALiBi with constant slopes, causal, einsum style."""
    H, S = q.shape[1], q.shape[2]
    slopes = torch.tensor([2 ** (-8 * (h + 1) / H) for h in range(H)], device=q.device)
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * q.shape[-1] ** -0.5
    pos = torch.arange(S, device=q.device)
    s = s + slopes[:, None, None] * (pos[None, :] - pos[:, None])
    s = torch.where(pos[:, None] >= pos[None, :], s, torch.finfo(s.dtype).min)
    return torch.einsum("bhqk,bhkd->bhqd", s.softmax(-1), v)


def alibi_causal_example():
    return tuple(torch.randn(1, 4, 96, 64) for _ in range(3))


def document_mask(q, k, v, doc_ids):
    """Packed sequences: attend only within the same document, causally."""
    same = doc_ids[:, None, :, None] == doc_ids[:, None, None, :]
    causal = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=same & causal)


def document_mask_example():
    ids = torch.tensor([[0] * 40 + [1] * 50 + [2] * 38])
    return tuple(torch.randn(1, 4, 128, 64) for _ in range(3)) + (ids,)
