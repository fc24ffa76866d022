"""Corpus: attention cores in the styles of public model code (one line each says where from)."""
from __future__ import annotations
import math
import torch
import torch.nn.functional as F
from zoo import Case, qkv   # tests/support/zoo.py is on sys.path when tests run; Case(name, fn, make, expect={}, sq_skv=None)


# ---- shared helpers written the way the models write them -------------------------------------------
def _repeat_kv(hidden_states, n_rep):
    """HF's repeat_kv: [B, Hkv, S, D] -> [B, Hkv * n_rep, S, D] through a 5-D expand."""
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


# ---- GPT-2 ----------------------------------------------------------------------------------------------
GPT2_N_POSITIONS = 1024


def gpt2_attention(q, k, v):
    """huggingface/transformers models/gpt2/modeling_gpt2.py GPT2Attention._attn (bool tril buffer, torch.where)."""
    bias = torch.tril(torch.ones((GPT2_N_POSITIONS, GPT2_N_POSITIONS), dtype=torch.bool, device=q.device)).view(
        1, 1, GPT2_N_POSITIONS, GPT2_N_POSITIONS)
    attn_weights = torch.matmul(q, k.transpose(-1, -2))
    attn_weights = attn_weights / torch.full([], v.size(-1) ** 0.5, dtype=attn_weights.dtype, device=attn_weights.device)
    query_length, key_length = q.size(-2), k.size(-2)
    causal_mask = bias[:, :, key_length - query_length: key_length, :key_length]
    mask_value = torch.finfo(attn_weights.dtype).min
    mask_value = torch.full([], mask_value, dtype=attn_weights.dtype, device=attn_weights.device)
    attn_weights = torch.where(causal_mask, attn_weights.to(attn_weights.dtype), mask_value)
    attn_weights = torch.nn.functional.softmax(attn_weights, dim=-1)
    attn_weights = attn_weights.type(v.dtype)
    return torch.matmul(attn_weights, v)


# ---- nanoGPT ----------------------------------------------------------------------------------------------
def nanogpt_attention(q, k, v):
    """karpathy/nanoGPT model.py CausalSelfAttention slow path (bias == 0 filled with -inf), output [B, T, C]."""
    B, nh, T, hs = q.size()
    bias = torch.tril(torch.ones(T, T, device=q.device)).view(1, 1, T, T)
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
    att = att.masked_fill(bias[:, :, :T, :T] == 0, float("-inf"))
    att = F.softmax(att, dim=-1)
    y = att @ v
    return y.transpose(1, 2).contiguous().view(B, T, nh * hs)


# ---- GPT-J -------------------------------------------------------------------------------------------------
def gptj_attention(q, k, v):
    """huggingface/transformers models/gptj/modeling_gptj.py GPTJAttention._attn (fp32 q/k, mask before scale)."""
    query_length, key_length = q.size(-2), k.size(-2)
    bias = torch.tril(torch.ones((key_length, key_length), dtype=torch.bool, device=q.device)).view(
        1, 1, key_length, key_length)
    causal_mask = bias[:, :, key_length - query_length: key_length, :key_length]
    query = q.to(torch.float32)
    key = k.to(torch.float32)
    attn_weights = torch.matmul(query, key.transpose(-1, -2))
    mask_value = torch.finfo(attn_weights.dtype).min
    mask_value = torch.tensor(mask_value, dtype=attn_weights.dtype).to(attn_weights.device)
    attn_weights = torch.where(causal_mask, attn_weights, mask_value)
    scale_attn = torch.sqrt(torch.tensor(q.size(-1), dtype=torch.float32)).to(attn_weights.device)
    attn_weights = attn_weights / scale_attn
    attn_weights = torch.nn.functional.softmax(attn_weights, dim=-1)
    attn_weights = attn_weights.to(v.dtype)
    return torch.matmul(attn_weights, v)


# ---- GPT-NeoX --------------------------------------------------------------------------------------------
def gpt_neox_attention(q, k, v):
    """huggingface/transformers models/gpt_neox/modeling_gpt_neox.py GPTNeoXAttention._attn (baddbmm on zeros)."""
    batch_size, num_attention_heads, query_length, attn_head_size = q.size()
    key_length = k.size(-2)
    bias = torch.tril(torch.ones((key_length, key_length), dtype=torch.bool, device=q.device)).view(
        1, 1, key_length, key_length)
    causal_mask = bias[:, :, key_length - query_length: key_length, :key_length]
    norm_factor = torch.sqrt(torch.tensor(attn_head_size, dtype=torch.float32)).to(torch.get_default_dtype())
    query = q.reshape(batch_size * num_attention_heads, query_length, attn_head_size)
    key = k.reshape(batch_size * num_attention_heads, key_length, attn_head_size)
    attn_scores = torch.zeros(batch_size * num_attention_heads, query_length, key_length,
                              dtype=query.dtype, device=key.device)
    attn_scores = torch.baddbmm(attn_scores, query, key.transpose(1, 2), beta=1.0,
                                alpha=(torch.tensor(1.0, dtype=norm_factor.dtype, device=norm_factor.device) / norm_factor))
    attn_scores = attn_scores.view(batch_size, num_attention_heads, query_length, key_length)
    mask_value = torch.finfo(attn_scores.dtype).min
    mask_value = torch.tensor(mask_value, dtype=attn_scores.dtype).to(attn_scores.device)
    attn_scores = torch.where(causal_mask, attn_scores, mask_value)
    attn_weights = torch.nn.functional.softmax(attn_scores, dim=-1)
    attn_weights = attn_weights.to(v.dtype)
    return torch.matmul(attn_weights, v)


# ---- BERT -----------------------------------------------------------------------------------------------------
def bert_attention(q, k, v, attention_mask):
    """huggingface/transformers models/bert/modeling_bert.py BertSelfAttention (transpose_for_scores, extended mask)."""
    query_layer, key_layer, value_layer = (x.permute(0, 2, 1, 3) for x in (q, k, v))
    extended_attention_mask = attention_mask[:, None, None, :].to(dtype=q.dtype)
    extended_attention_mask = (1.0 - extended_attention_mask) * torch.finfo(q.dtype).min
    attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
    attention_scores = attention_scores / math.sqrt(query_layer.size(-1))
    attention_scores = attention_scores + extended_attention_mask
    attention_probs = torch.nn.functional.softmax(attention_scores, dim=-1)
    context_layer = torch.matmul(attention_probs, value_layer)
    context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
    new_context_layer_shape = context_layer.size()[:-2] + (query_layer.size(1) * query_layer.size(-1),)
    return context_layer.view(new_context_layer_shape)


def _right_padding(B, S):
    lens = torch.randint(1, S + 1, (B,))
    return (torch.arange(S)[None, :] < lens[:, None]).long()


def _left_padding(B, S):
    lens = torch.randint(1, S + 1, (B,))
    return (torch.arange(S)[None, :] >= (S - lens)[:, None]).long()


# ---- CLIP text ---------------------------------------------------------------------------------------------------
def clip_text_attention(q, k, v, attention_mask):
    """huggingface/transformers models/clip/modeling_clip.py CLIPAttention (bmm over [B*H, S, D], causal + padding masks)."""
    bsz = attention_mask.shape[0]
    tgt_len, head_dim = q.shape[1], q.shape[2]
    num_heads = q.shape[0] // bsz
    src_len = k.size(1)
    dtype = q.dtype
    query_states = q * head_dim ** -0.5
    causal_attention_mask = torch.empty(bsz, tgt_len, tgt_len, dtype=dtype, device=q.device)
    causal_attention_mask.fill_(torch.tensor(torch.finfo(dtype).min))
    causal_attention_mask.triu_(1)
    causal_attention_mask = causal_attention_mask.unsqueeze(1)
    expanded_mask = attention_mask[:, None, None, :].expand(bsz, 1, tgt_len, src_len).to(dtype)
    inverted_mask = 1.0 - expanded_mask
    attention_mask4 = inverted_mask.masked_fill(inverted_mask.to(torch.bool), torch.finfo(dtype).min)
    attn_weights = torch.bmm(query_states, k.transpose(1, 2))
    attn_weights = attn_weights.view(bsz, num_heads, tgt_len, src_len) + causal_attention_mask
    attn_weights = attn_weights.view(bsz * num_heads, tgt_len, src_len)
    attn_weights = attn_weights.view(bsz, num_heads, tgt_len, src_len) + attention_mask4
    attn_weights = attn_weights.view(bsz * num_heads, tgt_len, src_len)
    attn_weights = torch.nn.functional.softmax(attn_weights, dim=-1)
    return torch.bmm(attn_weights, v)


def _rank3(B, H, Sq, Skv, D, dt):
    q, k, v = qkv(B, H, H, Sq, Skv, D, dt)
    return tuple(x.reshape(B * H, x.shape[2], D) for x in (q, k, v))


# ---- Whisper ---------------------------------------------------------------------------------------------------
def whisper_cross_attention(q, k, v):
    """huggingface/transformers models/whisper/modeling_whisper.py WhisperAttention (cross-attention, bmm, q pre-scaled)."""
    head_dim = q.size(-1)
    query_states = q * head_dim ** -0.5
    attn_weights = torch.bmm(query_states, k.transpose(1, 2))
    attn_weights = torch.nn.functional.softmax(attn_weights, dim=-1)
    return torch.bmm(attn_weights, v)


def whisper_openai_attention(q, k, v, mask, n_head):
    """openai/whisper whisper/model.py MultiHeadAttention.qkv_attention (d**-0.25 on q and k, sliced -inf mask buffer)."""
    n_batch, n_ctx, n_state = q.shape
    scale = (n_state // n_head) ** -0.25
    q = q.view(*q.shape[:2], n_head, -1).permute(0, 2, 1, 3) * scale
    k = k.view(*k.shape[:2], n_head, -1).permute(0, 2, 3, 1) * scale
    v = v.view(*v.shape[:2], n_head, -1).permute(0, 2, 1, 3)
    qk = q @ k
    qk = qk + mask[:n_ctx, :n_ctx]
    qk = qk.float()
    w = F.softmax(qk, dim=-1).to(q.dtype)
    return (w @ v).permute(0, 2, 1, 3).flatten(start_dim=2)


def _whisper_openai(B, H, Hkv, S, D, dt):
    q, k, v = (x.transpose(1, 2).reshape(B, S, H * D) for x in qkv(B, H, H, S, S, D, dt))
    n_ctx = max(448, S)
    mask = torch.empty(n_ctx, n_ctx).fill_(-float("inf")).triu_(1)
    return q, k, v, mask, H


# ---- T5 ---------------------------------------------------------------------------------------------------------------
def _t5_relative_position_bucket(relative_position, bidirectional=True, num_buckets=32, max_distance=128):
    relative_buckets = 0
    if bidirectional:
        num_buckets //= 2
        relative_buckets += (relative_position > 0).to(torch.long) * num_buckets
        relative_position = torch.abs(relative_position)
    else:
        relative_position = -torch.min(relative_position, torch.zeros_like(relative_position))
    max_exact = num_buckets // 2
    is_small = relative_position < max_exact
    relative_position_if_large = max_exact + (
        torch.log(relative_position.float() / max_exact)
        / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)
    ).to(torch.long)
    relative_position_if_large = torch.min(
        relative_position_if_large, torch.full_like(relative_position_if_large, num_buckets - 1))
    relative_buckets += torch.where(is_small, relative_position, relative_position_if_large)
    return relative_buckets


def t5_encoder_attention(q, k, v, relative_attention_bias, attention_mask):
    """huggingface/transformers models/t5/modeling_t5.py T5Attention (encoder: bucketed bias, no scaling, fp32 softmax)."""
    batch_size, n_heads, seq_length, d_kv = q.shape
    key_length = k.shape[2]
    scores = torch.matmul(q, k.transpose(3, 2))
    context_position = torch.arange(seq_length, dtype=torch.long, device=q.device)[:, None]
    memory_position = torch.arange(key_length, dtype=torch.long, device=q.device)[None, :]
    relative_position = memory_position - context_position
    relative_position_bucket = _t5_relative_position_bucket(relative_position, bidirectional=True)
    values = F.embedding(relative_position_bucket, relative_attention_bias)
    position_bias = values.permute([2, 0, 1]).unsqueeze(0)
    extended = attention_mask[:, None, None, :].to(dtype=scores.dtype)
    extended = (1.0 - extended) * torch.finfo(scores.dtype).min
    position_bias = position_bias + extended[:, :, :, :key_length]
    scores += position_bias
    attn_weights = F.softmax(scores.float(), dim=-1).type_as(scores)
    attn_output = torch.matmul(attn_weights, v)
    return attn_output.transpose(1, 2).contiguous().view(batch_size, -1, n_heads * d_kv)


# ---- Swin ----------------------------------------------------------------------------------------------------------
SWIN_WINDOW = (7, 10)


def swin_window_attention(q, k, v, relative_position_bias_table, relative_position_index, mask):
    """microsoft/Swin-Transformer models/swin_transformer.py WindowAttention (q * scale, bias table gather, shift mask)."""
    B_, num_heads, N, head_dim = q.shape
    scale = head_dim ** -0.5
    q = q * scale
    attn = q @ k.transpose(-2, -1)
    relative_position_bias = relative_position_bias_table[relative_position_index.view(-1)].view(
        SWIN_WINDOW[0] * SWIN_WINDOW[1], SWIN_WINDOW[0] * SWIN_WINDOW[1], -1)
    relative_position_bias = relative_position_bias.permute(2, 0, 1).contiguous()
    attn = attn + relative_position_bias.unsqueeze(0)
    nW = mask.shape[0]
    attn = attn.view(B_ // nW, nW, num_heads, N, N) + mask.unsqueeze(1).unsqueeze(0)
    attn = attn.view(-1, num_heads, N, N)
    attn = attn.softmax(dim=-1)
    return (attn @ v).transpose(1, 2).reshape(B_, N, num_heads * head_dim)


def _swin(B, H, Hkv, S, D, dt):
    Wh, Ww = SWIN_WINDOW
    N = Wh * Ww                                   # 70 tokens per window, whatever S is
    coords = torch.stack(torch.meshgrid([torch.arange(Wh), torch.arange(Ww)], indexing="ij"))
    coords_flatten = torch.flatten(coords, 1)
    relative_coords = (coords_flatten[:, :, None] - coords_flatten[:, None, :]).permute(1, 2, 0).contiguous()
    relative_coords[:, :, 0] += Wh - 1
    relative_coords[:, :, 1] += Ww - 1
    relative_coords[:, :, 0] *= 2 * Ww - 1
    index = relative_coords.sum(-1)
    table = (torch.randn((2 * Wh - 1) * (2 * Ww - 1), H) * 0.5).to(dt)
    # the shifted-window mask of a 14 x 20 image (4 windows), shift (3, 5)
    Hp, Wp, sh, sw = 2 * Wh, 2 * Ww, Wh // 2, Ww // 2
    img_mask = torch.zeros((1, Hp, Wp, 1))
    cnt = 0
    for hs in (slice(0, -Wh), slice(-Wh, -sh), slice(-sh, None)):
        for ws in (slice(0, -Ww), slice(-Ww, -sw), slice(-sw, None)):
            img_mask[:, hs, ws, :] = cnt
            cnt += 1
    mw = img_mask.view(1, Hp // Wh, Wh, Wp // Ww, Ww, 1).permute(0, 1, 3, 2, 4, 5).reshape(-1, N)
    attn_mask = mw.unsqueeze(1) - mw.unsqueeze(2)
    attn_mask = attn_mask.masked_fill(attn_mask != 0, -100.0).masked_fill(attn_mask == 0, 0.0).to(dt)
    nW = attn_mask.shape[0]
    return qkv(B * nW, H, H, N, N, D, dt) + (table, index, attn_mask)


# ---- MPT ALiBi -------------------------------------------------------------------------------------------------------
def _mpt_gen_slopes(n_heads, alibi_bias_max=8, device=None):
    _n_heads = 2 ** math.ceil(math.log2(n_heads))
    m = torch.arange(1, _n_heads + 1, dtype=torch.float32, device=device)
    m = m.mul(alibi_bias_max / _n_heads)
    slopes = 1.0 / torch.pow(2, m)
    if _n_heads != n_heads:
        slopes = torch.concat([slopes[1::2], slopes[::2]])[:n_heads]
    return slopes.view(1, n_heads, 1, 1)


def mpt_alibi_attention(query, key, value, n_heads):
    """mosaicml/llm-foundry llmfoundry/models/layers/attention.py scaled_multihead_dot_product_attention + build_alibi_bias."""
    b, s_q, _ = query.shape
    s_k = key.size(1)
    q = query.view(b, s_q, n_heads, -1).permute(0, 2, 1, 3)           # b s (h d) -> b h s d
    k = key.view(b, s_k, n_heads, -1).permute(0, 2, 3, 1)             # b s (h d) -> b h d s
    v = value.view(b, s_k, n_heads, -1).permute(0, 2, 1, 3)
    min_val = torch.finfo(q.dtype).min
    softmax_scale = 1 / math.sqrt(q.size(-1))
    attn_weight = q.matmul(k) * softmax_scale
    alibi_bias = torch.arange(1 - s_k, 1, dtype=torch.int32, device=q.device).view(1, 1, 1, s_k)
    alibi_bias = (alibi_bias * _mpt_gen_slopes(n_heads, 8, device=q.device)).to(dtype=q.dtype)
    _s_q = max(0, alibi_bias.size(2) - s_q)
    _s_k = max(0, alibi_bias.size(3) - s_k)
    attn_bias = alibi_bias[:, :, _s_q:, _s_k:]
    attn_weight = attn_weight + attn_bias
    s = max(s_q, s_k)
    causal_mask = attn_weight.new_ones(s, s, dtype=torch.float16)
    causal_mask = causal_mask.tril()
    causal_mask = causal_mask.to(torch.bool)
    causal_mask = ~causal_mask
    causal_mask = causal_mask[-s_q:, -s_k:]
    attn_weight = attn_weight.masked_fill(causal_mask.view(1, 1, s_q, s_k), min_val)
    attn_weight = torch.softmax(attn_weight, dim=-1)
    out = attn_weight.to(v.dtype).matmul(v)
    return out.permute(0, 2, 1, 3).reshape(b, s_q, -1)                # b h s d -> b s (h d)


def _mpt(B, H, Hkv, S, D, dt):
    return tuple(x.transpose(1, 2).reshape(B, S, H * D) for x in qkv(B, H, H, S, S, D, dt)) + (H,)


# ---- Baichuan2 ALiBi ---------------------------------------------------------------------------------------------------
def _baichuan_get_interleave(n):
    def _get_interleave_power_of_2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        ratio = start
        return [start * ratio ** i for i in range(n)]

    if math.log2(n).is_integer():
        return _get_interleave_power_of_2(n)
    closest_power_of_2 = 2 ** math.floor(math.log2(n))
    return (_get_interleave_power_of_2(closest_power_of_2)
            + _baichuan_get_interleave(2 * closest_power_of_2)[0::2][: n - closest_power_of_2])


def _baichuan_fill_with_neg_inf(t):
    return t.float().fill_(float("-inf")).type_as(t)


def baichuan2_alibi_attention(q, k, v):
    """baichuan-inc/Baichuan2-13B-Base modeling_baichuan.py (_gen_alibi_mask with -inf triu, torch.max clamp to finfo.min)."""
    n_head, max_pos = q.shape[1], k.shape[2]
    slopes = torch.Tensor(_baichuan_get_interleave(n_head)).to(q.device)
    position_point = torch.arange(max_pos, device=q.device) - max_pos + 1
    position_point = position_point.unsqueeze(0).unsqueeze(0).expand(n_head, -1, -1)
    diag = torch.diag(position_point[0])
    position_point = position_point - diag.unsqueeze(0).unsqueeze(0).transpose(-1, -2)
    alibi = slopes.unsqueeze(1).unsqueeze(1) * position_point
    alibi = alibi.view(n_head, 1, max_pos)
    alibi_mask = torch.triu(_baichuan_fill_with_neg_inf(torch.zeros([max_pos, max_pos], device=q.device)), 1)
    alibi_mask = (alibi_mask.unsqueeze(0) + alibi).to(q.dtype)
    q_len = q.shape[2]
    attention_mask = alibi_mask[:, :q_len, :max_pos]
    attn_weights = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(q.shape[-1])
    attn_weights = attn_weights + attention_mask.unsqueeze(0)
    attn_weights = torch.max(attn_weights, torch.tensor(torch.finfo(attn_weights.dtype).min, device=q.device))
    attn_weights = torch.nn.functional.softmax(attn_weights, dim=-1)
    return torch.matmul(attn_weights, v)


# ---- BLOOM ALiBi --------------------------------------------------------------------------------------------------------
def bloom_attention(q, k, v, attention_mask):
    """huggingface/transformers models/bloom/modeling_bloom.py (build_alibi_tensor from cumsum, baddbmm, bool mask + finfo.min)."""
    batch_size, q_length, num_heads, head_dim = q.shape
    kv_length = k.shape[1]
    closest_power_of_2 = 2 ** math.floor(math.log2(num_heads))
    base = torch.tensor(2 ** (-(2 ** -(math.log2(closest_power_of_2) - 3))), device=q.device, dtype=torch.float32)
    powers = torch.arange(1, 1 + closest_power_of_2, device=q.device, dtype=torch.int32)
    slopes = torch.pow(base, powers)
    if closest_power_of_2 != num_heads:
        extra_base = torch.tensor(2 ** (-(2 ** -(math.log2(2 * closest_power_of_2) - 3))), device=q.device,
                                  dtype=torch.float32)
        num_remaining_heads = min(closest_power_of_2, num_heads - closest_power_of_2)
        extra_powers = torch.arange(1, 1 + 2 * num_remaining_heads, 2, device=q.device, dtype=torch.int32)
        slopes = torch.cat([slopes, torch.pow(extra_base, extra_powers)], dim=0)
    arange_tensor = ((attention_mask.cumsum(dim=-1) - 1) * attention_mask)[:, None, :]
    alibi = slopes[..., None] * arange_tensor
    alibi = alibi.reshape(batch_size * num_heads, 1, kv_length).to(q.dtype)
    # _prepare_attn_mask: causal | padding, True means "masked"
    seq_ids = torch.arange(q_length, device=q.device)
    causal_mask = (seq_ids[:, None] < seq_ids[None, :])[None, None, :, :].expand(batch_size, 1, q_length, kv_length)
    expanded_mask = ~(attention_mask[:, None, None, :].to(torch.bool))
    causal_mask = expanded_mask.expand(batch_size, 1, q_length, kv_length) | causal_mask
    query_layer = q.transpose(1, 2).reshape(batch_size * num_heads, q_length, head_dim)
    key_layer = k.permute(0, 2, 3, 1).reshape(batch_size * num_heads, head_dim, kv_length)
    value_layer = v.transpose(1, 2).reshape(batch_size * num_heads, kv_length, head_dim)
    matmul_result = alibi.baddbmm(batch1=query_layer, batch2=key_layer, beta=1.0, alpha=1.0 / math.sqrt(head_dim))
    attention_scores = matmul_result.view(batch_size, num_heads, q_length, kv_length)
    input_dtype = attention_scores.dtype
    if input_dtype == torch.float16:
        attention_scores = attention_scores.to(torch.float)
    attn_weights = torch.masked_fill(attention_scores, causal_mask, torch.finfo(attention_scores.dtype).min)
    attention_probs = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(input_dtype)
    attention_probs_reshaped = attention_probs.view(batch_size * num_heads, q_length, kv_length)
    context_layer = torch.bmm(attention_probs_reshaped, value_layer)
    x = context_layer.view(batch_size, num_heads, q_length, head_dim).permute(0, 2, 1, 3)
    return x.reshape(batch_size, q_length, num_heads * head_dim)


# ---- Falcon ---------------------------------------------------------------------------------------------------------
def falcon_mqa_attention(q, k, v):
    """tiiuae/falcon-7b modelling_RW.py Attention (one KV head expanded, bool mask turned into -1e9 float)."""
    batch_size, q_length, num_heads, head_dim = q.shape
    query_layer = q.transpose(1, 2).reshape(batch_size * num_heads, q_length, head_dim)
    key_layer = k.transpose(1, 2).expand(-1, num_heads, -1, -1).reshape(batch_size * num_heads, -1, head_dim)
    value_layer = v.transpose(1, 2).expand(-1, num_heads, -1, -1).reshape(batch_size * num_heads, -1, head_dim)
    kv_length = key_layer.shape[1]
    seq_ids = torch.arange(q_length, device=q.device)
    attention_mask = (seq_ids[:, None] < seq_ids[None, :])[None, None, :, :]
    query_layer_ = query_layer.reshape(batch_size, num_heads, -1, head_dim)
    key_layer_ = key_layer.reshape(batch_size, num_heads, -1, head_dim)
    value_layer_ = value_layer.reshape(batch_size, num_heads, -1, head_dim)
    attention_mask_float = (attention_mask * 1.0).masked_fill(attention_mask, -1e9).to(q.dtype)
    attention_scores = query_layer_ @ key_layer_.transpose(-1, -2)
    attention_scores /= math.sqrt(head_dim)
    attention_scores = F.softmax(attention_scores + attention_mask_float, dim=-1, dtype=q.dtype)
    attn_output = attention_scores @ value_layer_
    attn_output = attn_output.view(batch_size, num_heads, q_length, head_dim).permute(0, 2, 1, 3)
    return attn_output.reshape(batch_size, q_length, num_heads * head_dim)


# ---- Mistral ----------------------------------------------------------------------------------------------------------
MISTRAL_SLIDING_WINDOW = 16


def mistral_attention(q, k, v):
    """huggingface/transformers v4.34 models/mistral/modeling_mistral.py (repeat_kv, log of a tril/triu band as the mask)."""
    bsz, num_heads, q_len, head_dim = q.shape
    num_key_value_groups = num_heads // k.shape[1]
    key_states = _repeat_kv(k, num_key_value_groups)
    value_states = _repeat_kv(v, num_key_value_groups)
    tensor = torch.full((q_len, q_len), fill_value=1, device=q.device)
    mask = torch.tril(tensor, diagonal=0)
    mask = torch.triu(mask, diagonal=-MISTRAL_SLIDING_WINDOW)
    mask = torch.log(mask).to(q.dtype)
    attention_mask = mask[None, None, :, :].expand(bsz, 1, q_len, q_len)
    attn_weights = torch.matmul(q, key_states.transpose(2, 3)) / math.sqrt(head_dim)
    attn_weights = attn_weights + attention_mask
    attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(q.dtype)
    attn_output = torch.matmul(attn_weights, value_states)
    return attn_output.transpose(1, 2).contiguous()


# ---- Gemma 2 ------------------------------------------------------------------------------------------------------------
GEMMA2_SOFTCAP = 50.0
GEMMA2_SLIDING_WINDOW = 16
GEMMA2_QUERY_PRE_ATTN_SCALAR = 256


def gemma2_attention(q, k, v, attention_mask):
    """huggingface/transformers models/gemma2/modeling_gemma2.py (sliding window folded into the 4-D mask, tanh softcap 50)."""
    min_dtype = torch.finfo(q.dtype).min
    sliding_window_mask = torch.tril(torch.ones_like(attention_mask, dtype=torch.bool),
                                     diagonal=-GEMMA2_SLIDING_WINDOW)
    attention_mask = torch.where(sliding_window_mask, min_dtype, attention_mask)
    n_rep = q.shape[1] // k.shape[1]
    key_states = _repeat_kv(k, n_rep)
    value_states = _repeat_kv(v, n_rep)
    scaling = GEMMA2_QUERY_PRE_ATTN_SCALAR ** -0.5
    attn_weights = torch.matmul(q, key_states.transpose(2, 3)) * scaling
    attn_weights = attn_weights / GEMMA2_SOFTCAP
    attn_weights = torch.tanh(attn_weights)
    attn_weights = attn_weights * GEMMA2_SOFTCAP
    causal_mask = attention_mask[:, :, :, : key_states.shape[-2]]
    attn_weights = attn_weights + causal_mask
    attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(q.dtype)
    attn_output = torch.matmul(attn_weights, value_states)
    return attn_output.transpose(1, 2).contiguous()


def _causal_4d(B, S, dt):
    m = torch.full((S, S), torch.finfo(dt).min, dtype=dt).triu(1)
    return m[None, None].expand(B, 1, S, S).clone()


# ---- gpt-oss ----------------------------------------------------------------------------------------------------------
GPT_OSS_SLIDING_WINDOW = 16


def gpt_oss_reference_sdpa(Q, K, V, S):
    """openai/gpt-oss gpt_oss/torch/model.py sdpa (batch-less [T, Hkv, q_mult, D], -inf band, sink column)."""
    n_tokens, n_heads, q_mult, d_head = Q.shape
    sm_scale = 1 / math.sqrt(d_head)
    K = K[:, :, None, :].expand(-1, -1, q_mult, -1)
    V = V[:, :, None, :].expand(-1, -1, q_mult, -1)
    S = S.reshape(n_heads, q_mult, 1, 1).expand(-1, -1, n_tokens, -1)
    mask = torch.triu(Q.new_full((n_tokens, n_tokens), -float("inf")), diagonal=1)
    mask += torch.tril(mask.new_full((n_tokens, n_tokens), -float("inf")), diagonal=-GPT_OSS_SLIDING_WINDOW)
    QK = torch.einsum("qhmd,khmd->hmqk", Q, K)
    QK *= sm_scale
    QK += mask[None, None, :, :]
    QK = torch.cat([QK, S], dim=-1)
    W = torch.softmax(QK, dim=-1)
    W = W[..., :-1]
    attn = torch.einsum("hmqk,khmd->qhmd", W, V)
    return attn.reshape(n_tokens, -1)


def _gpt_oss_ref(B, H, Hkv, S, D, dt):
    return (torch.randn(S, Hkv, H // Hkv, D, dtype=dt), torch.randn(S, Hkv, D, dtype=dt),
            torch.randn(S, Hkv, D, dtype=dt), torch.randn(H, dtype=dt))


def gpt_oss_hf_attention(q, k, v, attention_mask, sinks):
    """huggingface/transformers models/gpt_oss/modeling_gpt_oss.py eager_attention_forward (sinks concat, max subtract)."""
    n_rep = q.shape[1] // k.shape[1]
    key_states = _repeat_kv(k, n_rep)
    value_states = _repeat_kv(v, n_rep)
    scaling = q.shape[-1] ** -0.5
    attn_weights = torch.matmul(q, key_states.transpose(2, 3)) * scaling
    causal_mask = attention_mask[:, :, :, : key_states.shape[-2]]
    attn_weights = attn_weights + causal_mask
    sinks = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[-2], -1)
    combined_logits = torch.cat([attn_weights, sinks], dim=-1)
    combined_logits = combined_logits - combined_logits.max(dim=-1, keepdim=True).values
    probs = F.softmax(combined_logits, dim=-1, dtype=combined_logits.dtype)
    scores = probs[..., :-1]
    attn_output = torch.matmul(scores, value_states)
    return attn_output.transpose(1, 2).contiguous()


def _gpt_oss_hf(B, H, Hkv, S, D, dt):
    i = torch.arange(S)
    keep = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - GPT_OSS_SLIDING_WINDOW)
    mask = torch.zeros(S, S, dtype=dt).masked_fill(~keep, torch.finfo(dt).min)[None, None].expand(B, 1, S, S)
    return qkv(B, H, Hkv, S, S, D, dt) + (mask.clone(), torch.randn(H, dtype=dt))


def granite_swa_attention(query, key, value, attention_mask, sinks):
    """huggingface/transformers models/granite_swa/modeling_granite_swa.py eager_attention_forward: a per-head
    sink applied after the attention as sigmoid(logsumexp(logits) - sink), in float32."""
    key_states = _repeat_kv(key, query.shape[1] // key.shape[1])
    value_states = _repeat_kv(value, query.shape[1] // key.shape[1])
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * query.shape[-1] ** -0.5
    attn_weights = attn_weights + attention_mask
    lse = torch.logsumexp(attn_weights, dim=-1)
    sink_scale = (lse - sinks.view(1, -1, 1)).to(torch.float32).sigmoid()
    attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_output = torch.matmul(attn_weights, value_states)
    attn_output = attn_output * sink_scale.unsqueeze(-1).to(attn_output.dtype)
    return attn_output.transpose(1, 2).contiguous()


def inkling2_attention(query, key, value, attention_mask, sinks):
    """huggingface/transformers models/inkling2/modeling_inkling2.py eager_attention_forward: a sink logit
    projected from every token ([B, H, S, 1]) is one more softmax column, dropped afterwards."""
    key_states = _repeat_kv(key, query.shape[1] // key.shape[1])
    value_states = _repeat_kv(value, query.shape[1] // key.shape[1])
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * query.shape[-1] ** -0.5
    attn_weights = attn_weights + attention_mask
    combined_logits = torch.cat([attn_weights, sinks], dim=-1).float()
    attn_weights = F.softmax(combined_logits, dim=-1)[..., :-1].to(query.dtype)
    attn_output = torch.matmul(attn_weights, value_states)
    return attn_output.transpose(1, 2).contiguous()


def _inkling2(B, H, Hkv, S, D, dt):
    args = _gpt_oss_hf(B, H, Hkv, S, D, dt)
    return args[:4] + (torch.randn(B, H, S, 1, dtype=dt) * 2,)


# ---- Longformer-like local band ------------------------------------------------------------------------------------
LONGFORMER_ONE_SIDED_WINDOW = 8


def longformer_band_attention(q, k, v, attention_mask):
    """huggingface/transformers models/longformer/modeling_longformer.py LongformerSelfAttention, the chunked band written dense."""
    batch_size, seq_len, num_heads, head_dim = q.shape
    query_vectors = q / math.sqrt(head_dim)
    attn_scores = torch.einsum("bqhd,bkhd->bqhk", query_vectors, k)        # [B, S, H, S] like its [B, S, H, 2w+1]
    pos = torch.arange(seq_len, device=q.device)
    outside = (pos[None, :] - pos[:, None]).abs() > LONGFORMER_ONE_SIDED_WINDOW
    attn_scores = attn_scores.masked_fill(outside[None, :, None, :], -float("inf"))
    is_index_masked = attention_mask == 0
    remove_from_windowed_attention_mask = is_index_masked[:, :, None, None]
    float_mask = remove_from_windowed_attention_mask.type_as(query_vectors).masked_fill(
        remove_from_windowed_attention_mask, torch.finfo(query_vectors.dtype).min)
    attn_scores = attn_scores + float_mask.transpose(1, 3)               # masked keys, [B, 1, 1, S]
    attn_probs = F.softmax(attn_scores, dim=-1, dtype=torch.float32)
    attn_probs = torch.masked_fill(attn_probs, is_index_masked[:, :, None, None], 0.0)
    attn_probs = attn_probs.type_as(attn_scores)
    return torch.einsum("bqhk,bkhd->bqhd", attn_probs, v)


# ---- Llama ----------------------------------------------------------------------------------------------------------------
def llama_attention(query, key, value, attention_mask):
    """huggingface/transformers models/llama/modeling_llama.py eager_attention_forward (4-D float mask argument, GQA)."""
    num_key_value_groups = query.shape[1] // key.shape[1]
    scaling = query.shape[-1] ** -0.5
    key_states = _repeat_kv(key, num_key_value_groups)
    value_states = _repeat_kv(value, num_key_value_groups)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    causal_mask = attention_mask[:, :, :, : key_states.shape[-2]]
    attn_weights = attn_weights + causal_mask
    attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_output = torch.matmul(attn_weights, value_states)
    return attn_output.transpose(1, 2).contiguous()


def _llama(B, H, Hkv, S, D, dt):
    min_dtype = torch.finfo(dt).min
    causal_mask = torch.full((S, S), fill_value=min_dtype, dtype=dt).triu(1)
    causal_mask = causal_mask[None, None, :, :].expand(B, 1, -1, -1).clone()
    pad = _left_padding(B, S)
    padding_mask = causal_mask + pad[:, None, None, :].to(dt)
    padding_mask = padding_mask == 0
    causal_mask = causal_mask.masked_fill(padding_mask, min_dtype)
    return qkv(B, H, Hkv, S, S, D, dt) + (causal_mask,)


# ---- Qwen2 -------------------------------------------------------------------------------------------------------------------
def qwen2_attention(q, k, v):
    """huggingface/transformers models/qwen2/modeling_qwen2.py Qwen2Attention (repeat_kv, torch.full(min).triu(1) causal)."""
    bsz, num_heads, q_len, head_dim = q.shape
    key_states = _repeat_kv(k, num_heads // k.shape[1])
    value_states = _repeat_kv(v, num_heads // v.shape[1])
    kv_seq_len = key_states.shape[-2]
    causal_mask = torch.full((q_len, kv_seq_len), fill_value=torch.finfo(q.dtype).min, dtype=q.dtype, device=q.device)
    causal_mask = torch.triu(causal_mask, diagonal=1)
    attention_mask = causal_mask[None, None, :, :].expand(bsz, 1, -1, -1)
    attn_weights = torch.matmul(q, key_states.transpose(2, 3)) / math.sqrt(head_dim)
    attn_weights = attn_weights + attention_mask
    attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(q.dtype)
    attn_output = torch.matmul(attn_weights, value_states)
    return attn_output.transpose(1, 2).contiguous().reshape(bsz, q_len, num_heads * head_dim)


# ---- Cohere ---------------------------------------------------------------------------------------------------------------
def _cohere_layer_norm(hidden_states, weight, variance_epsilon=1e-5):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    mean = hidden_states.mean(-1, keepdim=True)
    variance = (hidden_states - mean).pow(2).mean(-1, keepdim=True)
    hidden_states = (hidden_states - mean) * torch.rsqrt(variance + variance_epsilon)
    hidden_states = weight.to(torch.float32) * hidden_states
    return hidden_states.to(input_dtype)


def cohere_qk_norm_attention(q, k, v, q_norm_weight, k_norm_weight):
    """huggingface/transformers models/cohere/modeling_cohere.py CohereAttention (per-head q/k LayerNorm on [B,S,H,D], GQA, causal)."""
    bsz, q_len, num_heads, head_dim = q.shape
    query_states = _cohere_layer_norm(q, q_norm_weight).transpose(1, 2)
    key_states = _cohere_layer_norm(k, k_norm_weight).transpose(1, 2)
    value_states = v.transpose(1, 2)
    n_rep = num_heads // key_states.shape[1]
    key_states = _repeat_kv(key_states, n_rep)
    value_states = _repeat_kv(value_states, n_rep)
    mask = torch.full((q_len, q_len), torch.finfo(q.dtype).min, device=q.device)
    mask_cond = torch.arange(mask.size(-1), device=q.device)
    mask.masked_fill_(mask_cond < (mask_cond + 1).view(mask.size(-1), 1), 0)
    mask = mask.to(q.dtype)[None, None, :, :]
    attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * head_dim ** -0.5
    attn_weights = attn_weights + mask
    attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(q.dtype)
    attn_output = torch.matmul(attn_weights, value_states)
    return attn_output.transpose(1, 2).contiguous()


def _cohere(B, H, Hkv, S, D, dt):
    return (qkv(B, H, Hkv, S, S, D, dt, "bshd")
            + ((torch.rand(H, D) + 0.5).to(dt), (torch.rand(Hkv, D) + 0.5).to(dt)))


# ---- Persimmon --------------------------------------------------------------------------------------------------------------
def persimmon_attention(q, k, v, q_ln_weight, q_ln_bias, k_ln_weight, k_ln_bias):
    """huggingface/transformers models/persimmon/modeling_persimmon.py (q/k nn.LayerNorm on [B,S,H,D], fp32 softmax then cast back)."""
    bsz, q_len, num_heads, head_dim = q.shape
    query_states = F.layer_norm(q, (head_dim,), q_ln_weight, q_ln_bias, 1e-5)
    key_states = F.layer_norm(k, (head_dim,), k_ln_weight, k_ln_bias, 1e-5)
    query_states = query_states.transpose(1, 2)
    key_states = key_states.transpose(1, 2)
    value_states = v.transpose(1, 2)
    attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(head_dim)
    causal_mask = torch.full((q_len, q_len), torch.finfo(q.dtype).min, dtype=q.dtype, device=q.device).triu(1)
    attn_weights = attn_weights + causal_mask[None, None, :, :]
    attn_weights = F.softmax(attn_weights, dtype=torch.float32, dim=-1).to(query_states.dtype)
    attn_output = torch.matmul(attn_weights, value_states)
    attn_output = attn_output.transpose(1, 2).contiguous()
    return attn_output.reshape(bsz, q_len, num_heads * head_dim)


def _persimmon(B, H, Hkv, S, D, dt):
    return (qkv(B, H, H, S, S, D, dt, "bshd")
            + tuple(x.to(dt) for x in (torch.rand(D) + 0.5, torch.randn(D) * 0.1, torch.rand(D) + 0.5, torch.randn(D) * 0.1)))


# ---- Perceiver ------------------------------------------------------------------------------------------------------------
PERCEIVER_NUM_LATENTS = 24


def perceiver_cross_attention(q, k, v, attention_mask):
    """huggingface/transformers models/perceiver/modeling_perceiver.py PerceiverSelfAttention (latents -> inputs, inverted mask)."""
    batch_size, num_heads, seq_len, q_head_dim = q.shape
    extended = attention_mask[:, None, None, :].to(dtype=q.dtype)
    extended = (1.0 - extended) * torch.finfo(q.dtype).min
    attention_scores = torch.matmul(q, k.transpose(-1, -2))
    attention_scores = attention_scores / math.sqrt(q_head_dim)
    attention_scores = attention_scores + extended
    attention_probs = torch.nn.Softmax(dim=-1)(attention_scores)
    context_layer = torch.matmul(attention_probs, v)
    context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
    new_context_layer_shape = context_layer.size()[:-2] + (num_heads * v.shape[-1],)
    return context_layer.view(*new_context_layer_shape)


def _perceiver(B, H, Hkv, S, D, dt):
    Skv = S + 13
    return qkv(B, H, H, PERCEIVER_NUM_LATENTS, Skv, D, dt) + (_right_padding(B, Skv),)


# ---- cases ------------------------------------------------------------------------------------------------------------------
def _std(B, H, Hkv, S, D, dt):
    return qkv(B, H, H, S, S, D, dt)


def _gqa(B, H, Hkv, S, D, dt):
    return qkv(B, H, Hkv, S, S, D, dt)


CASES: list[Case] = [
    Case("model_gpt2", gpt2_attention, _std),
    Case("model_nanogpt", nanogpt_attention, _std),
    Case("model_gptj", gptj_attention, _std),
    Case("model_gpt_neox", gpt_neox_attention, _std),
    Case("model_bert", bert_attention,
         lambda B, H, Hkv, S, D, dt: qkv(B, H, H, S, S, D, dt, "bshd") + (_right_padding(B, S),)),
    Case("model_clip_text", clip_text_attention,
         lambda B, H, Hkv, S, D, dt: _rank3(B, H, S, S, D, dt) + (_right_padding(B, S),)),
    Case("model_whisper_cross", whisper_cross_attention,
         lambda B, H, Hkv, S, D, dt: _rank3(B, H, S, S + 13, D, dt)),
    Case("model_whisper_openai", whisper_openai_attention, _whisper_openai),
    Case("model_t5_encoder", t5_encoder_attention,
         lambda B, H, Hkv, S, D, dt: _std(B, H, Hkv, S, D, dt) + (torch.randn(32, H, dtype=dt), _right_padding(B, S))),
    Case("model_swin", swin_window_attention, _swin),
    Case("model_mpt_alibi", mpt_alibi_attention, _mpt),
    Case("model_baichuan2_alibi", baichuan2_alibi_attention, _std),
    Case("model_bloom_alibi", bloom_attention,
         lambda B, H, Hkv, S, D, dt: qkv(B, H, H, S, S, D, dt, "bshd") + (_left_padding(B, S),)),
    Case("model_falcon_mqa", falcon_mqa_attention, lambda B, H, Hkv, S, D, dt: qkv(B, H, 1, S, S, D, dt, "bshd")),
    Case("model_mistral_swa", mistral_attention, _gqa),
    Case("model_gemma2", gemma2_attention, lambda B, H, Hkv, S, D, dt: _gqa(B, H, Hkv, S, D, dt) + (_causal_4d(B, S, dt),)),
    Case("model_gpt_oss_reference", gpt_oss_reference_sdpa, _gpt_oss_ref),
    Case("model_gpt_oss_hf", gpt_oss_hf_attention, _gpt_oss_hf),
    Case("model_granite_swa_sink", granite_swa_attention, _gpt_oss_hf),
    Case("model_inkling2_token_sink", inkling2_attention, _inkling2),
    Case("model_longformer_band", longformer_band_attention,
         lambda B, H, Hkv, S, D, dt: qkv(B, H, H, S, S, D, dt, "bshd") + (_right_padding(B, S),)),
    Case("model_llama_mask_arg", llama_attention, _llama),
    Case("model_qwen2", qwen2_attention, _gqa),
    Case("model_cohere_qk_norm", cohere_qk_norm_attention, _cohere),
    Case("model_persimmon", persimmon_attention, _persimmon),
    Case("model_perceiver_cross", perceiver_cross_attention, _perceiver),
]
