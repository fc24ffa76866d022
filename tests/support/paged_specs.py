"""Paged-KV decode and prefill specs in the styles serving code writes them (shared by the CPU and GPU tests)."""
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


def chunked_prefill(q, k_pages, v_pages, block_table, seq_lens):
    """Chunked prefill: Sq new queries a sequence, their keys already in the pages; query i of sequence b
    sits at position seq_lens[b] - Sq + i and sees the keys up to it."""
    B, H, Sq, D = q.shape
    Hkv = k_pages.shape[1]
    k = k_pages[block_table].permute(0, 2, 1, 3, 4).reshape(B, Hkv, -1, D)
    v = v_pages[block_table].permute(0, 2, 1, 3, 4).reshape(B, Hkv, -1, D)
    pos = seq_lens[:, None] - Sq + torch.arange(Sq, device=q.device)[None, :]        # [B, Sq]
    keep = torch.arange(k.shape[2], device=q.device)[None, None, :] <= pos[:, :, None]  # [B, Sq, S]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None], enable_gqa=True)


def span_dropped(q, k_pages, v_pages, block_table, seq_lens):
    """Each sequence's keys 64 to 199 masked out (a retrieved passage dropped): the key blocks inside the span
    are skipped, so the next block a CTA copies is not the one after its last."""
    B, H, Sq, D = q.shape
    Hkv = k_pages.shape[1]
    k = k_pages[block_table].permute(0, 2, 1, 3, 4).reshape(B, Hkv, -1, D)
    v = v_pages[block_table].permute(0, 2, 1, 3, 4).reshape(B, Hkv, -1, D)
    kv = torch.arange(k.shape[2], device=q.device)[None, :]
    keep = (kv < seq_lens[:, None]) & ((kv < 64) | (kv >= 200))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :], enable_gqa=True)


def pages(B, H, Hkv, S, D, P, dtype, slots_first=False, table_dtype=torch.int64, negative_tail=False, sq=1):
    """q (`sq` queries), K and V pages (a few spare), a shuffled block table and sequence lengths (at
    least `sq`)."""
    per = -(-S // P)
    n = B * per + 3
    table = torch.randperm(n)[:B * per].reshape(B, per).to(table_dtype)
    lens = torch.randint(min(sq, per * P), per * P + 1, (B,))
    if negative_tail:  # pages past a sequence's length left at -1 (torch indexing reads the last page)
        for b in range(B):
            table[b, -(-int(lens[b]) // P):] = -1
    shape = (n, P, Hkv, D) if slots_first else (n, Hkv, P, D)
    return (torch.randn(B, H, sq, D, dtype=dtype), torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype),
            table, lens)


def serve(fn, args, kernel, in_place=True):
    """fn compiled and called on the GPU: served by `kernel` ("decode", "sm90") with K and V read from their
    pages in place (or gathered), the output against float64. (compiled fn, the CUDA args, the output)"""
    import torch_cubridge as tc
    from helpers import assert_rows_close, to64
    f = tc.compile(fn, fallback="raise")
    cuda = tuple(a.cuda() for a in args)
    out = f(*cuda)
    torch.cuda.synchronize()
    assert f.served["spec"] == 0, [e.reasons or e.reason for e in f.entries()]
    r = f.kernels()[-1]
    assert r.low.tile.kernel == kernel
    assert (r.low.paged and r.paged is not None) == in_place
    assert_rows_close(out, fn(*to64(args)), out.dtype)  # each query row: a wrong page shows in its rows
    return f, cuda, out


def second_call(f, cuda, fn, rewrite):
    """The cache changes between calls (cuda[rewrite] redrawn in place): the kernel reads it again where it
    lies; the second output against float64."""
    from helpers import assert_rows_close, to64
    cuda[rewrite].normal_()
    out = f(*cuda)
    assert_rows_close(out, fn(*to64(tuple(t.cpu() for t in cuda))), out.dtype)


def pool_wrapped(q, k_pages, v_pages, block_table, seq_lens):
    """Negative table entries counted from the pool's end by the spec itself: it reads the page count N
    (an op's argument, with no decision made on it)."""
    table = torch.where(block_table < 0, block_table + k_pages.shape[0], block_table)
    return paged_decode(q, k_pages, v_pages, table, seq_lens)


def pool_flattened(q, k_pages, v_pages, block_table, seq_lens):
    """The pool reshaped to one list of rows ([N * P, Hkv, D]) and each sequence's rows gathered by index:
    the reshape reads the pool's page count N."""
    B, H, Sq, D = q.shape
    N, Hkv, P, _ = k_pages.shape
    rows = (block_table[:, :, None] * P + torch.arange(P)).flatten(1)  # [B, per * P]
    k, v = (x.transpose(1, 2).reshape(N * P, Hkv, D)[rows].transpose(1, 2).repeat_interleave(H // Hkv, dim=1)
            for x in (k_pages, v_pages))
    keep = torch.arange(k.shape[2])[None, :] < seq_lens[:, None]
    s = (q @ k.transpose(-1, -2)) / math.sqrt(D)
    return s.masked_fill(~keep[:, None, None, :], float("-inf")).softmax(-1) @ v


def pool_weighted(q, k_pages, v_pages, block_table, seq_lens):
    """Each page's keys scaled by a weight from a vector over the pool that the spec makes (N rows): the
    page count reaches only a shape, with no decision made on it."""
    w = 1 + torch.ones(k_pages.shape[0]).cumsum(0) / 100
    return paged_decode(q, k_pages * w[:, None, None, None], v_pages, block_table, seq_lens)
