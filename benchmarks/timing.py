"""Host time per call: calls back to back with one clock around them and no sync inside, so a call's
cost is what the host spends launching it (the GPU runs behind)."""
from __future__ import annotations

import time
from typing import Callable


def host_us(fn: Callable[[], object], n: int, warmup: int) -> float:
    """Microseconds of host time per call of `fn`, over `n` calls after `warmup` unclocked ones."""
    import torch
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    dt = time.perf_counter() - t0
    torch.cuda.synchronize()
    return dt / n * 1e6
