"""Corpus: layouts the spec rearranges itself. Learned memory key/values joined to the keys (x-transformers,
denoising-diffusion-pytorch), heads packed with the head dim and split by the spec (perceiver-pytorch,
PerceiverIO-style cross-attention), and GPT-2's eager attention over a KV cache with left padding
(transformers). Each docstring says where from; einops' rearrange/repeat are written out as view/permute/expand."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from zoo import Case, qkv   # tests/support/zoo.py is on sys.path when tests run


# ---- learned memory key/values --------------------------------------------------------------------------
NUM_MEM_KV = 4


class MemoryKV(torch.nn.Module):
    """x-transformers Attention's `mem_k`/`mem_v`: nn.Parameter(torch.randn(heads, num_mem_kv, dim_head))."""

    def __init__(self, heads: int, dim_head: int, num_mem_kv: int = NUM_MEM_KV) -> None:
        super().__init__()
        self.mem_k = torch.nn.Parameter(torch.randn(heads, num_mem_kv, dim_head))
        self.mem_v = torch.nn.Parameter(torch.randn(heads, num_mem_kv, dim_head))


class PackedMemoryKV(torch.nn.Module):
    """denoising-diffusion-pytorch Attention's `mem_kv`: nn.Parameter(torch.randn(2, heads, num_mem_kv, dim_head))."""

    def __init__(self, heads: int, dim_head: int, num_mem_kv: int = NUM_MEM_KV) -> None:
        super().__init__()
        self.mem_kv = torch.nn.Parameter(torch.randn(2, heads, num_mem_kv, dim_head))


def xtransformers_mem_kv(module, q, k, v, input_mask):
    """x-transformers: x_transformers.py Attention.forward, num_mem_kv > 0 (repeat 'h n d -> b h n d', cat on
    dim -2, the key padding mask padded with True for the memory), then Attend's einsum and masked_fill."""
    b = k.shape[0]
    mem_k, mem_v = map(lambda t: t.unsqueeze(0).expand(b, *t.shape), (module.mem_k, module.mem_v))
    k = torch.cat((mem_k, k), dim=-2)
    v = torch.cat((mem_v, v), dim=-2)
    input_mask = F.pad(input_mask, (module.mem_k.shape[-2], 0), value=True)
    scale = q.shape[-1] ** -0.5
    sim = torch.einsum("b h i d, b h j d -> b h i j", q, k) * scale
    mask_value = -torch.finfo(sim.dtype).max
    sim = sim.masked_fill(~input_mask[:, None, None, :], mask_value)
    attn = sim.softmax(dim=-1)
    return torch.einsum("b h i j, b h j d -> b h i d", attn, v)


def diffusion_mem_kv(module, q, k, v):
    """denoising-diffusion-pytorch: Attention.forward (mem_kv unbound, repeat 'h n d -> b h n d', cat on dim -2
    through functools.partial), Attend's einsum with q pre-scaled."""
    b = q.shape[0]
    mk, mv = map(lambda t: t.repeat(b, 1, 1, 1), module.mem_kv.unbind(0))
    k, v = (torch.cat(pair, dim=-2) for pair in ((mk, k), (mv, v)))
    q = q * q.shape[-1] ** -0.5
    sim = torch.einsum("b h i d, b h j d -> b h i j", q, k)
    attn = sim.softmax(dim=-1)
    return torch.einsum("b h i j, b h j d -> b h i d", attn, v)


def _mem(B, H, Hkv, S, D, dt):
    lens = torch.randint(1, S + 1, (B,))
    return (MemoryKV(H, D).to(dt),) + qkv(B, H, H, S, S, D, dt) + (torch.arange(S)[None, :] < lens[:, None],)


def _mem_packed(B, H, Hkv, S, D, dt):
    return (PackedMemoryKV(H, D).to(dt),) + qkv(B, H, H, S, S, D, dt)


# ---- heads packed with the head dim ------------------------------------------------------------------------
PERCEIVER_HEADS = 4


def perceiver_pytorch_cross(q, k, v, mask):
    """lucidrains/perceiver-pytorch: perceiver_pytorch.py Attention.forward after to_q / to_kv
    (rearrange 'b n (h d) -> (b h) n d', einsum over (b h), masked_fill with -finfo.max, out back to b n (h d))."""
    h = PERCEIVER_HEADS
    b, n, inner = q.shape

    def split_heads(t):  # rearrange(t, 'b n (h d) -> (b h) n d', h=h)
        return t.reshape(t.shape[0], t.shape[1], h, -1).permute(0, 2, 1, 3).reshape(-1, t.shape[1], inner // h)

    q, k, v = map(split_heads, (q, k, v))
    sim = torch.einsum("b i d, b j d -> b i j", q, k) * (inner // h) ** -0.5
    max_neg_value = -torch.finfo(sim.dtype).max
    mask = mask[:, None, :].expand(b, h, mask.shape[-1]).reshape(b * h, 1, -1)  # repeat 'b j -> (b h) () j'
    sim = sim.masked_fill(~mask, max_neg_value)
    attn = sim.softmax(dim=-1)
    out = torch.einsum("b i j, b j d -> b i d", attn, v)
    return out.reshape(b, h, n, -1).permute(0, 2, 1, 3).reshape(b, n, -1)  # '(b h) n d -> b n (h d)'


class PerceiverAttention(torch.nn.Module):
    """lucidrains/perceiver-pytorch Attention's projections: to_q, to_kv (one Linear, chunked), to_out."""

    def __init__(self, query_dim: int, context_dim: int, heads: int, dim_head: int) -> None:
        super().__init__()
        inner = heads * dim_head
        self.scale, self.heads = dim_head ** -0.5, heads
        self.to_q = torch.nn.Linear(query_dim, inner, bias=False)
        self.to_kv = torch.nn.Linear(context_dim, inner * 2, bias=False)
        self.to_out = torch.nn.Linear(inner, query_dim)


def perceiver_pytorch_module(module, x, context, mask):
    """lucidrains/perceiver-pytorch: perceiver_pytorch.py Attention.forward whole (the latents x attend to the
    context: q from to_q, k and v chunked from to_kv, each split 'b n (h d) -> (b h) n d', out through to_out)."""
    h = module.heads
    q = module.to_q(x)
    k, v = module.to_kv(context).chunk(2, dim=-1)

    def split_heads(t):
        b, n, _ = t.shape
        return t.reshape(b, n, h, -1).permute(0, 2, 1, 3).reshape(b * h, n, -1)

    q, k, v = map(split_heads, (q, k, v))
    sim = torch.einsum("b i d, b j d -> b i j", q, k) * module.scale
    max_neg_value = -torch.finfo(sim.dtype).max
    mask = mask[:, None, :].expand(mask.shape[0], h, mask.shape[-1]).reshape(-1, 1, mask.shape[-1])
    sim = sim.masked_fill(~mask, max_neg_value)
    attn = sim.softmax(dim=-1)
    out = torch.einsum("b i j, b j d -> b i d", attn, v)
    b = x.shape[0]
    out = out.reshape(b, h, out.shape[1], -1).permute(0, 2, 1, 3).reshape(b, out.shape[1], -1)
    return module.to_out(out)


def perceiver_io_view_heads(q, k, v):
    """PerceiverIO-style cross-attention (deepmind perceiver io_processors, HF PerceiverSelfAttention's
    transpose_for_scores): the latent query [b, n, h*d] viewed into heads, keys and values already [b, h, m, d]."""
    b, n, _ = q.shape
    h, d = k.shape[1], k.shape[-1]
    q = q.view(b, n, h, d).permute(0, 2, 1, 3)
    scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(d)
    probs = torch.nn.Softmax(dim=-1)(scores)
    return torch.matmul(probs, v).permute(0, 2, 1, 3).reshape(b, n, h * d)


def folded_query_heads(q, k, v):
    """A query kept as [(b h), n, d] (the output of a rearrange to (b h)) against keys [b, h, m, d]."""
    b, h, m, d = k.shape
    q = q.view(b, h, -1, d)
    s = q @ k.transpose(-1, -2) * d ** -0.5
    return (s.softmax(-1) @ v).reshape(b * h, -1, d)


def _packed_latents(B, H, Hkv, S, D, dt):
    n = 24
    mask = torch.arange(S)[None, :] < torch.randint(1, S + 1, (B,))[:, None]
    return (torch.randn(B, n, PERCEIVER_HEADS * D, dtype=dt),) + tuple(
        torch.randn(B, S, PERCEIVER_HEADS * D, dtype=dt) for _ in range(2)) + (mask,)


def _perceiver_module(B, H, Hkv, S, D, dt):
    mask = torch.arange(S)[None, :] < torch.randint(1, S + 1, (B,))[:, None]
    module = PerceiverAttention(96, 80, PERCEIVER_HEADS, D).to(dt).requires_grad_(False)
    return (module, torch.randn(B, 24, 96, dtype=dt), torch.randn(B, S, 80, dtype=dt), mask)


def _packed_query(B, H, Hkv, S, D, dt):
    _, k, v = qkv(B, H, H, 1, S, D, dt)
    return (torch.randn(B, 24, H * D, dtype=dt), k, v)


def _folded_query(B, H, Hkv, S, D, dt):
    _, k, v = qkv(B, H, H, 1, S, D, dt)
    return (torch.randn(B * H, 24, D, dtype=dt), k, v)


# ---- GPT-2 over a KV cache ------------------------------------------------------------------------------------
GPT2_N_POSITIONS = 1024
GPT2_LAYER_IDX = 3


def gpt2_cached_eager(query, key, value, attention_mask):
    """huggingface/transformers models/gpt2/modeling_gpt2.py eager_attention_forward, with the cache's keys
    (key_length > query_length), scale_attn_by_inverse_layer_idx, and GPT2Model's additive padding mask
    ((1 - mask) * finfo.min on [b, 1, 1, key_length]) sliced to the keys."""
    bias = torch.tril(torch.ones((GPT2_N_POSITIONS, GPT2_N_POSITIONS), dtype=torch.bool, device=query.device)).view(
        1, 1, GPT2_N_POSITIONS, GPT2_N_POSITIONS)
    attention_mask = attention_mask[:, None, None, :].to(dtype=query.dtype)
    attention_mask = (1.0 - attention_mask) * torch.finfo(query.dtype).min
    attn_weights = torch.matmul(query, key.transpose(-1, -2))
    attn_weights = attn_weights / torch.full([], value.size(-1) ** 0.5, dtype=attn_weights.dtype,
                                             device=attn_weights.device)
    attn_weights = attn_weights / float(GPT2_LAYER_IDX + 1)
    query_length, key_length = query.size(-2), key.size(-2)
    causal_mask = bias[:, :, key_length - query_length: key_length, :key_length]
    mask_value = torch.finfo(attn_weights.dtype).min
    mask_value = torch.full([], mask_value, dtype=attn_weights.dtype, device=attn_weights.device)
    attn_weights = torch.where(causal_mask, attn_weights.to(attn_weights.dtype), mask_value)
    causal_mask = attention_mask[:, :, :, : key.shape[-2]]
    attn_weights = attn_weights + causal_mask
    attn_weights = torch.nn.functional.softmax(attn_weights, dim=-1)
    attn_weights = attn_weights.type(value.dtype)
    attn_output = torch.matmul(attn_weights, value)
    return attn_output.transpose(1, 2)


def gpt2_cached_eager_4d(query, key, value, attention_mask):
    """huggingface/transformers models/gpt2/modeling_gpt2.py eager_attention_forward as newer versions call it: the
    model's 4-D additive mask [b, 1, query_length, key_length] (causal and padding, finfo.min) added after the
    layer's own causal torch.where."""
    bias = torch.tril(torch.ones((GPT2_N_POSITIONS, GPT2_N_POSITIONS), dtype=torch.bool, device=query.device)).view(
        1, 1, GPT2_N_POSITIONS, GPT2_N_POSITIONS)
    attn_weights = torch.matmul(query, key.transpose(-1, -2))
    attn_weights = attn_weights / torch.full([], value.size(-1) ** 0.5, dtype=attn_weights.dtype,
                                             device=attn_weights.device)
    query_length, key_length = query.size(-2), key.size(-2)
    causal_mask = bias[:, :, key_length - query_length: key_length, :key_length]
    mask_value = torch.finfo(attn_weights.dtype).min
    mask_value = torch.full([], mask_value, dtype=attn_weights.dtype, device=attn_weights.device)
    attn_weights = torch.where(causal_mask, attn_weights.to(attn_weights.dtype), mask_value)
    causal_mask = attention_mask[:, :, :, : key.shape[-2]]
    attn_weights = attn_weights + causal_mask
    attn_weights = torch.nn.functional.softmax(attn_weights, dim=-1)
    attn_weights = attn_weights.type(value.dtype)
    return torch.matmul(attn_weights, value).transpose(1, 2)


GPT2_QUERIES, GPT2_KEYS = 37, 53


def _gpt2_cached(B, H, Hkv, S, D, dt):
    lens = torch.randint(GPT2_QUERIES, GPT2_KEYS + 1, (B,))  # every row sees at least its own keys
    pad = (torch.arange(GPT2_KEYS)[None, :] >= (GPT2_KEYS - lens)[:, None]).long()
    return qkv(B, H, H, GPT2_QUERIES, GPT2_KEYS, D, dt) + (pad,)


def _gpt2_cached_4d(B, H, Hkv, S, D, dt):
    *qkv_, pad = _gpt2_cached(B, H, Hkv, S, D, dt)
    i = torch.arange(GPT2_QUERIES)[:, None] + GPT2_KEYS - GPT2_QUERIES
    keep = (torch.arange(GPT2_KEYS)[None, :] <= i)[None, None] & pad[:, None, None, :].bool()
    return tuple(qkv_) + (torch.zeros(keep.shape, dtype=dt).masked_fill(~keep, torch.finfo(dt).min),)


CASES: list[Case] = [
    Case("layout_xtransformers_mem_kv", xtransformers_mem_kv, _mem),
    Case("layout_diffusion_mem_kv", diffusion_mem_kv, _mem_packed),
    Case("layout_perceiver_pytorch_packed", perceiver_pytorch_cross, _packed_latents),
    Case("layout_perceiver_pytorch_module", perceiver_pytorch_module, _perceiver_module),
    Case("layout_perceiver_io_view_heads", perceiver_io_view_heads, _packed_query),
    Case("layout_folded_query_heads", folded_query_heads, _folded_query),
    Case("layout_gpt2_kv_cache_left_pad", gpt2_cached_eager, _gpt2_cached),
    Case("layout_gpt2_kv_cache_4d_mask", gpt2_cached_eager_4d, _gpt2_cached_4d),
]
