"""The decode kernel's split-KV scratch: where the chunks' partial O and LSE go before the last chunk of a
tile merges them (decode_kernel.cuh). How many chunks a call splits into is a launch rule
(rules.decode_split, which the C Decoder shares)."""
from __future__ import annotations

import functools
import struct

import torch

_U64 = struct.Struct("<Q").pack


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


NO_SCRATCH = (_U64(0), _U64(0), _U64(0))


class Scratch:
    """A decode launch's fp32 partials and int32 split counters, with their pointers as kernel words."""

    def __init__(self, o_rows: int, l_rows: int, tiles: int, dev: torch.device) -> None:
        self.o = torch.empty(o_rows, dtype=torch.float32, device=dev)
        self.lse = torch.empty(l_rows, dtype=torch.float32, device=dev)
        self.counters = torch.zeros(max(tiles, 1024), dtype=torch.int32, device=dev)
        self.o_rows, self.l_rows, self.n_counters = o_rows, l_rows, self.counters.numel()
        self.words = (_U64(self.o.data_ptr()), _U64(self.lse.data_ptr()), _U64(self.counters.data_ptr()))
