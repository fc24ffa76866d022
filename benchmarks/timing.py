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


def best_host_us(fn: Callable[[], object], n: int = 200, rounds: int = 20, warmup: int = 50) -> float:
    """Host time per call: rounds of n calls without a sync (they fit in the launch queue, so the GPU's
    own time does not enter), a sync between rounds; the best round, in microseconds."""
    import torch
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return best


def backend_times(row: dict, backends: tuple[str, ...], time_one: Callable[[str], float]) -> None:
    """row["sdpa_<backend>_ms"] = time_one(backend) for each backend; None, with the error beside it, where
    the backend does not take the shape."""
    for be in backends:
        try:
            row[f"sdpa_{be}_ms"] = time_one(be)
        except Exception as e:  # backend unavailable for this shape
            row[f"sdpa_{be}_ms"] = None
            row[f"sdpa_{be}_error"] = str(e)[:200]
