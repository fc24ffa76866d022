"""Launch geometry per head dim; must agree with csrc/cubridge/fwd_config.cuh
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

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def smem_bytes(self) -> int:
        return (self.block_m + 2 * self.stages * self.block_n) * (self.head_dim + 8) * 2


TILES = {64: Tile(64, 128, 64, 4, 2), 96: Tile(96, 128, 64, 4, 2), 128: Tile(128, 128, 64, 4, 2),
         256: Tile(256, 128, 64, 8, 2)}


def tile_for(head_dim: int, arch: str = "sm_90") -> Tile:
    if head_dim not in TILES:
        raise UnsupportedSpec(f"head dim {head_dim} has no kernel configuration (64, 96, 128, 256)", op="lower")
    return TILES[head_dim]
