"""Paged-KV decode specs in the styles serving code writes them (shared by the CPU and GPU tests)."""
import math

import torch
import torch.nn.functional as F

from zoo import paged_decode


# Pages [N, Hkv, P, D]; GQA by repeat_interleave; each sequence masked at its own length (the zoo's case).
vllm_heads_first = paged_decode


def flash_slots_first(q, k_cache, v_cache, block_table):
    """flash-attn's paged cache, [N, P, Hkv, D], gathered and flattened; SDPA with enable_gqa."""
    k = k_cache[block_table].flatten(1, 2).transpose(1, 2)  # [B, Hkv, per * P, D]
    v = v_cache[block_table].flatten(1, 2).transpose(1, 2)
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def sliced_to_length(q, k_pages, v_pages, block_table):
    """The gathered cache cut to a fixed length: not a plain page read (the prologue gathers it)."""
    B, H, Sq, D = q.shape
    k = k_pages[block_table].permute(0, 2, 1, 3, 4).reshape(B, H, -1, D)[:, :, :40]
    v = v_pages[block_table].permute(0, 2, 1, 3, 4).reshape(B, H, -1, D)[:, :, :40]
    return (q @ k.transpose(-1, -2) / math.sqrt(D)).softmax(-1) @ v


def pages(B, H, Hkv, S, D, P, dtype, slots_first=False, table_dtype=torch.int64, negative_tail=False):
    """q, K and V pages (a few spare), a shuffled block table and sequence lengths."""
    per = -(-S // P)
    n = B * per + 3
    table = torch.randperm(n)[:B * per].reshape(B, per).to(table_dtype)
    lens = torch.randint(1, per * P + 1, (B,))
    if negative_tail:  # pages past a sequence's length left at -1 (torch indexing reads the last page)
        for b in range(B):
            table[b, -(-int(lens[b]) // P):] = -1
    shape = (n, P, Hkv, D) if slots_first else (n, Hkv, P, D)
    return (torch.randn(B, H, 1, D, dtype=dtype), torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype),
            table, lens)
