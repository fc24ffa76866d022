"""Attention written with what comes after it (and before it) in the same function: an output gate,
heads merged and projected, and whole attention modules with their own projections (nanoGPT's
CausalSelfAttention in its style). Shared by the CPU and GPU tests."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def gated_output(q, k, v, gate):
    """A gate on the attention output (gated attention): o * sigmoid(g)."""
    o = torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, -1) @ v
    return o * torch.sigmoid(gate)


def scale_shift(q, k, v):
    o = torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, -1) @ v
    return o * 2.0 + 1.0


def merged_and_projected(q, k, v, w_o):
    """Heads merged into [B, S, H*D], then the output projection."""
    B, H, S, D = q.shape
    s = (q @ k.transpose(-1, -2)) / math.sqrt(D)
    i = torch.arange(S, device=q.device)
    s = s.masked_fill(i[None, :] > i[:, None], float("-inf"))
    o = s.softmax(-1) @ v
    return o.transpose(1, 2).reshape(B, S, H * D) @ w_o


def decode_projected(q, k, v, w_o):
    """A decode step (one query against the cache) with its heads merged and projected."""
    B, H, S, D = q.shape
    o = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D), -1) @ v
    return o.transpose(1, 2).reshape(B, S, H * D) @ w_o


def masked_projected_normed(q, k, v, mask, w_o):
    """An additive mask, then heads merged, projected and layer-normed (BERT's and GIT's attention block):
    a row whose keys are all masked is NaN in the spec, whatever the kernel's zeros become here."""
    B, H, S, D = q.shape
    p = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D) + mask, -1)
    o = (p @ v).permute(0, 2, 1, 3).reshape(B, S, H * D)
    return F.layer_norm(o @ w_o, (H * D,))


def projected_with_weights(q, k, v, w_o, bias):
    """A module's forward that returns (output, attention weights, a bias of its own), as BERT-style
    and GPT-NeoX-Japanese attention modules do."""
    B, H, S, D = q.shape
    p = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D), -1)
    o = (p @ v).transpose(1, 2).reshape(B, S, H * D) @ w_o
    return o, p, bias * 2


def through_star_args(*args):
    """A spec that takes its tensors as *args (a wrapper around a module's forward)."""
    return merged_and_projected(*args)


def separate_projections(x, wq, wk, wv, wo, heads=4):
    """The whole attention from the hidden states: q, k, v projected, causal SDPA, projected out."""
    B, T, C = x.shape
    q = (x @ wq).view(B, T, heads, C // heads).transpose(1, 2)
    k = (x @ wk).view(B, T, heads, C // heads).transpose(1, 2)
    v = (x @ wv).view(B, T, heads, C // heads).transpose(1, 2)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return y.transpose(1, 2).reshape(B, T, C) @ wo


class CausalSelfAttention(nn.Module):
    """nanoGPT's module (its parameters; its forward is the spec below)."""

    def __init__(self, n_embd: int = 64, n_head: int = 4) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head, self.n_embd = n_head, n_embd


def nanogpt_forward(self, x):
    """nanoGPT's CausalSelfAttention.forward, with the module passed in."""
    B, T, C = x.size()
    q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
    k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
    q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
    v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
    y = y.transpose(1, 2).contiguous().view(B, T, C)
    return self.c_proj(y)


def reads_probs_after(q, k, v):
    """Not servable: the result reads the probabilities themselves, which the kernel never writes."""
    p = torch.softmax(q @ k.transpose(-1, -2) * 0.25, -1)
    return (p @ v) * 2 + p.amax(-1, keepdim=True)


def qkv(B: int, H: int, S: int, D: int, dtype: torch.dtype = torch.float32) -> tuple:
    return tuple(torch.randn(B, H, S, D, dtype=dtype) for _ in range(3))


def hidden(B: int, T: int, C: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(B, T, C, dtype=dtype)


def weights(C: int, n: int, dtype: torch.dtype = torch.float32) -> tuple:
    return tuple(torch.randn(C, C, dtype=dtype) * C ** -0.5 for _ in range(n))
