"""The launch rules, written once: the Python runner calls these functions, and the C host module gets
the same functions rendered from this source (build/cgen.py, into the header build/host.py generates; see
ops/host_header.py). Edit a rule here and both paths change; tests/ops/test_launch_rules.py holds the two
renderings equal over a grid of inputs.

Each rule is a plain function of integers in cgen's subset (no imports, no objects): what a call must
satisfy for the kernel to serve it, how a decode call splits its keys, the page-division word.
"""
from __future__ import annotations


def rows_aligned(ptr: int, st: tuple[int, int, int, int]) -> bool:
    """Whether a [B, H, S, D] operand at address `ptr` with element strides `st` (2-byte elements) is read
    where it lies by the kernels' 16-byte copies (cp.async, TMA): D contiguous, and the pointer and every
    other stride on a 16-byte boundary. Otherwise the Python runner reads a dense copy and the C Decoder
    leaves the call to it."""
    return st[3] == 1 and ptr % 16 == 0 and st[0] % 8 == 0 and st[1] % 8 == 0 and st[2] % 8 == 0


def shapes_fit(q: tuple[int, int, int, int], k: tuple[int, int, int, int], v: tuple[int, int, int, int],
               head_dim: int, value_dim: int) -> bool:
    """Whether canonical [B, H, S, D] sizes of q, k and v make one attention call of the kernel built for
    `head_dim` (q, k) and `value_dim` (v): one batch, K and V alike in heads and keys, the query heads a
    multiple of the KV heads."""
    return q[3] == head_dim and k[3] == head_dim and v[3] == value_dim and k[0] == q[0] and v[0] == q[0] \
        and v[1] == k[1] and v[2] == k[2] and k[1] > 0 and q[1] % k[1] == 0


def pool_fits(k_pages: int, v_pages: int) -> bool:
    """Whether pools of `k_pages` and `v_pages` pages can be read through block tables: at least one page
    each (an entry is clamped into the pool: paged.cuh entry_index), and fewer than 2^31 (the kernels read
    table entries in 32 bits)."""
    return 0 < k_pages < 2 ** 31 and 0 < v_pages < 2 ** 31


def page_div(page: int) -> int:
    """PagedKV::page_div for pages of `page` keys (paged.cuh PageDiv), for 0 < page < 2^31: n // page ==
    (umulhi(n, m) + n) >> l for 0 <= n < 2^31, with l = ceil(log2(page)) and m = 2^32 (2^l - page) // page + 1
    (below 2^32), as m | l << 32."""
    log = (page - 1).bit_length()
    return ((1 << 32) * ((1 << log) - page) // page + 1) | log << 32


# Paged decode splits shorter than this many key blocks take one CTA per multiprocessor instead of two (so
# half as many splits, each twice as long). At B 1, 4k keys the rule gave each CTA two blocks, whose first page
# lookups and copies no other work hid: 16 splits of four read 0.875 of contiguous against 0.81-0.84 at pages
# of 16, and 0.96-0.995 against 0.84-0.87 at pages of 256. A floor of four blocks a split instead left 1k keys
# on 32 CTAs (0.68-0.74 against 0.93); one CTA per SM where splits are long already (B 8, or 32k) lost 20%
# (H100).
PAGED_SPLIT_MIN_BLOCKS = 4


def decode_split(ctas: int, n_blk: int, sms: int, per_sm: int = 2, min_blocks: int = 1) -> tuple[int, int]:
    """(splits, key blocks per split) for `ctas` CTAs before splitting on `sms` multiprocessors: at most
    `per_sm` CTAs per multiprocessor, rounded down. One where the ring holds three blocks (lower/tiles.py:
    +1.5% to +14% at batch 1 to 16 against two stages and two CTAs); with two stages, two (64 tiles on 132
    SMs: 4 splits, 256 CTAs, against 5 and 320, which put three on some SMs and two on others: 1.96 against
    1.88 TB/s at 4k, 2.77 against 2.69 at 32k, H100). Filling every resident slot in whole waves instead (up
    to 12 splits of 6 blocks at 4k) was slower, 1.41 against 1.85 TB/s on the H100, since each split pays
    its Q load, warp merge and partial write. `min_blocks`: splits that would read fewer blocks take one
    CTA per multiprocessor."""
    n = max(1, min(n_blk, per_sm * sms // ctas))
    per = -(-n_blk // n)
    if per < min_blocks and per_sm > 1:
        return decode_split(ctas, n_blk, sms, 1)
    return -(-n_blk // per), per


# Every rule the C host module is given, in this order (ops/host_header.py renders them).
RULES = (rows_aligned, shapes_fit, pool_fits, page_div, decode_split)
