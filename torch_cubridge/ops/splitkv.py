"""The decode kernel's split-KV: how many chunks of keys a call's tiles split into (the C Decoder,
csrc/host/decoder.h, applies the same rule, and tests/test_decoder_gpu.py holds its launches to this one's
bit for bit), and the scratch the chunks' partial O and LSE go to before the last chunk of a tile merges them
(decode_kernel.cuh)."""
from __future__ import annotations

import functools
import struct

import torch

_U64 = struct.Struct("<Q").pack


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# Paged decode splits shorter than this many key blocks take one CTA per multiprocessor instead of two (so
# half as many splits, each twice as long). At B 1, 4k keys the rule gave each CTA two blocks, whose first page
# lookups and copies no other work hid: 16 splits of four read 0.875 of contiguous against 0.81-0.84 at pages
# of 16, and 0.96-0.995 against 0.84-0.87 at pages of 256. A floor of four blocks a split instead left 1k keys
# on 32 CTAs (0.68-0.74 against 0.93); one CTA per SM where splits are long already (B 8, or 32k) lost 20%
# (H100, NOTES v29 runs 15-16)
PAGED_SPLIT_MIN_BLOCKS = 4


def decode_split(ctas: int, n_blk: int, sms: int, per_sm: int = 2, min_blocks: int = 1) -> tuple[int, int]:
    """(splits, key blocks per split) for `ctas` CTAs before splitting on `sms` multiprocessors: at most
    `per_sm` CTAs per multiprocessor, rounded down. One where the ring holds three blocks (lower/tiles.py:
    +1.5% to +14% at batch 1 to 16 against two stages and two CTAs, NOTES v24); with two stages, two (64
    tiles on 132 SMs: 4 splits, 256 CTAs, against 5 and 320, which put three on some SMs and two on others:
    1.96 against 1.88 TB/s at 4k, 2.77 against 2.69 at 32k, H100, NOTES v17). Measured on the H100 (NOTES
    v8): filling every resident slot in whole waves instead (up to 12 splits of 6 blocks at 4k) was slower,
    1.41 against 1.85 TB/s, since each split pays its Q load, warp merge and partial write. The C Decoder
    (csrc/host/decoder.h) applies the same rule; tests/test_decoder_gpu.py holds its launches to this one's
    bit for bit. `min_blocks`: splits that would read fewer blocks take one CTA per multiprocessor."""
    n = max(1, min(n_blk, per_sm * sms // ctas))
    per = -(-n_blk // n)
    if per < min_blocks and per_sm > 1:
        return decode_split(ctas, n_blk, sms, 1)
    return -(-n_blk // per), per


NO_SCRATCH = (_U64(0), _U64(0), _U64(0))


class Scratch:
    """A decode launch's fp32 partials and int32 split counters, with their pointers as kernel words."""

    def __init__(self, o_rows: int, l_rows: int, tiles: int, dev: torch.device) -> None:
        self.o = torch.empty(o_rows, dtype=torch.float32, device=dev)
        self.lse = torch.empty(l_rows, dtype=torch.float32, device=dev)
        self.counters = torch.zeros(max(tiles, 1024), dtype=torch.int32, device=dev)
        self.o_rows, self.l_rows, self.n_counters = o_rows, l_rows, self.counters.numel()
        self.words = (_U64(self.o.data_ptr()), _U64(self.lse.data_ptr()), _U64(self.counters.data_ptr()))
