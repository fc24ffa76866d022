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


def interleaved_ms(fns: dict[str, Callable[[], object]], rounds: int = 3) -> tuple[dict[str, float | None], dict[str, str]]:
    """GPU milliseconds per call of each of `fns`: `rounds` passes over all of them in turn, each a do_bench
    median; the best pass of each. ({name: ms, None where it raised}, {name: error}). In turn, so a clock
    still low after an idle stretch (a first call's CPU verification) does not land on whichever is timed
    first: timed one after the other, the first row of a process read 0.68-0.74 of contiguous where the same
    paged kernel read 0.93-0.95 in later rows (H100)."""
    from triton.testing import do_bench
    best: dict[str, float | None] = {}
    errors: dict[str, str] = {}
    for _ in range(rounds):
        for name, fn in fns.items():
            if name in errors:
                continue
            try:
                ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
            except Exception as e:  # a backend that does not take the shape
                errors[name], best[name] = str(e)[:200], None
                continue
            best[name] = min(best.get(name) or ms, ms)
    return best, errors


FLUSH_BYTES = 256 * 1024 * 1024


def read_flush() -> Callable[[], object]:
    """A call that empties L2 by reading a 256 MB buffer, so the lines it leaves are clean. triton's do_bench
    empties L2 by writing one, and the timed call's first reads then write ~50 MB of dirty lines back inside
    its own time: ~10 us a call for every implementation (H100)."""
    import torch
    buf = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    sink = torch.empty((), dtype=torch.int32, device="cuda")
    return lambda: torch.amax(buf, dim=0, out=sink)


def events_ms(fn: Callable[[], object], flush: Callable[[], object] | None, reps: int = 60) -> float:
    """Median GPU milliseconds of fn, each call alone between CUDA events after `flush` (None: back to back)."""
    import torch
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        if flush is not None:
            flush()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    ms = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    return ms[len(ms) // 2]


def clean_flush_ms(fns: dict[str, Callable[[], object]], rounds: int = 2) -> dict[str, float]:
    """GPU milliseconds per call of each of `fns` after a read flush (events_ms), in turn, the best of `rounds`."""
    flush = read_flush()
    best: dict[str, float] = {}
    for _ in range(rounds):
        for name, fn in fns.items():
            try:
                ms = events_ms(fn, flush)
            except Exception:  # a backend that does not take the shape (interleaved_ms records why)
                continue
            best[name] = min(best.get(name, ms), ms)
    return best


def graph_replay(fn: Callable[[], object]) -> Callable[[], None]:
    """fn captured in a CUDA graph (after a warm-up call on a side stream); its replay."""
    import torch
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def add_tflops(row: dict, flops: float) -> None:
    """row["<name>_tflops"] beside each timing row["<name>_ms"] that ran: `flops` over that many ms."""
    for key in [k for k in row if k.endswith("_ms")]:
        if row[key]:
            row[key.replace("_ms", "_tflops")] = flops / (row[key] * 1e-3) / 1e12


def parse_plan(text: str) -> list[tuple[int, int]]:
    """--plan "S:D,S:D,..." as [(S, D), ...]."""
    return [tuple(map(int, x.split(":"))) for x in text.split(",")]
