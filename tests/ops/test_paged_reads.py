"""Paged KV read in place (ir/paged.py): the analysis of a spec's gather chain names the pages' dims
and the head mapping, and that reading, done by hand, gives the spec's own gathered keys."""
import pytest
import torch

import paged_specs as ps
from torch_cubridge.capture.trace import bind_example
from torch_cubridge.ir.paged import paged_operands
from torch_cubridge.pipeline import transfer_stage


def _reads(fn, args):
    bound = bind_example(fn, args, {})
    return paged_operands(transfer_stage(fn, bound).program, bound)


def _by_hand(pages, table, r, B, H, S):
    """[B, H, S, D] from the pages as the kernel reads them: pages[table[b, s // P], kv_head(h), s % P]."""
    P = pages.shape[r.slot_dim]
    s = torch.arange(S)
    ent = table[:, s // P].long()
    ent = torch.where(ent < 0, ent + pages.shape[0], ent)
    hkv = pages.shape[r.head_dim] if r.head_dim is not None else 1
    h = torch.arange(H)
    kv_head = h // (H // hkv) if r.head_map == "group" else h % hkv
    idx = [None] * pages.dim()
    idx[0] = ent[:, None, :]                                    # [B, 1, S]
    idx[r.slot_dim] = (s % P)[None, None, :]
    if r.head_dim is not None:
        idx[r.head_dim] = kv_head[None, :, None]                # [1, H, 1]
    idx = [i if i is not None else torch.zeros(1, 1, 1, dtype=torch.long) for i in idx[:-1]]
    return pages[tuple(idx)].expand(B, H, S, -1)                # [B, H, S, D]


@pytest.mark.parametrize("B,H,Hkv,P", [(2, 8, 2, 16), (1, 4, 4, 8), (3, 4, 1, 16)])
def test_heads_first_pages_are_read_as_the_spec_gathers(B, H, Hkv, P):
    args = ps.pages(B, H, Hkv, 70, 16, P, torch.float32)
    got = _reads(ps.vllm_heads_first, args)
    assert got is not None
    k, v = got
    assert (k.pages, v.pages, k.table) == ("k_pages", "v_pages", "block_table")
    assert k.slot_dim == 2 and k.head_dim == (1 if Hkv > 1 else None) and k.heads == H
    q, kp, vp, table, _ = args
    per = table.shape[1]
    want = kp[table].permute(0, 2, 1, 3, 4).reshape(B, Hkv, -1, 16).repeat_interleave(H // Hkv, dim=1)
    assert torch.equal(_by_hand(kp, table, k, B, H, per * P), want)


def test_slots_first_pages_with_an_int32_table_and_negative_entries():
    args = ps.pages(2, 8, 2, 64, 16, 16, torch.float32, slots_first=True, table_dtype=torch.int32,
                    negative_tail=True)
    q, kp, vp, table, _ = args
    got = _reads(ps.flash_slots_first, args[:4])
    assert got is not None
    k, _ = got
    assert (k.slot_dim, k.head_dim, k.heads) == (1, 2, 8)  # SDPA's enable_gqa repeats the KV heads
    want = kp[table.long()].flatten(1, 2).transpose(1, 2).repeat_interleave(4, dim=1)
    assert torch.equal(_by_hand(kp, table, k, 2, 8, table.shape[1] * 16), want)


def test_a_sliced_gather_is_left_to_the_prologue():
    args = ps.pages(2, 4, 4, 64, 16, 16, torch.float32)
    assert _reads(ps.sliced_to_length, args[:4]) is None


@pytest.mark.parametrize("D,DV", [(192, 128), (64, 128)])
def test_value_pages_of_their_own_head_dim_lower_to_the_paged_decode_kernel(D, DV):
    """Multi-head latent attention's cache: V pages narrower (or wider) than K's. The paged decode kernel
    reads each with its own row pitch."""
    from torch_cubridge.lower import lower
    q, kp, vp, table, _ = ps.pages(2, 8, 2, 100, D, 16, torch.float32, slots_first=True)
    vp = torch.randn(*vp.shape[:-1], DV)
    bound = bind_example(ps.flash_slots_first, (q, kp, vp, table), {})
    res = transfer_stage(ps.flash_slots_first, bound)
    assert res.report.ok and paged_operands(res.program, bound) is not None
    src = lower(res.program, "sm_90a", "bfloat16", D, decode=True, value_dim=DV, paged=True).source
    assert f"DecodeTile<{D}, {DV}" in src and "attention_decode<Cfg, Variant, __nv_bfloat16, true, cubridge::PagedKV>" in src


def _choice(fn, args, arch):
    from torch_cubridge.lower.choice import choose_kernel
    bound = bind_example(fn, args, {})
    res = transfer_stage(fn, bound)
    assert res.report.ok
    c = choose_kernel(res.program, bound, arch)
    return res.program, (c.decode, c.reads)


@pytest.mark.parametrize("D,P,rows", [(128, 16, 16), (128, 256, 128), (128, 64, 64), (128, 8, None),
                                      (128, 24, None), (128, 12, None), (256, 160, 80), (256, 256, 16)])
def test_prefill_over_pages_reads_them_in_place_on_hopper_where_the_boxes_fit(D, P, rows):
    """Many queries: the Hopper kernel reads the pages in place, in TMA boxes of the largest piece of the
    page and the key block (80 keys at D 256), where that has 16 rows at least; smaller pieces, and pages
    on an arch without the Hopper kernel, are gathered by the prologue."""
    from torch_cubridge.lower import lower
    from torch_cubridge.lower.tiles import paged_tma_rows
    args = ps.pages(2, 8, 2, 300, D, P, torch.bfloat16, sq=40)
    prog, (decode, reads) = _choice(ps.chunked_prefill, args, "sm_90a")
    assert not decode and (reads is not None) == (rows is not None)
    low = lower(prog, "sm_90a", "bfloat16", D, paged=reads is not None)
    assert paged_tma_rows(P, low.tile.block_n) == rows
    if rows is not None:
        assert "attention_fwd_sm90<Cfg, Variant, __nv_bfloat16, true>(a, p, &tq, &tk, &tv, pg)" in low.source
    # the FA2-class kernel: pages of whole key blocks
    assert (_choice(ps.chunked_prefill, args, "sm_80")[1][1] is not None) == (P % 64 == 0)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_the_fa2_kernel_reads_pages_of_whole_key_blocks(arch):
    """In place where a key block lies in one page; smaller pages are gathered (lower/choice.py says
    why). The kernel itself reads any page (tests/ops/test_paged_prefill_fa2_gpu.py)."""
    from torch_cubridge.lower import lower
    from torch_cubridge.lower.tiles import tile_for
    for P in (2, 8, 24, 64, 256):
        prog, (decode, reads) = _choice(ps.chunked_prefill, ps.pages(2, 8, 2, 300, 64, P, torch.bfloat16,
                                                                               sq=40), arch)
        assert not decode and (reads is not None) == (P % tile_for(64, arch).block_n == 0)
        low = lower(prog, arch, "bfloat16", 64, paged=True)
        assert low.tile.kernel == "sm80" and low.paged
        assert "attention_fwd<Cfg, Variant, __nv_bfloat16, true>(a, p, pg)" in low.source


def test_the_paged_box_rule_is_one_rule_in_python_and_cuda():
    """lower/tiles.py's paged_tma_rows and paged.cuh's page_box_rows: the greatest common divisor of the page
    and the block; the host gathers pages whose boxes would be under PAGED_TMA_ROWS rows."""
    import math
    import re
    from torch_cubridge.config import csrc_dir
    from torch_cubridge.lower.tiles import PAGED_TMA_ROWS, paged_tma_rows
    text = (csrc_dir() / "cubridge" / "paged.cuh").read_text()
    assert re.search(r"int page_box_rows\(int page, int block\) \{\s*while \(block\) \{\s*const int r = page % block;"
                     r"\s*page = block;\s*block = r;\s*\}\s*return page;", text)
    for p in range(1, 300):
        for n in (80, 128):
            g = math.gcd(p, n)
            assert paged_tma_rows(p, n) == (g if g >= PAGED_TMA_ROWS else None)


def test_a_program_holds_at_any_page_pool_size_the_spec_never_reads():
    """A spec that reaches its pages only through the table's entries never reads the pool's page count, so
    it is no guard: one program serves pools of any size (a server sizes its pool from free memory, so a
    restart, or a bundle built elsewhere, meets another). A spec that reads the count keeps it as a guard."""
    import torch_cubridge as tc
    args = ps.pages(2, 8, 2, 70, 16, 16, torch.float32)
    q, kp, vp, table, lens = args
    p = tc.transfer(ps.vllm_heads_first, *args)
    assert not any("k_pages.shape[0]" in str(g) or "v_pages.shape[0]" in str(g) for g in p.guards), p.guards
    assert p.batch and any("q.shape[0]" in str(g) for g in p.guards)  # the batch moves with q's (test_batch_free)
    more = [torch.cat([x, torch.randn(9, *x.shape[1:])]) for x in (kp, vp)]
    want = ps.vllm_heads_first(q.double(), more[0].double(), more[1].double(), table, lens)
    assert (p.run(q, *more, table, lens).double() - want).abs().max() < 1e-4
    # N added to entries (a value); a reshape to N * P rows (decisions); a vector of N weights (a shape only)
    for spec in (ps.pool_wrapped, ps.pool_flattened, ps.pool_weighted):
        reads = tc.transfer(spec, *args)
        assert any("k_pages.shape[0]" in str(g) for g in reads.guards), (spec.__name__, reads.guards)
        with pytest.raises(ValueError, match="holds only where"):
            reads.run(q, *more, table, lens)


def test_page_division_word_divides_exactly():
    """The kernels divide a key index by the page size as (umulhi(n, m) + n) >> l with the host's word
    (ops/pack.py page_div_word, paged.cuh PageDiv): exact for every page size up to 5000, every power of two,
    at the indices where a rounding error would show (multiples of the page and their neighbours) and the
    largest index a table can hold."""
    import random

    from torch_cubridge.ops.pack import page_div_word

    def div(n: int, word: int) -> int:
        m, log = word & 0xFFFFFFFF, word >> 32
        return (((n * m) >> 32) + n) >> log

    rng = random.Random(0)
    pages = list(range(1, 5001)) + [1 << i for i in range(31)] + [rng.randrange(5000, 1 << 30) for _ in range(300)]
    for p in pages:
        w = page_div_word(p)
        assert w & 0xFFFFFFFF and w >> 32 == (p - 1).bit_length()  # the multiplier stays below 2^32
        top = (1 << 31) - 1
        ns = {0, 1, p - 1, p, p + 1, top, top - top % p, top - top % p - 1}
        ns |= {k * p + d for k in (1, 2, 3, 1000, top // p - 1) for d in (-1, 0, 1)}
        ns |= {rng.randrange(0, 1 << 31) for _ in range(20)}
        for n in ns:
            if 0 <= n <= top:
                assert div(n, w) == n // p, (p, n)
    with pytest.raises(ValueError):
        page_div_word(0)
