"""Corpus: attention specs in the styles of attention-gym, FlexAttention tests, x-transformers, xformers, NATTEN,
mistral-src, gemma_pytorch, Grok-1, tensor2tensor, Longformer/BigBird and StreamingLLM (each docstring says where from).
Each one is rewritten by hand as plain dense PyTorch (no flex_attention, no einops)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from zoo import Case, qkv   # tests/support/zoo.py is on sys.path when tests run


# ---- full ---------------------------------------------------------------------------------------------
def flex_identity_golden(q, k, v):
    """FlexAttention tests: test/inductor/test_flex_attention.py _identity score_mod, dense float64 golden reference."""
    scale = 1.0 / math.sqrt(q.size(-1))
    q64, k64, v64 = q.to(torch.float64), k.to(torch.float64), v.to(torch.float64)
    scores = (q64 @ k64.transpose(-2, -1)) * scale
    probs = torch.softmax(scores, dim=-1)
    return (probs @ v64).to(q.dtype)


def xformers_ref_bmhk(q, k, v):
    """xformers: tests/test_mem_eff_attention.py ref_attention, BMHK layout folded to BMK, q pre-scaled."""
    B, M, H, K = q.shape

    def fold(t):  # [B, M, H, K] -> [B*H, M, K]
        return t.permute(0, 2, 1, 3).reshape(B * H, t.shape[1], K)

    qb, kb, vb = fold(q), fold(k), fold(v)
    qb = qb * (1.0 / K ** 0.5)
    attn = qb @ kb.transpose(-2, -1)
    attn = attn.float().softmax(-1).to(q.dtype)
    out = attn @ vb
    return out.reshape(B, H, M, K).permute(0, 2, 1, 3)


def lucidrains_vit_gqa(q, k, v):
    """lucidrains/vit-pytorch & x-transformers: full attention, dots * scale, kv heads repeated with expand (no einops)."""
    b, h, n, d = q.shape
    kv_h = k.shape[1]
    k = k[:, :, None].expand(b, kv_h, h // kv_h, k.shape[2], d).reshape(b, h, -1, d)
    v = v[:, :, None].expand(b, kv_h, h // kv_h, v.shape[2], d).reshape(b, h, -1, d)
    scale = d ** -0.5
    dots = torch.matmul(q, k.transpose(-1, -2)) * scale
    attn = dots.softmax(dim=-1)
    return torch.matmul(attn, v)


# ---- causal -------------------------------------------------------------------------------------------
def flex_causal_score_mod(q, k, v):
    """FlexAttention tests: test_flex_attention.py _causal score_mod (where(q >= kv, score, -inf)), dense broadcast."""
    score = (q @ k.transpose(-2, -1)) * (q.size(-1) ** -0.5)
    token_q = torch.arange(q.size(-2), device=q.device).view(1, 1, -1, 1)
    token_kv = torch.arange(k.size(-2), device=q.device).view(1, 1, 1, -1)
    score = torch.where(token_q >= token_kv, score, float("-inf"))
    return torch.softmax(score, dim=-1) @ v


def xtransformers_attend_causal(q, k, v):
    """x-transformers: x_transformers/attend.py Attend (einsum sim, triu(j - i + 1) causal, -finfo.max, fp32 softmax)."""
    dtype = q.dtype
    scale = q.shape[-1] ** -0.5
    sim = torch.einsum("b h i d, b h j d -> b h i j", q, k) * scale
    i, j = sim.shape[-2:]
    mask_value = -torch.finfo(sim.dtype).max
    causal_mask = torch.ones((i, j), device=q.device, dtype=torch.bool).triu(j - i + 1)
    sim = sim.masked_fill(causal_mask, mask_value)
    attn = sim.softmax(dim=-1, dtype=torch.float32)
    attn = attn.type(dtype)
    return torch.einsum("b h i j, b h j d -> b h i d", attn, v)


# ---- sliding window -------------------------------------------------------------------------------------
GYM_WINDOW = 16


def gym_sliding_window_sdpa(q, k, v):
    """attention-gym: attn_gym/masks/sliding_window.py (q - kv <= window) & causal, materialised as SDPA bool mask."""
    q_idx = torch.arange(q.shape[-2], device=q.device)[:, None]
    kv_idx = torch.arange(k.shape[-2], device=q.device)[None, :]
    sliding = (q_idx - kv_idx) <= GYM_WINDOW
    causal = q_idx >= kv_idx
    block = sliding & causal
    return F.scaled_dot_product_attention(q, k, v, attn_mask=block[None, None])


def mistral_one_file_swa(xq, keys, values):
    """mistral-src: one_file_ref.py Attention (bshd, repeat_interleave GQA, log(tril/triu) additive window mask)."""
    seqlen = xq.shape[1]
    repeats = xq.shape[2] // keys.shape[2]
    keys = torch.repeat_interleave(keys, repeats=repeats, dim=2)
    values = torch.repeat_interleave(values, repeats=repeats, dim=2)
    xq, keys, values = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
    scale = xq.shape[-1] ** -0.5
    mask = torch.full((seqlen, seqlen), fill_value=1.0, device=xq.device)
    mask = torch.tril(mask, diagonal=0)
    mask = torch.triu(mask, diagonal=-GYM_WINDOW)
    mask = torch.log(mask)
    scores = torch.matmul(xq, keys.transpose(2, 3)) * scale
    scores = scores + mask[None, None, ...]
    scores = F.softmax(scores.float(), dim=-1).type_as(xq)
    output = torch.matmul(scores, values)
    return output.transpose(1, 2).contiguous()


def gym_dilated_sliding_window(q, k, v, window_size: int = 16, dilation: int = 2):
    """attention-gym: attn_gym/masks/dilated_sliding_window.py (|q-kv| <= w and |q-kv| % dilation == 0), dense."""
    S = q.shape[-2]
    idx = torch.arange(S, device=q.device)
    diff = torch.abs(idx[:, None] - idx[None, :])
    keep = (diff <= window_size) & ((diff % dilation) == 0)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~keep, float("-inf"))
    return scores.softmax(dim=-1) @ v


# ---- prefix LM --------------------------------------------------------------------------------------------
def gym_prefix_lm(q, k, v, prefix_length: int = 20):
    """attention-gym: attn_gym/masks/prefix_lm.py or_masks(kv < prefix_length, causal), dense where."""
    q_idx = torch.arange(q.shape[2], device=q.device).view(-1, 1)
    kv_idx = torch.arange(k.shape[2], device=q.device).view(1, -1)
    prefix_lm_causal = (kv_idx < prefix_length) | (q_idx >= kv_idx)
    scores = torch.matmul(q, k.transpose(2, 3)) * q.shape[-1] ** -0.5
    scores = torch.where(prefix_lm_causal, scores, torch.tensor(float("-inf"), device=q.device))
    return torch.matmul(F.softmax(scores, dim=-1), v)


def flex_notebook_prefix_per_batch(q, k, v, prefix_lengths):
    """attention-gym: examples/flex_attn.ipynb prefix LM with per-sequence prefix_lengths[b], as a dense 4-D mask."""
    B, H, S, D = q.shape
    b = torch.arange(B, device=q.device).view(B, 1, 1, 1)
    q_idx = torch.arange(S, device=q.device).view(1, 1, S, 1)
    kv_idx = torch.arange(S, device=q.device).view(1, 1, 1, S)
    mask = (kv_idx <= prefix_lengths[b]) | (q_idx >= kv_idx)
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(D)
    s = s.masked_fill(mask.logical_not(), float("-inf"))
    return torch.einsum("bhqk,bhkd->bhqd", s.softmax(-1), v)


# ---- document masking ------------------------------------------------------------------------------------
def gym_document_causal(q, k, v, document_id):
    """attention-gym: attn_gym/masks/document_mask.py doc_mask_mod (document_id[q] == document_id[kv]) & causal."""
    S = q.shape[-2]
    q_idx = torch.arange(S, device=q.device)[:, None]
    kv_idx = torch.arange(S, device=q.device)[None, :]
    same_doc = document_id[q_idx] == document_id[kv_idx]
    inner = q_idx >= kv_idx
    keep = same_doc & inner
    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    bias = torch.zeros(S, S, dtype=scores.dtype, device=q.device).masked_fill(~keep, float("-inf"))
    return torch.softmax(scores + bias, dim=-1) @ v


# ---- softcapping -------------------------------------------------------------------------------------------
def gemma_softcap_causal(q, k, v):
    """gemma_pytorch: gemma/model.py GemmaAttention (q.mul(scaling), tanh softcap 50, additive -2.38e38 causal mask)."""
    scaling = q.shape[-1] ** -0.5
    softcap = 50.0
    S = q.shape[2]
    mask = torch.full((1, 1, S, S), -2.3819763e38, device=q.device).to(q.dtype).triu(diagonal=1)
    q = q.mul(scaling)
    scores = torch.matmul(q, k.transpose(2, 3))
    scores = scores / softcap
    scores = torch.tanh(scores)
    scores = scores * softcap
    scores = scores + mask
    scores = F.softmax(scores.float(), dim=-1).type_as(q)
    return torch.matmul(scores, v)


def grok_softcap_grouped(q, k, v):
    """xai-org/grok-1: model.py MultiHeadAttention (grouped GQA einsum, 30*tanh(s/30), where(mask, s, -1e30)), torch port."""
    B, H, T, D = q.shape
    kv_heads = k.shape[1]
    q = q.view(B, kv_heads, H // kv_heads, T, D)
    attn_logits = torch.einsum("bkgtd,bksd->bkgts", q, k).to(torch.float32)
    attn_logits = attn_logits * 0.08838834764831845
    max_attn_val = 30.0
    attn_logits = max_attn_val * torch.tanh(attn_logits / max_attn_val)
    causal = torch.tril(torch.ones(T, k.shape[2], dtype=torch.bool, device=q.device))
    attn_logits = torch.where(causal, attn_logits, -1e30)
    attn_weights = torch.softmax(attn_logits, dim=-1).to(q.dtype)
    out = torch.einsum("bkgts,bksd->bkgtd", attn_weights, v)
    return out.reshape(B, H, T, D)


# ---- ALiBi ------------------------------------------------------------------------------------------------
def _xt_alibi_slopes(heads):
    def power_of_2(n):
        start = 2 ** (-2 ** -(math.log2(n) - 3))
        return [start * start ** i for i in range(n)]

    if math.log2(heads).is_integer():
        return power_of_2(heads)
    closest = 2 ** math.floor(math.log2(heads))
    return power_of_2(closest) + power_of_2(2 * closest)[0::2][: heads - closest]


def xtransformers_alibi_computed(q, k, v):
    """x-transformers: x_transformers.py AlibiPositionalBias (_get_slopes power-of-two formula, -|j - i| * slope), causal."""
    h, i, j = q.shape[1], q.shape[2], k.shape[2]
    slopes = torch.tensor(_xt_alibi_slopes(h), device=q.device).view(h, 1, 1)
    seq_arange = torch.arange(j - i, j, device=q.device)
    context_arange = torch.arange(j, device=q.device)
    bias = -torch.abs(context_arange.view(1, 1, j) - seq_arange.view(1, i, 1))
    bias = bias * slopes
    sim = torch.einsum("b h i d, b h j d -> b h i j", q, k) * q.shape[-1] ** -0.5
    sim = sim + bias
    causal_mask = torch.ones((i, j), dtype=torch.bool, device=q.device).triu(j - i + 1)
    sim = sim.masked_fill(causal_mask, -torch.finfo(sim.dtype).max)
    return torch.einsum("b h i j, b h j d -> b h i d", sim.softmax(dim=-1), v)


def xtransformers_alibi_buffer(q, k, v, slopes):
    """x-transformers: AlibiPositionalBias with its registered `slopes` buffer [H, 1, 1] passed in, non-causal."""
    i, j = q.shape[-2], k.shape[-2]
    seq_arange = torch.arange(j - i, j, device=q.device)
    context_arange = torch.arange(j, device=q.device)
    bias = -torch.abs(context_arange[None, None, :] - seq_arange[None, :, None])
    bias = bias * slopes
    sim = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    attn = (sim + bias).softmax(dim=-1)
    return attn @ v


def gym_alibi_exp2_causal(q, k, v):
    """attention-gym: attn_gym/mods/alibi.py alibi_mod (exp2(-(h+1)*8/H) * (kv - q)) with causal_mask, dense."""
    B, H, S, D = q.shape
    h = torch.arange(H, device=q.device).view(1, H, 1, 1)
    q_idx = torch.arange(S, device=q.device).view(1, 1, S, 1)
    kv_idx = torch.arange(S, device=q.device).view(1, 1, 1, S)
    scale = torch.exp2(-((h + 1) * 8.0 / H))
    score = q @ k.transpose(-2, -1) / math.sqrt(D)
    score = score + (kv_idx - q_idx) * scale
    score = score.masked_fill(q_idx < kv_idx, float("-inf"))
    return torch.softmax(score, dim=-1) @ v


# ---- relative position bias (learned table, clamped distance) ----------------------------------------------
MAX_REL = 8


def t2t_clipped_relative_bias(q, k, v, rel_table):
    """tensor2tensor: common_attention.py _generate_relative_positions_matrix (clip to +-max, shift), per-head table."""
    length = q.shape[-2]
    range_vec = torch.arange(length, device=q.device)
    distance_mat = range_vec[None, :] - range_vec[:, None]
    distance_mat_clipped = torch.clamp(distance_mat, -MAX_REL, MAX_REL)
    final_mat = distance_mat_clipped + MAX_REL
    bias = F.embedding(final_mat, rel_table)          # [S, S, H]
    bias = bias.permute(2, 0, 1).unsqueeze(0)          # [1, H, S, S]
    logits = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    weights = F.softmax(logits + bias, dim=-1)
    return torch.matmul(weights, v)


# ---- sinks (StreamingLLM) ----------------------------------------------------------------------------------
def gym_sink_window(q, k, v, window_size: int = 16, sink_size: int = 4):
    """attention-gym: attn_gym/masks/sink_attn.py and_masks(or_masks(window, kv < sink), causal), StreamingLLM style."""
    q_idx = torch.arange(q.shape[-2], device=q.device)[:, None]
    kv_idx = torch.arange(k.shape[-2], device=q.device)[None, :]
    sink = kv_idx < sink_size
    window = (q_idx - kv_idx) <= window_size
    causal = q_idx >= kv_idx
    keep = (window | sink) & causal
    scores = q @ k.transpose(-2, -1) * (1.0 / math.sqrt(q.shape[-1]))
    scores = scores.masked_fill(~keep, float("-inf"))
    return F.softmax(scores, dim=-1) @ v


# ---- global + local (Longformer / BigBird) ------------------------------------------------------------------
def longformer_global_local(q, k, v, num_global: int = 4, one_sided_window: int = 8):
    """HF Longformer/BigBird-style: global_attention_mask on the first G tokens plus a +-w local band, finfo.min bias."""
    S = q.shape[-2]
    is_global = torch.zeros(S, dtype=torch.bool, device=q.device)
    is_global[:num_global] = True
    pos = torch.arange(S, device=q.device)
    local = (pos[:, None] - pos[None, :]).abs() <= one_sided_window
    allowed = local | is_global[:, None] | is_global[None, :]
    bias = torch.zeros(S, S, dtype=q.dtype, device=q.device)
    bias = bias.masked_fill(~allowed, torch.finfo(q.dtype).min)
    q = q / math.sqrt(q.shape[-1])
    attn_scores = torch.matmul(q, k.transpose(-1, -2)) + bias
    attn_probs = F.softmax(attn_scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(attn_probs, v)


# ---- 2-D neighborhood (NATTEN) ---------------------------------------------------------------------------------
CANVAS_W = 10


def gym_natten_2d(q, k, v, kernel_w: int = 3, kernel_h: int = 3):
    """attention-gym: attn_gym/masks/natten.py generate_natten (clamped kernel centre), W=10 grid, rows/cols named consistently."""
    S = q.shape[-2]
    assert S % CANVAS_W == 0
    canvas_h = S // CANVAS_W
    idx = torch.arange(S, device=q.device)
    row, col = idx // CANVAS_W, idx % CANVAS_W
    # the kernel tries to centre on the query but its centre is clamped half a kernel away from the canvas edge
    centre_col = col.clamp(kernel_w // 2, (CANVAS_W - 1) - kernel_w // 2)
    centre_row = row.clamp(kernel_h // 2, (canvas_h - 1) - kernel_h // 2)
    hori = (centre_col[:, None] - col[None, :]).abs() <= kernel_w // 2
    vert = (centre_row[:, None] - row[None, :]).abs() <= kernel_h // 2
    natten = hori & vert
    attn = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    attn = attn.masked_fill(~natten, float("-inf"))
    return attn.softmax(dim=-1) @ v


# ---- block diagonal (chunked) ------------------------------------------------------------------------------------
CHUNK = 16


def xformers_block_diagonal_materialize(q, k, v):
    """xformers: ops/fmha/attn_bias.py BlockDiagonalMask.materialize (full -inf, zeros written per block), bmk ref."""
    B, H, S, D = q.shape
    seqlens = [CHUNK] * (S // CHUNK) + ([S % CHUNK] if S % CHUNK else [])
    mask = torch.full((S, S), float("-inf"), dtype=q.dtype, device=q.device)
    start = 0
    for n in seqlens:
        mask[start:start + n, start:start + n] = 0
        start += n
    qb, kb, vb = (t.reshape(B * H, S, D) for t in (q, k, v))
    qb = qb * (1.0 / D ** 0.5)
    attn = torch.baddbmm(mask.expand(B * H, S, S), qb, kb.transpose(-2, -1))
    attn = attn.float().softmax(-1).to(q.dtype)
    return torch.bmm(attn, vb).view(B, H, S, D)


# ---- causal + per-head windows ------------------------------------------------------------------------------------
def gym_per_head_window(q, k, v, window_sizes):
    """attention-gym/FlexAttention style mask_mod indexing a per-head tensor: causal & (q - kv < window_sizes[h])."""
    H, S = q.shape[1], q.shape[2]
    h = torch.arange(H, device=q.device)[None, :, None, None]
    q_idx = torch.arange(S, device=q.device)[None, None, :, None]
    kv_idx = torch.arange(S, device=q.device)[None, None, None, :]
    keep = (q_idx >= kv_idx) & (q_idx - kv_idx < window_sizes[h])
    s = torch.matmul(q, k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    s = torch.where(keep, s, torch.finfo(s.dtype).min)
    return torch.matmul(torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype), v)


# ---- refused: not softmax attention ----------------------------------------------------------------------------------
def apple_sigmoid_attention(q, k, v):
    """apple/ml-sigmoid-attention: sigmoid(q k^T * scale + b) with b = -log(n), no softmax."""
    n = k.shape[-2]
    b = -math.log(n)
    attn = torch.sigmoid(torch.matmul(q, k.transpose(-2, -1)) * q.shape[-1] ** -0.5 + b)
    return torch.matmul(attn, v)


def fast_transformers_linear_attention(queries, keys, values):
    """idiap/fast-transformers: attention/linear_attention.py LinearAttention, elu(x)+1 feature map, [N, L, H, D]."""
    eps = 1e-6
    Q = F.elu(queries) + 1
    K = F.elu(keys) + 1
    KV = torch.einsum("nshd,nshm->nhmd", K, values)
    Z = 1 / (torch.einsum("nlhd,nhd->nlh", Q, K.sum(dim=1)) + eps)
    V = torch.einsum("nlhd,nhmd,nlh->nlhm", Q, KV, Z)
    return V.contiguous()


def diff_transformer_attention(q, k, v, lambda_full: float = 0.8):
    """microsoft/unilm: Diff-Transformer/multihead_diffattn.py (two causal softmaxes, the second times lambda, subtracted)."""
    bsz, two_h, tgt_len, _ = q.shape
    num_heads = two_h // 2
    src_len = k.shape[2]
    q = q * q.shape[-1] ** -0.5
    attn_weights = torch.matmul(q, k.transpose(-1, -2))
    attn_mask = torch.triu(torch.zeros([tgt_len, src_len], device=q.device).float().fill_(float("-inf")), 1)
    attn_weights = torch.nan_to_num(attn_weights)
    attn_weights = attn_weights + attn_mask
    attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).type_as(attn_weights)
    attn_weights = attn_weights.view(bsz, num_heads, 2, tgt_len, src_len)
    attn_weights = attn_weights[:, :, 0] - lambda_full * attn_weights[:, :, 1]
    return torch.matmul(attn_weights, v)


# ---- example inputs ------------------------------------------------------------------------------------------------
def _std(B, H, Hkv, S, D, dt):
    return qkv(B, H, H, S, S, D, dt)


def _gqa(B, H, Hkv, S, D, dt):
    return qkv(B, H, Hkv, S, S, D, dt)


def _docs(B, H, Hkv, S, D, dt):
    lengths = torch.tensor([S // 4, S // 3, S - S // 4 - S // 3 - S // 5, S // 5])
    document_id = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), lengths)
    return _std(B, H, Hkv, S, D, dt) + (document_id,)


def _alibi_buffer(B, H, Hkv, S, D, dt):
    return _std(B, H, Hkv, S, D, dt) + (torch.tensor(_xt_alibi_slopes(H), dtype=dt).view(H, 1, 1),)


def _diff(B, H, Hkv, S, D, dt):
    q, k, _ = qkv(B, H, H, S, S, D, dt)
    return q, k, torch.randn(B, H // 2, S, 2 * D, dtype=dt)


CASES: list[Case] = [
    Case("gym_full_flex_golden_f64", flex_identity_golden, _std),
    Case("gym_full_xformers_ref_bmhk", xformers_ref_bmhk, lambda B, H, Hkv, S, D, dt: qkv(B, H, H, S, S, D, dt, "bshd")),
    Case("gym_full_lucidrains_gqa_expand", lucidrains_vit_gqa, _gqa),
    Case("gym_causal_flex_score_mod", flex_causal_score_mod, _std),
    Case("gym_causal_xtransformers_attend", xtransformers_attend_causal, _std),
    Case("gym_sliding_window_sdpa", gym_sliding_window_sdpa, _std),
    Case("gym_sliding_window_mistral_gqa", mistral_one_file_swa,
         lambda B, H, Hkv, S, D, dt: qkv(B, H, Hkv, S, S, D, dt, "bshd")),
    Case("gym_dilated_sliding_window", gym_dilated_sliding_window, _std),
    Case("gym_prefix_lm", gym_prefix_lm, _std),
    Case("gym_prefix_lm_per_batch", flex_notebook_prefix_per_batch,
         lambda B, H, Hkv, S, D, dt: _std(B, H, Hkv, S, D, dt) + (torch.randint(4, 30, (B,)),)),
    Case("gym_document_causal", gym_document_causal, _docs),
    Case("gym_softcap_gemma", gemma_softcap_causal, _std),
    Case("gym_softcap_grok_gqa", grok_softcap_grouped, _gqa),
    Case("gym_alibi_xtransformers_slopes", xtransformers_alibi_computed, _std),
    Case("gym_alibi_xtransformers_buffer", xtransformers_alibi_buffer, _alibi_buffer),
    Case("gym_alibi_exp2_causal", gym_alibi_exp2_causal, _std),
    Case("gym_rel_bias_t2t_clipped", t2t_clipped_relative_bias,
         lambda B, H, Hkv, S, D, dt: _std(B, H, Hkv, S, D, dt) + (torch.randn(2 * MAX_REL + 1, H, dtype=dt),)),
    Case("gym_sink_window", gym_sink_window, _std),
    Case("gym_global_local_longformer", longformer_global_local, _std),
    Case("gym_natten_2d", gym_natten_2d, lambda B, H, Hkv, S, D, dt: _std(B, H, Hkv, 70, D, dt)),
    Case("gym_block_diagonal_xformers", xformers_block_diagonal_materialize, _std),
    Case("gym_per_head_window", gym_per_head_window,
         lambda B, H, Hkv, S, D, dt: _std(B, H, Hkv, S, D, dt) + (torch.arange(1, H + 1) * 8,)),
]

REFUSED: list[Case] = [
    Case("gym_refuse_sigmoid_attention", apple_sigmoid_attention, _std),
    Case("gym_refuse_linear_attention", fast_transformers_linear_attention,
         lambda B, H, Hkv, S, D, dt: qkv(B, H, H, S, S, D, dt, "bshd")),
    Case("gym_refuse_diff_attention", diff_transformer_attention, _diff),
]
