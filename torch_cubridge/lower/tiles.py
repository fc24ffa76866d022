"""Launch geometry per kernel and head dim; must agree with csrc/cubridge/fwd_config.cuh
(a CPU test parses that header and compares)."""
from __future__ import annotations

from dataclasses import dataclass

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

    @property
    def persistent(self) -> bool:
        """sm90: one CTA per SM walks the tiles (Sm90Tile's Persistent). Only with an O buffer: without one
        the next tile's Q waits for the epilogue anyway, and D 256 spilled in the tile loop."""
        return self.kernel == "sm90" and self.own_o

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def smem_bytes(self) -> int:
        if self.kernel == "decode":  # Q and the K/V ring; the warps' merge reuses it (DecodeTile)
            ring = (self.block_m + 2 * self.stages * self.block_n) * (self.head_dim + 8) * 2
            return max(ring, self.warps * self.block_m * (self.head_dim + 2) * 4)
        if self.kernel == "sm90":  # alignment slack, Q, K/V rings (unpadded), O, barriers, row flags, tile info
            return 1024 + (self.block_m + 2 * self.stages * self.block_n + self.own_o * self.block_m) \
                * self.head_dim * 2 + 8 * (2 + 4 * self.stages) + 4 * self.block_m + 64
        return (self.block_m + 2 * self.stages * self.block_n) * (self.head_dim + 8) * 2


TILES = {64: Tile(64, 128, 64, 4, 2), 96: Tile(96, 128, 64, 4, 2), 128: Tile(128, 128, 64, 4, 2),
         256: Tile(256, 128, 64, 8, 2)}
# Hopper (sm_90a): one producer + two consumer warpgroups; D 256 has no room for an O buffer
TILES_SM90 = {64: Tile(64, 128, 128, 12, 2, "sm90", True), 128: Tile(128, 128, 128, 12, 2, "sm90", True),
              256: Tile(256, 128, 80, 12, 2, "sm90", False)}


def tile_for(head_dim: int, arch: str = "sm_90") -> Tile:
    """The Hopper kernel where the arch has wgmma (sm_90a) and a tile fits the head dim; else FA2-class."""
    if arch == "sm_90a" and head_dim in TILES_SM90:
        return TILES_SM90[head_dim]
    if head_dim not in TILES:
        raise UnsupportedSpec(f"head dim {head_dim} has no kernel configuration (64, 96, 128, 256)", op="lower")
    return TILES[head_dim]


# Decode (decode_kernel.cuh, DecodeTile): 16 packed (query head, query) rows per CTA, 64-key blocks,
# 4 warps, 2 stages, split-KV. Chosen for calls with at most this many queries:
DECODE_MAX_QUERIES = 16


def decode_call(sq: int) -> bool:
    """Whether a call with `sq` queries goes to the decode kernel (where the program allows it)."""
    return sq <= DECODE_MAX_QUERIES


def decode_head_dim(head_dim: int) -> bool:
    """DecodeTile's head dims: k16 steps, at most 256."""
    return head_dim % 16 == 0 and head_dim <= 256


def decode_tile(head_dim: int) -> Tile:
    if not decode_head_dim(head_dim):
        raise UnsupportedSpec(f"the decode kernel takes head dims in steps of 16 up to 256, not {head_dim}",
                              op="lower")
    return Tile(head_dim, 16, 64, 4, 2, "decode")
