"""Kernels built ahead of serving, with no GPU (`cubridge build`): the variants a serving process may try.

They land in the disk cache under the keys a serving process computes for the same arch and dtype, so
its first call builds nothing (it still verifies on its GPU).
"""
from __future__ import annotations

from typing import Any, Callable

from ..ir.program import Program


def build_variants(p: Program, bound: dict[str, Any], arch: str, program_key: str,
                   progress: Callable[[str], None]) -> list[dict]:
    """Build the kernels a serving process chooses for a call of `p` with `bound` on `arch`, fast tanh first
    then exact, in its order; one record each (its cache key, whether it was built, how long it took)."""
    from ..lower import lower
    from ..lower.choice import choose_kernel
    from ..ops.kernel import load_kernel
    c = choose_kernel(p, bound, arch)  # as a serving process chooses
    out = []
    for fast in (True, False):
        low = lower(p, choice=c, fast_tanh=fast)
        dims = f"head dim {c.head_dim}" + (f", value head dim {c.value_dim}" if c.value_dim != c.head_dim else "")
        progress(f"building {low.kernel} for {arch} ({dims}{', decode' if c.decode else ''})")
        _, info, _ = load_kernel(low, arch)  # builds into the cache; nothing is loaded on a GPU
        out.append({"key": info["key"], "built": info["built"], "seconds": info["seconds"],
                    "kernel": low.kernel, "program": program_key})
        if not low.fast_tanh:
            break
    return out
