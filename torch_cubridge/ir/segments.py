"""Keys and values concatenated inside the spec, read in place as their pieces.

A spec that joins its KV cache and the new token's key (`torch.cat([k_cache, k_new], dim=2)`), or
prepends memory key/values, makes the prologue copy the whole cache on every call: at 32k keys the
copy cost twice the kernel's own read. Where K's and V's prologue steps are that concatenation along
the keys, the decode kernel reads each piece where it lies (decode_kernel.cuh's SegKV): the pieces
themselves are still the spec's own values, computed by PyTorch (a view of an argument costs
nothing; a piece the prologue computes, RoPE on the new key, is computed as before).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .program import Operand, Program

MAX_PIECES = 4  # SegKV::kMax


@dataclass(frozen=True)
class KVSegments:
    """K's and V's pieces in order along the keys: ("@arg", path) or ("@step", name) each."""
    k: tuple
    v: tuple

    def steps(self) -> set[str]:
        """The prologue steps that make a piece."""
        return {x[1] for x in self.k + self.v if x[0] == "@step"}


def segment_operands(p: Program) -> KVSegments | None:
    """K and V as pieces, where both are a prologue concatenation along their key axis; else None."""
    steps = {s.name: s for s in p.prologue}
    k, v = _pieces(p.k, steps), _pieces(p.v, steps)
    return KVSegments(k, v) if k is not None and v is not None else None


def _pieces(op: Operand, steps: dict[str, Any]) -> tuple | None:
    st = steps.get(op.step) if op.step else None
    if st is None or st.op != "aten.cat.default" or not st.args:
        return None
    pieces = st.args[0]
    dim = st.args[1] if len(st.args) > 1 else dict(st.kwargs).get("dim", 0)
    if not (isinstance(pieces, tuple) and 1 < len(pieces) <= MAX_PIECES and isinstance(dim, int)):
        return None
    if not all(isinstance(x, tuple) and len(x) == 2 and x[0] in ("@arg", "@step") for x in pieces):
        return None
    return pieces if dim % len(op.dims) == op.dims.index("s") else None
