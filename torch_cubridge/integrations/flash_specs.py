"""The flash-attention API's calls as plain PyTorch specs, what each call means (integrations/flash_api.py
compiles them): softmax(capped q k^T * scale) v over keys kept by flash's rules, aligned bottom-right."""
from __future__ import annotations

import torch


def _scores_to_output(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, scale: float,
                      softcap: float, sinks: torch.Tensor | None) -> torch.Tensor:
    """softmax(capped q k^T * scale where keep) v over [B, H, Sq, D] queries and [B, Hkv, Skv, D] keys."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    s = (q @ k.transpose(-1, -2)) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~keep, float("-inf"))
    if sinks is not None:  # a learned logit per head that takes probability mass and no value
        col = sinks.to(s.dtype).view(1, -1, 1, 1).expand(s.shape[0], -1, s.shape[2], 1)
        p = torch.softmax(torch.cat([s, col], dim=-1), dim=-1, dtype=torch.float32)[..., :-1]
    else:
        p = torch.softmax(s, dim=-1, dtype=torch.float32)
    return p.to(v.dtype) @ v


def _window_keep(qpos: torch.Tensor, kpos: torch.Tensor, causal: bool, left: int, right: int) -> torch.Tensor:
    """Flash's mask from positions aligned bottom-right: key j is kept for query i where
    i - left <= j <= i + right (either side unbounded where negative), and j <= i where causal."""
    d = kpos[..., None, :] - qpos[..., :, None]
    keep = torch.ones_like(d, dtype=torch.bool)
    if causal:
        keep = keep & (d <= 0)
    if left >= 0:
        keep = keep & (d >= -left)
    if right >= 0 and not causal:
        keep = keep & (d <= right)
    return keep


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool, left: int,
                    right: int, softcap: float, sinks: torch.Tensor | None) -> torch.Tensor:
    """q [B, Sq, H, D], k and v [B, Skv, Hkv, D] -> [B, Sq, H, D]; query i sits at key Skv - Sq + i."""
    Sq, Skv = q.shape[1], k.shape[1]
    qpos = torch.arange(Sq, device=q.device) + (Skv - Sq)
    kpos = torch.arange(Skv, device=q.device)
    keep = _window_keep(qpos, kpos, causal, left, right)
    out = _scores_to_output(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), keep, scale, softcap, sinks)
    return out.transpose(1, 2)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, scale: float, causal: bool, left: int, right: int,
                     softcap: float, sinks: torch.Tensor | None) -> torch.Tensor:
    """Packed sequences: q [Tq, H, D], k and v [Tk, Hkv, D]; sequence s holds queries cu_seqlens_q[s] up to
    cu_seqlens_q[s + 1] and keys likewise, its queries aligned to its last keys. Tokens past the last
    sequence (padding) attend to every key, so their rows stay finite; nobody reads them."""
    Tq, Tk = q.shape[0], k.shape[0]
    n = cu_seqlens_q.shape[0] - 1
    iq = torch.arange(Tq, device=q.device)
    ik = torch.arange(Tk, device=q.device)
    sq = torch.searchsorted(cu_seqlens_q[1:], iq, right=True)  # the sequence of each token; n past the last
    sk = torch.searchsorted(cu_seqlens_k[1:], ik, right=True)
    end_q = cu_seqlens_q[1:][sq.clamp(max=n - 1)]
    end_k = cu_seqlens_k[1:][sk.clamp(max=n - 1)]
    keep = _window_keep(iq - end_q, ik - end_k, causal, left, right)
    keep = (keep & (sq[:, None] == sk[None, :])) | (sq >= n)[:, None]
    out = _scores_to_output(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                            keep[None, None], scale, softcap, sinks)
    return out[0].transpose(0, 1)


def paged_decode_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                           block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float, left: int,
                           softcap: float, sinks: torch.Tensor | None, appended: int = 0) -> torch.Tensor:
    """One query per sequence: q [B, 1, H, D] against pages [N, P, Hkv, D], sequence b's key s at row s % P of
    page block_table[b, s // P], seq_lens[b] + appended keys (appended: rows written after seq_lens was
    counted, so the caller launches no addition). A sequence of no keys (padding) reads its first key."""
    B, _, H, D = q.shape
    Hkv = k_pages.shape[2]
    k = k_pages[block_table].reshape(B, -1, Hkv, D).transpose(1, 2)
    v = v_pages[block_table].reshape(B, -1, Hkv, D).transpose(1, 2)
    pos = torch.arange(k.shape[2], device=q.device)
    last = (seq_lens + appended).clamp(min=1)[:, None] - 1
    keep = pos[None, :] <= last
    if left >= 0:
        keep = keep & (pos[None, :] >= last - left)
    out = _scores_to_output(q.transpose(1, 2), k, v, keep[:, None, None, :], scale, softcap, sinks)
    return out.transpose(1, 2)
