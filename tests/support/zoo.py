"""Attention specs in many writing styles, with example inputs and what the
program must look like. Shared by the transfer tests and the GPU sweep."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F


@dataclass
class Case:
    name: str
    fn: Callable
    make: Callable[[int, int, int, int, int, torch.dtype], tuple]  # (B, H, Hkv, S, D, dtype) -> args
    expect: dict[str, Any] = field(default_factory=dict)
    sq_skv: tuple[int, int] | None = None   # force Sq != Skv


def qkv(B, H, Hkv, Sq, Skv, D, dtype, layout="bhsd"):
    def t(h, s):
        x = torch.randn(B, h, s, D, dtype=dtype)
        return x.transpose(1, 2).contiguous() if layout == "bshd" else x
    return t(H, Sq), t(Hkv, Skv), t(Hkv, Skv)


def std(B, H, Hkv, S, D, dtype):
    return qkv(B, H, H, S, S, D, dtype)


# ---- full -------------------------------------------------------------------
def full_matmul(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1) @ v


def q_divided_causal(q, k, v):
    """The scale divides q before the matmul (a common style; was refused)."""
    q = q / math.sqrt(q.shape[-1])
    S = q.shape[-2]
    s = (q @ k.transpose(-1, -2)).masked_fill(torch.ones(S, S, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return s.softmax(-1) @ v


def no_self_diag(q, k, v):
    """No token attends to itself (Reformer-style shared QK), the mask built with torch.diag."""
    S = q.shape[-2]
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    return s.masked_fill(torch.diag(torch.ones(S, dtype=torch.bool, device=q.device)), -1e4).softmax(-1) @ v


def full_einsum(q, k, v):
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * q.shape[-1] ** -0.5
    return torch.einsum("bhqk,bhkd->bhqd", s.softmax(dim=-1), v)


def full_bmm(q, k, v):
    B, H, S, D = q.shape
    qf, kf, vf = (x.reshape(B * H, -1, D) for x in (q, k, v))
    p = torch.bmm(qf, kf.transpose(1, 2)).mul(1 / math.sqrt(D)).softmax(-1)
    return torch.bmm(p, vf).view(B, H, S, D)


def full_sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v)


def full_bshd(q, k, v):
    """Transposed layout in and out: [B, S, H, D]."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    out = F.softmax(torch.matmul(q, k.transpose(2, 3)) * 0.125, dim=-1, dtype=torch.float32).to(q.dtype) @ v
    return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)


def full_manual_softmax(q, k, v):
    s = q @ k.transpose(-1, -2) / 8
    s = s - s.amax(dim=-1, keepdim=True)
    e = s.exp()
    return (e / e.sum(dim=-1, keepdim=True)) @ v


# ---- causal -----------------------------------------------------------------
def causal_masked_fill(q, k, v):
    S = q.shape[-2]
    mask = torch.triu(torch.ones(S, S, dtype=torch.bool, device=q.device), diagonal=1)
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    return s.masked_fill(mask, float("-inf")).softmax(-1) @ v


def causal_where_finfo(q, k, v):
    S = q.shape[-2]
    i = torch.arange(S, device=q.device)
    s = torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(q.shape[-1])
    s = torch.where(i[:, None] >= i[None, :], s, torch.finfo(s.dtype).min)
    return torch.einsum("bhij,bhjd->bhid", torch.softmax(s, -1), v)


def causal_additive(q, k, v):
    S = q.shape[-2]
    bias = torch.full((S, S), float("-inf"), device=q.device).triu(1)
    return torch.softmax(q @ k.mT * q.shape[-1] ** -0.5 + bias, dim=-1) @ v


def causal_sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def causal_bottom_right(q, k, v):
    Sq, Skv = q.shape[-2], k.shape[-2]
    keep = torch.ones(Sq, Skv, dtype=torch.bool, device=q.device).tril(diagonal=Skv - Sq)
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return s.masked_fill(~keep, -1e9).softmax(-1) @ v


def causal_top_left_rect(q, k, v):
    Sq, Skv = q.shape[-2], k.shape[-2]
    qi = torch.arange(Sq, device=q.device)[:, None]
    ki = torch.arange(Skv, device=q.device)[None, :]
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return s.masked_fill(ki > qi, float("-inf")).softmax(-1) @ v


EMPTY_ROWS = 5  # the first query rows empty_rows_causal leaves without a key


def _keep_causal_but_first(q):
    i = torch.arange(q.shape[-2], device=q.device)
    return (i[:, None] >= i[None, :]) & (i[:, None] >= EMPTY_ROWS)


def empty_rows_causal(q, k, v):
    """Causal, and the first EMPTY_ROWS query rows keep no key (the spec's softmax gives NaN there): their
    gradients must be zero and finite."""
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return torch.softmax(s.masked_fill(~_keep_causal_but_first(q), float("-inf")), dim=-1) @ v


def empty_rows_reference(q, k, v):
    """The same without PyTorch's NaN rows (which poison every key's dV through P^T dO): a huge finite fill,
    and the empty rows' probabilities zeroed by a where (whose backward gives them no gradient)."""
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    keep = _keep_causal_but_first(q)
    pr = torch.softmax(s.masked_fill(~keep, -1e300), dim=-1)
    return torch.where(keep.any(-1)[:, None], pr, torch.zeros_like(pr)) @ v


def empty_rows_finite_fill(q, k, v):
    """Bottom-right causal with Sq > Skv and a finite fill: the first rows are fully masked,
    and the spec defines them (softmax of equal values: the mean of V)."""
    Sq, Skv = q.shape[-2], k.shape[-2]
    keep = torch.ones(Sq, Skv, dtype=torch.bool, device=q.device).tril(diagonal=Skv - Sq)
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return s.masked_fill(~keep, torch.finfo(s.dtype).min).softmax(-1) @ v


# ---- sliding window -----------------------------------------------------------
def sliding_window(q, k, v, window: int = 16):
    S = q.shape[-2]
    i = torch.arange(S, device=q.device)
    d = i[:, None] - i[None, :]
    keep = (d >= 0) & (d < window)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return torch.where(keep, s, float("-inf")).softmax(-1) @ v


def sliding_window_sdpa_boolmask(q, k, v):
    S = q.shape[-2]
    i = torch.arange(S, device=q.device)
    keep = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - 24)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


# ---- softcap ------------------------------------------------------------------
def softcap_causal(q, k, v):
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    s = 30.0 * torch.tanh(s / 30.0)
    S = q.shape[-2]
    s = s.masked_fill(torch.ones(S, S, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return s.softmax(-1) @ v


def softcap_full_arg(q, k, v, cap):
    s = torch.tanh((q @ k.transpose(-1, -2)) * 0.1 / cap) * cap
    return s.softmax(dim=-1) @ v


# ---- ALiBi --------------------------------------------------------------------
def alibi_const(q, k, v):
    H, S = q.shape[1], q.shape[2]
    slopes = torch.tensor([2 ** (-8 * (h + 1) / H) for h in range(H)], device=q.device)
    pos = torch.arange(S, device=q.device)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = s + slopes.view(1, H, 1, 1) * (pos.view(1, 1, 1, S) - pos.view(1, 1, S, 1)).float()
    return s.masked_fill(pos.view(S, 1) < pos.view(1, S), float("-inf")).softmax(-1) @ v


def alibi_tensor(q, k, v, slopes):
    S = q.shape[-2]
    dist = torch.arange(S, device=q.device)[None, :] - torch.arange(S, device=q.device)[:, None]
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * q.shape[-1] ** -0.5
    s = s - slopes[:, None, None] * dist.abs()
    return torch.einsum("bhqk,bhkd->bhqd", s.softmax(-1), v)


# ---- GQA / MQA -----------------------------------------------------------------
def gqa_expand(q, k, v):
    B, H, S, D = q.shape
    g = H // k.shape[1]
    k = k.unsqueeze(2).expand(-1, -1, g, -1, -1).reshape(B, H, -1, D)
    v = v.unsqueeze(2).expand(-1, -1, g, -1, -1).reshape(B, H, -1, D)
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D), -1) @ v


def gqa_repeat_interleave(q, k, v):
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def gqa_sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def gqa_tile_repeat(q, k, v):
    """k.repeat tiles heads: query head h reads kv head h % Hkv."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat(1, g, 1, 1), v.repeat(1, g, 1, 1)
    return (q @ k.transpose(-1, -2) * 0.125).softmax(-1) @ v


def mqa_expand(q, k, v):
    k = k.expand(-1, q.shape[1], -1, -1)
    v = v.expand(-1, q.shape[1], -1, -1)
    return (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).softmax(-1) @ v


# ---- prefix LM ------------------------------------------------------------------
def prefix_lm_const(q, k, v):
    S = q.shape[-2]
    i = torch.arange(S, device=q.device)
    keep = (i[None, :] < 20) | (i[:, None] >= i[None, :])
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return s.masked_fill(~keep, float("-inf")).softmax(-1) @ v


def prefix_lm_tensor(q, k, v, prefix_len):
    S = q.shape[-2]
    i = torch.arange(S, device=q.device)
    keep = (i.view(1, 1, 1, S) < prefix_len.view(-1, 1, 1, 1)) | (i.view(1, 1, S, 1) >= i.view(1, 1, 1, S))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


# ---- document masking ---------------------------------------------------------
def document_causal(q, k, v, doc):
    same = doc[:, None, :, None] == doc[:, None, None, :]
    S = q.shape[-2]
    causal = torch.arange(S, device=q.device)[:, None] >= torch.arange(S, device=q.device)[None, :]
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    return s.masked_fill(~(same & causal), float("-inf")).softmax(-1) @ v


# ---- relative position bias ----------------------------------------------------
def rel_bias_table(q, k, v, table):
    S = q.shape[-2]
    rel = torch.arange(S, device=q.device)[None, :] - torch.arange(S, device=q.device)[:, None] + S - 1
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 + table[:, rel]
    return s.softmax(-1) @ v


def rel_bias_clamped(q, k, v, table):
    S = q.shape[-2]
    rel = (torch.arange(S, device=q.device)[None, :] - torch.arange(S, device=q.device)[:, None]).clamp(-8, 8) + 8
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 + table[rel].permute(2, 0, 1)
    return s.softmax(-1) @ v


# ---- sinks -----------------------------------------------------------------------
def sinks_column(q, k, v, sinks):
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    col = sinks.view(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], 1)
    p = torch.cat([s, col], dim=-1).softmax(-1)[..., :-1]
    return p @ v


# ---- scales ------------------------------------------------------------------------
def per_head_scale(q, k, v, scale):
    s = (q @ k.transpose(-1, -2)) * scale[None, :, None, None]
    return s.softmax(-1) @ v


def custom_scale_arg(q, k, v, scale: float = 0.3):
    return F.scaled_dot_product_attention(q, k, v, scale=scale)


def B_(B, H, Hkv, S, D, dtype):
    return B


CASES: list[Case] = [
    Case("full_matmul", full_matmul, std, {"mask": False}),
    Case("full_einsum", full_einsum, std, {"mask": False}),
    Case("q_divided_causal", q_divided_causal, std, {"mask": True}),
    Case("no_self_diag", no_self_diag, std, {"mask": True}),
    Case("full_bmm", full_bmm, std, {"mask": False}),
    Case("full_sdpa", full_sdpa, std, {"mask": False}),
    Case("full_bshd", full_bshd, lambda B, H, Hkv, S, D, dt: qkv(B, H, H, S, S, D, dt, "bshd"),
         {"mask": False, "q_dims": ("b", "s", "h", "d"), "out_dims": ("b", "s", "h*d")}),
    Case("full_manual_softmax", full_manual_softmax, std, {"mask": False}),
    Case("causal_masked_fill", causal_masked_fill, std, {"block_rule": "interval"}),
    Case("causal_where_finfo", causal_where_finfo, std, {"block_rule": "interval", "empty_rows": "mean_v"}),
    Case("causal_additive", causal_additive, std, {"block_rule": "interval"}),
    Case("causal_sdpa", causal_sdpa, std, {"block_rule": "interval"}),
    Case("causal_bottom_right", causal_bottom_right, lambda B, H, Hkv, S, D, dt: qkv(B, H, H, S - 10, S, D, dt),
         {"block_rule": "interval"}),
    Case("causal_top_left_rect", causal_top_left_rect, lambda B, H, Hkv, S, D, dt: qkv(B, H, H, S, S - 7, D, dt),
         {"block_rule": "interval"}),
    Case("empty_rows_finite_fill", empty_rows_finite_fill,
         lambda B, H, Hkv, S, D, dt: qkv(B, H, H, S, S - 20, D, dt), {"empty_rows": "mean_v", "block_rule": "interval"}),
    Case("sliding_window", sliding_window, std, {"block_rule": "interval", "scalars": 2}),
    Case("sliding_window_sdpa_boolmask", sliding_window_sdpa_boolmask, std, {"block_rule": "interval"}),
    Case("softcap_causal", softcap_causal, std, {"block_rule": "interval", "score_has": "tanh"}),
    Case("softcap_full_arg", softcap_full_arg, lambda B, H, Hkv, S, D, dt: std(B, H, Hkv, S, D, dt) + (20.0,),
         {"mask": False, "score_has": "tanh"}),
    Case("alibi_const", alibi_const, std, {"extras": 1, "block_rule": "interval"}),
    Case("alibi_tensor", alibi_tensor, lambda B, H, Hkv, S, D, dt: std(B, H, Hkv, S, D, dt) + (torch.rand(H),),
         {"extras": 1, "mask": False}),
    Case("gqa_expand", gqa_expand, lambda B, H, Hkv, S, D, dt: qkv(B, H, Hkv, S, S, D, dt), {"head_map": "group"}),
    Case("gqa_repeat_interleave", gqa_repeat_interleave, lambda B, H, Hkv, S, D, dt: qkv(B, H, Hkv, S, S, D, dt),
         {"head_map": "group", "block_rule": "interval"}),
    Case("gqa_sdpa", gqa_sdpa, lambda B, H, Hkv, S, D, dt: qkv(B, H, Hkv, S, S, D, dt), {"head_map": "group"}),
    Case("gqa_tile_repeat", gqa_tile_repeat, lambda B, H, Hkv, S, D, dt: qkv(B, H, Hkv, S, S, D, dt),
         {"head_map": "tile"}),
    Case("mqa_expand", mqa_expand, lambda B, H, Hkv, S, D, dt: qkv(B, H, 1, S, S, D, dt), {"head_map": "group"}),
    Case("prefix_lm_const", prefix_lm_const, std, {"block_rule": "interval"}),
    Case("prefix_lm_tensor", prefix_lm_tensor,
         lambda B, H, Hkv, S, D, dt: std(B, H, Hkv, S, D, dt) + (torch.randint(1, S, (B,)),),
         {"block_rule": "prepass", "extras": 1}),
    Case("document_causal", document_causal,
         lambda B, H, Hkv, S, D, dt: std(B, H, Hkv, S, D, dt) + (torch.randint(0, 4, (B, S)).sort(-1).values,),
         {"block_rule": "prepass", "extras": 1}),
    Case("rel_bias_table", rel_bias_table,
         lambda B, H, Hkv, S, D, dt: std(B, H, Hkv, S, D, dt) + (torch.randn(H, 2 * S - 1),), {"extras": 1}),
    Case("rel_bias_clamped", rel_bias_clamped,
         lambda B, H, Hkv, S, D, dt: std(B, H, Hkv, S, D, dt) + (torch.randn(17, H),), {"extras": 1}),
    Case("sinks_column", sinks_column, lambda B, H, Hkv, S, D, dt: std(B, H, Hkv, S, D, dt) + (torch.randn(H),),
         {"sink": True}),
    Case("per_head_scale", per_head_scale, lambda B, H, Hkv, S, D, dt: std(B, H, Hkv, S, D, dt) + (torch.rand(H),),
         {"extras": 1}),
    Case("custom_scale_arg", custom_scale_arg, std, {"mask": False, "scalars": 1}),
]


# ---- more writing styles (CPU transfer tests; added after the last GPU run) -------------------------
def baddbmm_bias(q, k, v, bias):
    B, H, S, D = q.shape
    s = torch.baddbmm(bias.expand(B*H, S, S), q.reshape(B*H, S, D), k.reshape(B*H, S, D).transpose(1, 2), alpha=D**-0.5)
    return torch.bmm(s.softmax(-1), v.reshape(B*H, S, D)).view(B, H, S, D)
def lse_softmax(q, k, v):
    s = q @ k.mT / 8
    return torch.exp(s - torch.logsumexp(s, -1, keepdim=True)) @ v
def inplace_ops(q, k, v):
    s = torch.matmul(q, k.transpose(-2, -1))
    s.div_(math.sqrt(q.size(-1)))
    S = q.size(-2)
    s.masked_fill_(torch.ones(S, S, dtype=torch.bool).triu_(1), float("-inf"))
    return s.softmax(-1) @ v
def flatten_gqa(q, k, v):
    g = q.shape[1] // k.shape[1]
    k = k[:, :, None].expand(-1, -1, g, -1, -1).flatten(1, 2)
    v = v[:, :, None].expand(-1, -1, g, -1, -1).flatten(1, 2)
    return F.softmax(q @ k.transpose(-1, -2) / 8, dim=3) @ v
def float_mask_eq0(q, k, v, mask):
    s = q @ k.transpose(-1, -2) / 8
    return s.masked_fill(mask == 0, float("-inf")).softmax(-1) @ v
def log_tril(q, k, v):
    S = q.shape[-2]
    return (q @ k.transpose(-1, -2) / 8 + torch.ones(S, S).tril().log()).softmax(-1) @ v
def bshd_einsum(q, k, v):
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v)
def index_select_gqa(q, k, v):
    g = q.shape[1] // k.shape[1]
    idx = torch.arange(q.shape[1]) // g
    k = k.index_select(1, idx); v = v.index_select(1, idx)
    return (q @ k.transpose(-1, -2) / 8).softmax(-1) @ v
def bloom_alibi(q, k, v, alibi):
    return ((q @ k.transpose(-1, -2)) * 0.125 + alibi).softmax(-1) @ v
def sdpa_float_mask(q, k, v, m):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m)
def sigmoid_attn_guard(q, k, v):
    s = q @ k.transpose(-1,-2) / 8
    return torch.softmax(s + torch.nn.functional.logsigmoid(s), -1) @ v


def _std(B, H, Hkv, S, D, dt):
    return qkv(B, H, H, S, S, D, dt)


def _gqa(B, H, Hkv, S, D, dt):
    return qkv(B, H, Hkv, S, S, D, dt)


MORE_STYLES: list[Case] = [
    Case("baddbmm_bias", baddbmm_bias, lambda B, H, Hkv, S, D, dt: _std(B, H, Hkv, S, D, dt) + (torch.randn(1, S, S),)),
    Case("lse_softmax", lse_softmax, _std),
    Case("inplace_ops", inplace_ops, _std, {"block_rule": "interval"}),
    Case("flatten_gqa", flatten_gqa, _gqa, {"head_map": "group"}),
    Case("float_mask_eq0", float_mask_eq0,
         lambda B, H, Hkv, S, D, dt: _std(B, H, Hkv, S, D, dt) + ((torch.rand(B, 1, S, S) > 0.3).float(),),
         {"block_rule": "prepass"}),
    Case("log_tril", log_tril, _std),
    Case("bshd_einsum", bshd_einsum, lambda B, H, Hkv, S, D, dt: qkv(B, H, H, S, S, D, dt, "bshd"),
         {"q_dims": ("b", "s", "h", "d")}),
    Case("index_select_gqa", index_select_gqa, _gqa, {"head_map": "group"}),
    Case("bloom_alibi", bloom_alibi, lambda B, H, Hkv, S, D, dt: _std(B, H, Hkv, S, D, dt) + (torch.randn(B, H, 1, S),)),
    Case("sdpa_float_mask", sdpa_float_mask, lambda B, H, Hkv, S, D, dt: _std(B, H, Hkv, S, D, dt) + (torch.randn(B, 1, S, S),)),
    Case("logsigmoid_in_score", sigmoid_attn_guard, _std),
]


# ---- values off the score path that no rule covers: PyTorch computes them (the prologue) ----------
def forgetting_attention(q, k, v, log_f):
    """FoX (Lin et al. 2025): a cumulative sum of log forget gates decays the scores."""
    c = torch.cumsum(log_f, dim=-1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + c[..., :, None] - c[..., None, :]
    S = q.shape[-2]
    return s.masked_fill(torch.ones(S, S, dtype=torch.bool, device=q.device).triu(1), float("-inf")).softmax(-1) @ v


def varlen_cu_seqlens(q, k, v, cu_seqlens):
    """Packed sequences: document ids looked up from cu_seqlens with searchsorted."""
    pos = torch.arange(q.shape[-2], device=q.device)
    doc = torch.searchsorted(cu_seqlens, pos, right=True)
    keep = (doc[:, None] == doc[None, :]) & (pos[:, None] >= pos[None, :])
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * q.shape[-1] ** -0.5
    return torch.softmax(s.masked_fill(~keep, float("-inf")), dim=-1) @ v


class DynamicPosBias(torch.nn.Module):
    """An MLP over relative distances gives each head a bias (CrossFormer, Swin-v2 CPB style)."""

    def __init__(self, heads: int, hidden: int = 16) -> None:
        super().__init__()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(1, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, heads))

    def forward(self, S: int) -> torch.Tensor:
        dev = self.mlp[0].weight.device
        dist = torch.arange(-S + 1, S, dtype=torch.float32, device=dev)[:, None] / S
        table = self.mlp(dist)                                    # [2S-1, H]
        pos = torch.arange(S, device=dev)
        idx = pos[None, :] - pos[:, None] + S - 1
        return table[idx].permute(2, 0, 1)                        # [H, S, S]


def mlp_position_bias(q, k, v, dpb):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + dpb(q.shape[-2])
    return s.softmax(-1) @ v


def block_causal_shift(q, k, v):
    """Block-causal over blocks of 16 tokens, the block found with a bit shift."""
    blk = torch.arange(q.shape[-2], device=q.device) >> 4
    s = (q @ k.transpose(-1, -2)) * 0.125
    return s.masked_fill(blk[:, None] < blk[None, :], -1e9).softmax(-1) @ v


def cosine_attention(q, k, v):
    """Cosine similarity with a learned-style temperature (Swin-v2): norms of q and k."""
    s = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-1, -2)
    return (s * 10.0).softmax(-1) @ v


def computed_slopes_gather(q, k, v):
    """ALiBi slopes made with cumprod and gathered per head with index_select."""
    H, S = q.shape[1], q.shape[-2]
    slopes = torch.cumprod(torch.full((H,), 2 ** (-8 / H), device=q.device), dim=0)
    per_head = slopes.index_select(0, torch.arange(H, device=q.device))
    rel = torch.arange(S, device=q.device)[None, :] - torch.arange(S, device=q.device)[:, None]
    s = q @ k.transpose(-1, -2) / 8 + per_head[:, None, None] * rel.float()
    return s.softmax(-1) @ v


def t5_bucket(rel, num_buckets=32, max_distance=128):
    """T5's bidirectional relative-position bucket (log-spaced past max_exact)."""
    num_buckets //= 2
    ret = (rel > 0).to(torch.long) * num_buckets
    n = torch.abs(rel)
    max_exact = num_buckets // 2
    large = max_exact + (torch.log(n.float() / max_exact) / math.log(max_distance / max_exact)
                         * (num_buckets - max_exact)).to(torch.long)
    large = torch.min(large, torch.full_like(large, num_buckets - 1))
    return ret + torch.where(n < max_exact, n, large)


def t5_relative_bias(q, k, v, rel_emb):
    """T5 attention: no scaling, a learned bias per bucket and head. The buckets round float32 logs
    to integers (at distance 16 float32 gives bucket 10 where float64 gives 9)."""
    pos = torch.arange(q.shape[-2], dtype=torch.long, device=q.device)
    bias = rel_emb[t5_bucket(pos[None, :] - pos[:, None])].permute(2, 0, 1).unsqueeze(0)
    return torch.softmax(q @ k.transpose(-1, -2) + bias, dim=-1) @ v


def _rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rope_in_spec(q, k, v, cos, sin):
    """Rotary embeddings applied inside the attention function (computed q and k)."""
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1) @ v


def _rope(B, H, Hkv, S, D, dt):
    pos = torch.arange(S)[:, None] / (10000 ** (torch.arange(0, D, 2) / D))[None]
    ang = torch.cat([pos, pos], dim=-1)
    return _std(B, H, Hkv, S, D, dt) + (ang.cos().to(dt), ang.sin().to(dt))


def qk_rmsnorm_sdpa(q, k, v, wq, wk):
    """QK-norm (OLMo-2, Qwen3 style) before causal SDPA."""
    q = F.rms_norm(q, (q.shape[-1],), wq, eps=1e-6)
    k = F.rms_norm(k, (k.shape[-1],), wk, eps=1e-6)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def memory_kv(q, k, v, mem_k, mem_v):
    """Learned memory key/values prepended to every sequence (x-transformers num_mem_kv)."""
    B = q.shape[0]
    k = torch.cat([mem_k.expand(B, -1, -1, -1), k], dim=-2)
    v = torch.cat([mem_v.expand(B, -1, -1, -1), v], dim=-2)
    return torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, dim=-1) @ v


def kv_cache_concat(q, k_new, v_new, k_cache, v_cache):
    """A few new tokens: the cache and the new keys concatenated inside the spec, causal bottom-right."""
    k = torch.cat([k_cache, k_new], dim=2)
    v = torch.cat([v_cache, v_new], dim=2)
    Sq, Skv = q.shape[-2], k.shape[-2]
    keep = torch.ones(Sq, Skv, dtype=torch.bool, device=q.device).tril(Skv - Sq)
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    return s.masked_fill(~keep, float("-inf")).softmax(-1) @ v


def _cached(B, H, Hkv, S, D, dt):
    q, k, v = qkv(B, H, H, 4, 4, D, dt)
    return (q, k, v) + tuple(torch.randn(B, H, S - 4, D, dtype=dt) for _ in range(2))


def standardised_bias(q, k, v, bias):
    """A bias standardised per row with var_mean (an op with two results)."""
    var, mean = torch.var_mean(bias, dim=-1, keepdim=True)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + (bias - mean) * torch.rsqrt(var + 1e-5)
    return s.softmax(-1) @ v


def _cu(B, H, Hkv, S, D, dt):
    cuts = torch.randperm(S - 2)[:3].sort().values + 1
    return qkv(1, H, H, S, S, D, dt) + (torch.cat([torch.tensor([0]), cuts, torch.tensor([S])]),)


def bessel_distance_bias(q, k, v):
    """A bias of q - kv through an op no rule covers (Bessel J0), with more keys than queries."""
    Sq, Skv = q.shape[-2], k.shape[-2]
    rel = (torch.arange(Sq, device=q.device)[:, None] - torch.arange(Skv, device=q.device)[None, :]).float()
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 + torch.special.bessel_j0(rel / 8.0)
    return s.softmax(-1) @ v


def paged_decode(q, k_pages, v_pages, block_table, seq_lens):
    """vLLM-style decode: K/V in pages of 16 tokens read through a block table, GQA by repeat_interleave,
    each sequence masked at its own length."""
    B, H, Sq, D = q.shape
    Hkv = k_pages.shape[1]
    k = k_pages[block_table].permute(0, 2, 1, 3, 4).reshape(B, Hkv, -1, D).repeat_interleave(H // Hkv, dim=1)
    v = v_pages[block_table].permute(0, 2, 1, 3, 4).reshape(B, Hkv, -1, D).repeat_interleave(H // Hkv, dim=1)
    keep = torch.arange(k.shape[2], device=q.device)[None, :] < seq_lens[:, None]
    s = (q @ k.transpose(-1, -2)) / math.sqrt(D)
    return s.masked_fill(~keep[:, None, None, :], float("-inf")).softmax(-1) @ v


def _paged(B, H, Hkv, S, D, dt):
    per = -(-S // 16)  # pages per sequence
    pages = B * per + 3
    block_table = torch.randperm(pages)[:B * per].reshape(B, per)
    seq_lens = torch.randint(1, per * 16 + 1, (B,))
    return (torch.randn(B, H, 1, D, dtype=dt), torch.randn(pages, Hkv, 16, D, dtype=dt),
            torch.randn(pages, Hkv, 16, D, dtype=dt), block_table, seq_lens)


class Latents(torch.nn.Module):
    """A learned latent query (Perceiver, Q-Former, a resampler), with its own projection."""

    def __init__(self, n: int, heads: int, dim: int) -> None:
        super().__init__()
        self.latents = torch.nn.Parameter(torch.randn(n, heads * dim))
        self.to_q = torch.nn.Linear(heads * dim, heads * dim, bias=False)
        self.heads, self.dim = heads, dim


def perceiver_latents(module, k, v):
    """Cross-attention from the module's latents to the inputs, broadcast over the batch."""
    q = module.latents.view(-1, module.heads, module.dim).transpose(0, 1).to(k.dtype)
    s = q.unsqueeze(0).expand(k.shape[0], -1, -1, -1) @ k.transpose(-1, -2) * module.dim ** -0.5
    return s.softmax(-1) @ v


def perceiver_projected(module, k, v):
    """The latents through the module's query projection, then SDPA."""
    B, H, S, D = k.shape
    q = module.to_q(module.latents).view(1, -1, H, D).transpose(1, 2).to(k.dtype)
    return torch.nn.functional.scaled_dot_product_attention(q.expand(B, -1, -1, -1), k, v)


def _latents(B, H, Hkv, S, D, dt):
    _, k, v = qkv(B, H, H, S, S, D, dt)
    return (Latents(max(8, S // 4), H, D), k, v)


PROLOGUE: list[Case] = [
    Case("forgetting_attention", forgetting_attention,
         lambda B, H, Hkv, S, D, dt: _std(B, H, Hkv, S, D, dt) + (F.logsigmoid(torch.randn(B, H, S) + 2),),
         {"steps": ("cumsum",)}),
    Case("varlen_cu_seqlens", varlen_cu_seqlens, _cu, {"steps": ("searchsorted",), "block_rule": "prepass"}),
    Case("mlp_position_bias", mlp_position_bias,
         lambda B, H, Hkv, S, D, dt: _std(B, H, Hkv, S, D, dt) + (DynamicPosBias(H),), {"steps": ("addmm", "relu")}),
    Case("block_causal_shift", block_causal_shift, _std, {"steps": ("__rshift__",), "block_rule": "prepass"}),
    Case("cosine_attention", cosine_attention, _std, {"steps": ("linalg_vector_norm",)}),
    Case("computed_slopes_gather", computed_slopes_gather, _std, {"steps": ("cumprod",)}),
    Case("t5_relative_bias", t5_relative_bias,
         lambda B, H, Hkv, S, D, dt: _std(B, H, Hkv, S, D, dt) + (torch.randn(32, H),), {"steps": ("log", "index")}),
    Case("standardised_bias", standardised_bias,
         lambda B, H, Hkv, S, D, dt: _std(B, H, Hkv, S, D, dt) + (torch.randn(H, S, S, dtype=dt),),
         {"steps": ("var_mean",)}),
    Case("rope_in_spec", rope_in_spec, _rope, {"steps": ("cat",), "computed": "qk"}),
    Case("qk_rmsnorm_sdpa", qk_rmsnorm_sdpa,
         lambda B, H, Hkv, S, D, dt: _std(B, H, Hkv, S, D, dt) + (torch.rand(D, dtype=dt) + 0.5,
                                                                   torch.rand(D, dtype=dt) + 0.5),
         {"steps": ("rsqrt",), "computed": "qk", "block_rule": "interval"}),
    Case("memory_kv", memory_kv,
         lambda B, H, Hkv, S, D, dt: _std(B, H, Hkv, S, D, dt) + (torch.randn(1, H, 4, D, dtype=dt),
                                                                   torch.randn(1, H, 4, D, dtype=dt)),
         {"steps": ("cat",), "computed": "kv"}),
    Case("kv_cache_concat", kv_cache_concat, _cached, {"steps": ("cat",), "computed": "kv",
                                                       "block_rule": "interval"}),
    Case("bessel_distance_bias", bessel_distance_bias,
         lambda B, H, Hkv, S, D, dt: qkv(B, H, H, S - 9, S, D, dt), {"steps": ("special_bessel_j0",)}),
    Case("paged_decode", paged_decode, _paged, {"steps": ("index",), "computed": "kv"}),
    Case("perceiver_latents", perceiver_latents, _latents, {"steps": ("expand",), "computed": "q"}),
    Case("perceiver_projected", perceiver_projected, _latents, {"steps": ("mm", "expand"), "computed": "q"}),
]


# ---- layouts: keys shared by all heads as rank-3 tensors, heads split over two axes ---------------
def mqa_rank3_einsum(q, k, v):
    """MQA with rank-3 keys and values ("b j d"), einsum folding heads into the query rows."""
    s = torch.einsum("bhid,bjd->bhij", q, k) * q.shape[-1] ** -0.5
    return torch.einsum("bhij,bjd->bhid", s.softmax(dim=-1), v)


def mqa_rank3_matmul(q, k, v):
    s = q @ k.unsqueeze(1).transpose(-1, -2) / math.sqrt(q.shape[-1])
    return s.softmax(-1) @ v.unsqueeze(1)


def batchless_grouped(q, k, v):
    """Batch-less GQA as some inference code writes it: q [T, Hkv, g, D], k and v [T, Hkv, D]."""
    s = torch.einsum("qhgd,khd->hgqk", q, k) / math.sqrt(q.shape[-1])
    T = q.shape[0]
    keep = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    return torch.einsum("hgqk,khd->qhgd", s.masked_fill(~keep, float("-inf")).softmax(-1), v)


class SwinBias(torch.nn.Module):
    """Swin's relative position bias: a learned table gathered by a precomputed index buffer."""

    def __init__(self, heads: int, ws: int = 7) -> None:
        super().__init__()
        self.ws = ws
        self.table = torch.nn.Parameter(torch.randn((2 * ws - 1) ** 2, heads) * 0.5)
        c = torch.stack(torch.meshgrid(torch.arange(ws), torch.arange(ws), indexing="ij")).flatten(1)
        rel = (c[:, :, None] - c[:, None, :]).permute(1, 2, 0) + (ws - 1)
        self.register_buffer("index", rel[..., 0] * (2 * ws - 1) + rel[..., 1])


def swin_window_attention(q, k, v, bias, mask):
    """HF Swin's window attention: windows in the batch (B * nW), a gathered relative position bias,
    and the shifted-window mask added through view(B // nW, nW, H, N, N)."""
    Bw, H, N, D = q.shape
    s = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(D)
    rpb = bias.table[bias.index.view(-1)].view(N, N, -1).permute(2, 0, 1).contiguous()
    s = s + rpb.unsqueeze(0)
    nW = mask.shape[0]
    s = s.view(Bw // nW, nW, H, N, N) + mask.unsqueeze(1).unsqueeze(0)
    s = s.view(-1, H, N, N)
    return torch.matmul(torch.softmax(s, dim=-1), v)


def _swin(B, H, Hkv, S, D, dt):
    nW, N = 4, 49
    mask = torch.where(torch.rand(nW, N, N) > 0.3, 0.0, -100.0).to(dt)
    return qkv(2 * nW, H, H, N, N, D, dt) + (SwinBias(H), mask)


def chunked_local_causal(q, k, v):
    """Block-local attention by reshaping the sequence into chunks of 32, causal inside each chunk."""
    B, H, S, D = q.shape
    c = 32
    qc, kc, vc = (x.view(B, H, S // c, c, D) for x in (q, k, v))
    s = torch.einsum("bhnid,bhnjd->bhnij", qc, kc) * D ** -0.5
    i = torch.arange(c, device=q.device)
    s = s.masked_fill(i[None, :] > i[:, None], float("-inf"))
    return torch.einsum("bhnij,bhnjd->bhnid", s.softmax(-1), vc).reshape(B, H, S, D)


def _mqa3(B, H, Hkv, S, D, dt):
    return (torch.randn(B, H, S, D, dtype=dt),) + tuple(torch.randn(B, S, D, dtype=dt) for _ in range(2))


def _batchless(B, H, Hkv, S, D, dt):
    return (torch.randn(S, Hkv, H // Hkv, D, dtype=dt),) + tuple(torch.randn(S, Hkv, D, dtype=dt) for _ in range(2))


LAYOUTS: list[Case] = [
    Case("mqa_rank3_einsum", mqa_rank3_einsum, _mqa3, {"k_dims": ("b", "s", "d")}),
    Case("mqa_rank3_matmul", mqa_rank3_matmul, _mqa3, {"k_dims": ("b", "s", "d")}),
    Case("batchless_grouped", batchless_grouped, _batchless, {"k_dims": ("s", "b", "d"), "block_rule": "interval"}),
    Case("swin_window_attention", swin_window_attention, _swin, {"score_has": "%"}),
    Case("chunked_local_causal", chunked_local_causal, lambda B, H, Hkv, S, D, dt: _std(2, H, Hkv, 128, D, dt),
         {"block_rule": "interval"}),
]
