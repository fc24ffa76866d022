"""The benchmark variants, each three ways: the PyTorch spec we compile, the
same thing for FlexAttention, and the mask as a function of indices (to count
unmasked pairs exactly)."""
from __future__ import annotations

import math

import torch


def _scores(q, k):
    return q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])


def _causal(S, dev):
    i = torch.arange(S, device=dev)
    return i[:, None] >= i[None, :]


def full(q, k, v):
    return torch.softmax(_scores(q, k), -1) @ v


def causal(q, k, v):
    s = _scores(q, k).masked_fill(~_causal(q.shape[-2], q.device), float("-inf"))
    return torch.softmax(s, -1) @ v


def sliding_1024(q, k, v):
    i = torch.arange(q.shape[-2], device=q.device)
    keep = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < 1024)
    return torch.softmax(_scores(q, k).masked_fill(~keep, float("-inf")), -1) @ v


def softcap_causal(q, k, v):
    s = 50.0 * torch.tanh(_scores(q, k) / 50.0)
    return torch.softmax(s.masked_fill(~_causal(q.shape[-2], q.device), float("-inf")), -1) @ v


def softcap_full(q, k, v):
    return torch.softmax(50.0 * torch.tanh(_scores(q, k) / 50.0), -1) @ v


def alibi_causal(q, k, v):
    H, S = q.shape[1], q.shape[2]
    slopes = torch.tensor([2 ** (-8 * (h + 1) / H) for h in range(H)], device=q.device)
    i = torch.arange(S, device=q.device)
    s = _scores(q, k) + (slopes[:, None, None] * (i[None, :] - i[:, None])).to(q.dtype)
    return torch.softmax(s.masked_fill(~_causal(S, q.device), float("-inf")), -1) @ v


def prefix_1024(q, k, v):
    i = torch.arange(q.shape[-2], device=q.device)
    keep = (i[None, :] < 1024) | (i[:, None] >= i[None, :])
    return torch.softmax(_scores(q, k).masked_fill(~keep, float("-inf")), -1) @ v


def document(q, k, v, doc):
    keep = (doc[:, None, :, None] == doc[:, None, None, :]) & _causal(q.shape[-2], q.device)
    return torch.softmax(_scores(q, k).masked_fill(~keep, float("-inf")), -1) @ v


def gqa_causal(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def relbias_causal(q, k, v, rel):
    """A learnable relative-position bias: rel [H, 2S - 1], one value per head and distance (Swin, T5 unbucketed)."""
    S = q.shape[-2]
    i = torch.arange(S, device=q.device)
    s = _scores(q, k) + rel[:, i[None, :] - i[:, None] + S - 1].to(q.dtype)
    return torch.softmax(s.masked_fill(~_causal(S, q.device), float("-inf")), -1) @ v


def relative_table(H, S, dev):
    """relbias_causal's table, learnable: small values, the same every run."""
    g = torch.Generator().manual_seed(H * S)
    return (0.1 * torch.randn(H, 2 * S - 1, generator=g)).to(dev).requires_grad_()


def document_ids(B, S, dev):
    """[B, S] document ids: 64 documents of S/8 to S/2 tokens, cut at S; the same documents every run."""
    lens = torch.randint(S // 8, S // 2, (64,), generator=torch.Generator().manual_seed(S))
    ids = torch.repeat_interleave(torch.arange(64), lens)[:S]
    return ids[None].expand(B, S).contiguous().to(dev)


def flex_mods(name, H, S, dev, doc=None, rel=None):
    """(score_mod, mask_mod) for FlexAttention (rel: relbias_causal's table, a captured buffer it differentiates)."""
    causal_m = lambda b, h, qi, ki: qi >= ki
    if name in ("full", "softcap_full"):
        mask = None
    elif name == "sliding_1024":
        mask = lambda b, h, qi, ki: (qi >= ki) & (qi - ki < 1024)
    elif name == "prefix_1024":
        mask = lambda b, h, qi, ki: (ki < 1024) | (qi >= ki)
    elif name == "document":
        mask = lambda b, h, qi, ki: (doc[b, qi] == doc[b, ki]) & (qi >= ki)
    else:
        mask = causal_m
    score = None
    if name.startswith("softcap"):
        score = lambda s, b, h, qi, ki: 50.0 * torch.tanh(s / 50.0)
    elif name == "alibi_causal":
        slopes = torch.tensor([2 ** (-8 * (h + 1) / H) for h in range(H)], device=dev)
        score = lambda s, b, h, qi, ki: s + slopes[h] * (ki - qi)
    elif name == "relbias_causal":
        score = lambda s, b, h, qi, ki: s + rel[h, ki - qi + S - 1]
    return score, mask


def pair_count(name, B, S, dev, doc=None) -> int:
    """Unmasked (query, key) pairs summed over the batch, counted exactly."""
    total = 0
    i = torch.arange(S, device=dev)
    for q0 in range(0, S, 2048):
        qi = i[q0:q0 + 2048, None]
        ki = i[None, :]
        if name in ("full", "softcap_full"):
            keep = torch.ones(qi.shape[0], S, dtype=torch.bool, device=dev)
        elif name == "sliding_1024":
            keep = (qi >= ki) & (qi - ki < 1024)
        elif name == "prefix_1024":
            keep = (ki < 1024) | (qi >= ki)
        elif name == "document":
            keep = (doc[:, q0:q0 + 2048, None] == doc[:, None, :]) & (qi >= ki)
            total += int(keep.sum())
            continue
        else:
            keep = qi >= ki
        total += int(keep.sum()) * B
    return total


SPECS = {"full": full, "causal": causal, "sliding_1024": sliding_1024, "softcap_causal": softcap_causal,
         "softcap_full": softcap_full, "alibi_causal": alibi_causal, "prefix_1024": prefix_1024,
         "document": document, "gqa_causal": gqa_causal, "relbias_causal": relbias_causal}
