"""The decode kernel's launch in C for any sizes (csrc/host/decoder.h), made for one runner.

A decode loop over a growing KV cache changes its key length at every step, so no record of the host
fast path (ops/hotpath.py) ever replays it, and every step took the Python runner (17 us a call on the
H100, of a 35 us drop-in call). A Decoder holds what the runner works out from its program alone and does
the rest of a call in C; a call it does not take as it is returns None and the Python runner serves it.
Made only for runners whose calls need nothing per call but q, k and v (KernelRunner.decodable).
"""
from __future__ import annotations

from typing import Any

import torch

from . import hotpath


SIZES = ("B", "H", "Hkv", "Sq", "Skv", "D")  # the order the Decoder reads a program's required sizes in


def _perm(dims: tuple[str, ...]) -> tuple[int, int, int, int]:
    return tuple(dims.index(c) if c in dims else -1 for c in "bhsd")  # type: ignore[return-value]


def make(runner: Any, device: int, capturing: Any, sm_count: int, ctas_per_sm: int, pages: bytes) -> Any | None:
    """The C Decoder for `runner` on `device`, or None while the host module is not built (or cannot be)."""
    mod = hotpath.module()
    if mod is None:
        return None
    p, tile, kern = runner.p, runner.low.tile, runner.kernel
    out_dims = tuple(tuple("bhsd".index(c) for c in group) for group in runner.plan.out_parts)
    ops = (p.q, p.k, p.v)
    return mod.Decoder(torch.Tensor, runner.dtype, tuple(len(o.dims) for o in ops), tuple(_perm(o.dims) for o in ops),
                       out_dims, runner.head_dim, runner.value_dim, tile.block_m, tile.block_n, kern.handle(device),
                       kern.threads, kern.smem_bytes, device, float(runner._scale_const), runner._params_const, pages,
                       ctas_per_sm, sm_count, torch._C._cuda_getCurrentRawStream, capturing, torch.is_grad_enabled,
                       tuple((SIZES.index(name), val) for name, val in p.requires))
