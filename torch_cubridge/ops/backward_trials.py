"""The redrawn cases a backward kernel's first check runs besides the call's own inputs, as the forward's GPU
verification does (verify/gpu.py): the same shapes (odd lengths, a short and a long query side) and, where the
program reads a mask over (query, key), the structured ones (whole rows and whole tiles masked, finite fills).
The call's own inputs alone let a kernel wrong only on partial tiles, or on rows that keep no key, serve.

The cases are drawn from the first call that wanted gradients: `keep_example` holds its bound arguments with
q, k and v replaced by their shapes (meta tensors), and the first backward check of the program draws from it
and lets it go.
"""
from __future__ import annotations

from typing import Any, Iterator

import torch

# the redrawn cases' magnitude: unit normal. The forward's second (scores 16x larger) tests the softmax's range;
# for the backward it makes rows nearly one-hot, where dQ and dK are small against the rounding of P and delta:
# these cases are for tiles and masks, not range
MAGNITUDES = (1.0,)
STRUCTURED_CAP = 200  # the structured cases' lengths, as the forward's verification caps them


def keep_example(p: Any, bound: dict[str, Any]) -> dict[str, Any]:
    """`bound` with the q, k and v it passes in replaced by meta tensors of their shapes and dtypes (the cases
    draw their own; the caller's activations are not held): the rest (masks, ids, modules, scalars) as is."""
    qkv = {op.arg for op in (p.q, p.k, p.v) if not op.step}
    return {path: torch.empty(x.shape, dtype=x.dtype, device="meta") if path in qkv and isinstance(x, torch.Tensor)
            else x for path, x in bound.items()}


def cases(p: Any, example: dict[str, Any], dtype: torch.dtype, device: torch.device
          ) -> Iterator[tuple[dict[str, Any], str]]:
    """(bound arguments on `device` in `dtype`, a line naming the case) for each redrawn case."""
    from ..verify.cpu import trials
    from ..verify.gpu import gpu_shapes, to_device
    from ..verify.inputs import make_inputs
    from ..verify.reference import module_copies
    try:
        drawn = trials(p, example, gpu_shapes(p, example), MAGNITUDES, STRUCTURED_CAP)
    except Exception:  # no cases (the check stays the call's own inputs'): never the kernel's fault
        return
    with module_copies():
        for i, (sizes, mag, pattern) in enumerate(drawn):
            try:  # a case that cannot be drawn is skipped: no fault of the kernel's
                bound = make_inputs(p, example, sizes, seed=7000 + i, magnitude=mag, dtype=dtype, pattern=pattern,
                                    device=device)
            except Exception:
                continue
            what = f"a redrawn case (B {sizes['B']}, Sq {sizes['Sq']}, Skv {sizes['Skv']}, magnitude {mag}" + \
                   (f", structured mask {pattern})" if pattern is not None else ")")
            yield to_device(bound, device), what
