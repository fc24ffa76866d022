"""Launch geometry per kernel and head dim; must agree with csrc/cubridge/fwd_config.cuh
(a CPU test parses that header and compares)."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..errors import UnsupportedSpec


@dataclass(frozen=True)
class Tile:
    head_dim: int
    block_m: int
    block_n: int
    warps: int
    stages: int
    kernel: str = "sm80"  # sm80: mma.sync + cp.async (FwdConfig); sm90: wgmma + TMA (Sm90Tile)
    own_o: bool = False  # sm90: O staged in its own buffer, so the next tile's Q loads during the epilogue
    value_dim: int = 0  # V's head dim where it differs from Q's and K's; 0: the same
    persist: bool = False  # sm90: one CTA per SM walks the tiles (Sm90Tile's Persistent)

    @property
    def dv(self) -> int:
        return self.value_dim or self.head_dim

    @property
    def persistent(self) -> bool:
        return self.kernel == "sm90" and self.persist

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def smem_bytes(self) -> int:
        ld, ldv = pad16(self.head_dim) + 8, pad16(self.dv) + 8  # row pitches of Q/K and of V
        if self.kernel == "decode":  # Q and the K/V ring; the warps' merge reuses it (DecodeTile)
            ring = (self.block_m * ld + self.stages * self.block_n * (ld + ldv)) * 2
            return max(ring, self.warps * self.block_m * (pad16(self.dv) + 2) * 4)
        if self.kernel == "sm90":  # alignment slack, Q, K/V rings, O (64-column chunks), barriers, row flags, tile info
            d, dv = pad64(self.head_dim), pad64(self.dv)
            return 1024 + (self.block_m * d + self.stages * self.block_n * (d + dv) + self.own_o * self.block_m * dv) \
                * 2 + 8 * (2 + 4 * self.stages) + 4 * self.block_m + 64
        # FwdValueDim: Q's rows (O staged there: the wider pitch), K and V rings
        return (self.block_m * max(ld, ldv) + self.stages * self.block_n * (ld + ldv)) * 2


# The FA2-class kernel's tile per band of head dims (the wider of Q's and V's rounded up to 32; FwdBand)
TILES = {32: Tile(32, 128, 64, 4, 2), 64: Tile(64, 128, 64, 4, 2), 96: Tile(96, 128, 64, 4, 2),
         128: Tile(128, 128, 64, 4, 2), 160: Tile(160, 128, 64, 8, 2), 192: Tile(192, 128, 64, 8, 2),
         224: Tile(224, 128, 64, 8, 2), 256: Tile(256, 128, 64, 8, 2)}
SMEM_MAX_SM90 = 232448  # bytes of shared memory one CTA may use on Hopper


def value_dim_of(head_dim: int, value_dim: int | None) -> int:
    """V's head dim: the query's unless given (the one place that rule lives)."""
    return head_dim if value_dim is None else value_dim


def pad16(n: int) -> int:
    """A head dim padded to whole k16 steps (FwdTile::kPadD, DecodeTile::kPadD): the padded columns are zero."""
    return -(-n // 16) * 16


def head_dim_ok(n: int) -> bool:
    """The head dims every kernel takes: steps of 8 up to 256."""
    return n % 8 == 0 and 8 <= n <= 256


def padded_head_dims(head_dim: int, value_dim: int) -> tuple[int, int] | None:
    """The head dims a kernel takes for head dims off the step of 8 (30, 36 and 60 in Swin2SR and MobileViT): each
    rounded up to a multiple of 8, the call's q, k and v zero-padded to them (zero columns add nothing to q.k
    and give V zero columns, cut from the output). None where no padding is needed or none reaches a kernel."""
    if all(head_dim_ok(n) for n in (head_dim, value_dim)) or not all(0 < n <= 256 for n in (head_dim, value_dim)):
        return None
    return -(-head_dim // 8) * 8, -(-value_dim // 8) * 8


def pad64(n: int) -> int:
    """A head dim padded to whole 64-column TMA chunks (Sm90Tile::kPadD)."""
    return -(-n // 64) * 64


def sm90_tile(head_dim: int, value_dim: int | None = None, plain_scores: bool = False) -> Tile | None:
    """Hopper (sm_90a): one producer and two or three consumer warpgroups of 64 query rows, for head
    dims in steps of 8 up to 256 (Dv may differ). Three consumers (192 rows) where both head dims pad
    to 64 and the scores are plain (no mask, the default score): a narrow tile has half the math per
    byte of K and V, and a third warpgroup's GEMMs fill the tensor cores while the other two run their
    softmax (+12% at D 64, +20% at D 32, full, 4k, H100). With a mask or a score hook, two: the
    consumers' 160 registers a thread then spill, and 192-row tiles have more partial blocks (-5 to
    -21% on causal, sliding, softcap, ALiBi, document). Keys per block: 128, or 80 where a padded head
    dim passes 128 (the O accumulator and the scores share 240 registers a thread). An O buffer where
    shared memory has room (not D 256). Persistent only where O is at most 128 wide: ptxas spills 88-248
    bytes in the tile loop past that (sm_90a, -Xptxas -v: Dv 160, 192, 256), and without an O buffer the
    next tile's Q waits for the epilogue anyway."""
    dv = value_dim_of(head_dim, value_dim)
    if not all(head_dim_ok(n) for n in (head_dim, dv)):
        return None
    wide = max(pad64(head_dim), pad64(dv)) > 128
    consumers = 3 if plain_scores and max(pad64(head_dim), pad64(dv)) == 64 else 2
    t = Tile(head_dim, 64 * consumers, 80 if wide else 128, 4 * (1 + consumers), 2, "sm90", True,
             0 if dv == head_dim else dv, persist=pad64(dv) <= 128)
    if t.smem_bytes <= SMEM_MAX_SM90:
        return t
    t = replace(t, own_o=False, persist=False)  # O staged in Q's rows: only as wide as them
    return t if pad64(dv) <= pad64(head_dim) and t.smem_bytes <= SMEM_MAX_SM90 else None


def tile_for(head_dim: int, arch: str = "sm_90", value_dim: int | None = None, plain_scores: bool = False) -> Tile:
    """The Hopper kernel where the arch has wgmma (sm_90a) and a tile fits the head dims; else FA2-class.
    `plain_scores`: the program has no mask and the default score (sm90_tile says why that matters)."""
    dv = value_dim_of(head_dim, value_dim)
    if arch == "sm_90a":
        t = sm90_tile(head_dim, dv, plain_scores)
        if t is not None:
            return t
    for n in (head_dim, dv):
        if not head_dim_ok(n):
            raise UnsupportedSpec(f"head dim {n} has no kernel configuration on {arch}: the kernels take "
                                  "head dims in steps of 8 up to 256", op="lower")
    return replace(TILES[fwd_band(head_dim, dv)], head_dim=head_dim, value_dim=0 if dv == head_dim else dv)


def fwd_band(head_dim: int, value_dim: int) -> int:
    """The FA2-class kernel's band of head dims (fwd_config.cuh's fwd_band, the same rule): the wider of
    Q's and V's rounded up to 32; a V wider than Q takes 8 warps at least (band 160)."""
    band = -(-max(head_dim, value_dim) // 32) * 32
    return max(band, 160) if value_dim > head_dim else band


# The fewest rows a TMA box of paged K/V may have in the Hopper kernel; smaller pieces are gathered by the
# prologue. A box costs its issuing thread about the same however few rows it holds: with the producer warp's
# lanes issuing them, boxes of 16 rows ran at 0.73-0.75 of contiguous K/V and beat gathering (1.05-1.92x),
# boxes of 8 at 0.53, below gathering at Sq 2048 (0.76x; H100).
PAGED_TMA_ROWS = 16


def paged_tma_rows(page: int, block_n: int) -> int | None:
    """Rows of the Hopper kernel's TMA boxes over K/V pages (paged.cuh's page_box_rows: the largest piece
    dividing both the page and the key block, so no box crosses a page); None where that is under
    PAGED_TMA_ROWS, and the prologue gathers the pages instead."""
    rows = math.gcd(page, block_n)
    return rows if rows >= PAGED_TMA_ROWS else None


def pages_in_place(page: int, tile: Tile) -> bool:
    """Whether a prefill kernel of `tile` reads pages of `page` rows in place (else the prologue gathers
    them): the Hopper kernel in boxes of PAGED_TMA_ROWS rows or more; the FA2-class kernel pages of whole key
    blocks. Every CTA of a key block's queries and heads reads the block, so the FA2 kernel's row-by-row walk
    of smaller pages repeats its table reads where one gather pays them once (H100 under
    CUBRIDGE_KERNEL=sm80, B 4, Sq 512, 32k keys: pages of 8 and 16 at 0.95-0.96x the gathered kernel, 256 at
    1.71x)."""
    if tile.kernel == "sm90":
        return paged_tma_rows(page, tile.block_n) is not None
    return page % tile.block_n == 0


# Decode (decode_kernel.cuh, DecodeTile): 16 packed (query head, query) rows per CTA, 64-key blocks,
# 4 warps, split-KV, head dims in steps of 8. Three K/V blocks in the ring, with the split rule's one CTA
# per multiprocessor (ops/splitkv.py): against two stages and two CTAs, +1.5% to +14% at batch 1, 4, 8 and
# 16, 4k and 32k keys (H100, D 128). Two past a padded head dim of 160, where the third stage's addressing
# spilled registers (192 and 224, -Xptxas -v), and for K/V read through pages, whose page lookups want two
# CTAs per multiprocessor to hide them (0.745 of contiguous with three stages and one CTA against
# 0.949-0.959 with two and two, pages of 16, 4k, H100; one CTA is what costs it; with the lookups loaded a
# block ahead, still 0.62-0.81), except where the splits are too short for a second CTA to help
# (ops/splitkv.py PAGED_SPLIT_MIN_BLOCKS). Chosen for calls with at most this many queries:
DECODE_MAX_QUERIES = 16


def decode_call(sq: int) -> bool:
    """Whether a call with `sq` queries goes to the decode kernel (where the program allows it)."""
    return sq <= DECODE_MAX_QUERIES


def decode_dims_refusal(head_dim: int, value_dim: int | None = None) -> str | None:
    """Why DecodeTile cannot take these head dims (steps of 8, computed over k16 steps, at most 256); None
    where it can."""
    for d in (head_dim, value_dim_of(head_dim, value_dim)):
        if not head_dim_ok(d):
            return f"the decode kernel takes head dims in steps of 8 up to 256, not {d}"
    return None


def decode_tile(head_dim: int, value_dim: int | None = None, paged: bool = False) -> Tile:
    dv = value_dim_of(head_dim, value_dim)
    why = decode_dims_refusal(head_dim, dv)
    if why:
        raise UnsupportedSpec(why, op="lower")
    stages = 3 if max(pad16(head_dim), pad16(dv)) <= 160 and not paged else 2
    return Tile(head_dim, 16, 64, 4, stages, "decode", value_dim=0 if dv == head_dim else dv)


def decode_ctas_per_sm(tile: Tile) -> int:
    """The decode split rule's CTAs per multiprocessor (ops/splitkv.py decode_split): one with a ring of
    three blocks, two with two (the measurements above)."""
    return 1 if tile.stages >= 3 else 2
