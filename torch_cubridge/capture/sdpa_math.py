"""A pure-PyTorch SDPA substituted during capture, so SDPA calls flow
through the same graph analysis as hand-written attention."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..errors import UnsupportedSpec


def sdpa_math(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False):
    if dropout_p and dropout_p > 0:
        raise UnsupportedSpec(f"dropout_p={dropout_p} is random; only inference (0.0) compiles",
                              op="scaled_dot_product_attention")
    Sq, Skv, D = query.shape[-2], key.shape[-2], query.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    if enable_gqa and key.dim() == 4 and key.shape[-3] != query.shape[-3]:
        rep = query.shape[-3] // key.shape[-3]
        key = key[:, :, None].expand(key.shape[0], key.shape[1], rep, Skv, D).reshape(key.shape[0], -1, Skv, D)
        value = value[:, :, None].expand(value.shape[0], value.shape[1], rep, Skv, value.shape[-1]).reshape(
            value.shape[0], -1, Skv, value.shape[-1])
    s = torch.matmul(query, key.transpose(-2, -1)) * scale
    if is_causal:  # SDPA's causal mask is aligned top-left
        keep = torch.arange(Sq, device=query.device)[:, None] >= torch.arange(Skv, device=query.device)[None, :]
        s = s.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            s = s.masked_fill(~attn_mask, float("-inf"))
        else:
            s = s + attn_mask
    return torch.matmul(torch.softmax(s, dim=-1), value)


class SdpaAsMath(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return sdpa_math(*args, **kwargs)
        return func(*args, **kwargs)
