"""Real processes racing: `race` starts `target(*args, barrier, out)` in n spawned processes (fresh interpreters:
nothing of the test's memo or cache), which wait at the barrier together and each put one result on `out`."""
from __future__ import annotations

import multiprocessing as mp
from typing import Any, Callable


def race(target: Callable[..., None], args: tuple, n: int, timeout: float) -> list[Any]:
    """The n results in the order they came, once every process has exited with status 0."""
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, barrier, out)) for _ in range(n)]
    for p in procs:
        p.start()
    got = [out.get(timeout=timeout) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return got
