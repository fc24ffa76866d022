"""The spec hash: canonical graph, constants, shapes and dtypes that matter,
version and target. Stable across processes (no ids, no addresses)."""
from __future__ import annotations

import hashlib
from typing import Any

import torch

from ..version import __version__
from .trace import Captured


def _value_text(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"T{tuple(v.shape)}{v.dtype}"
    if isinstance(v, torch.nn.Module):
        simple = {k: x for k, x in sorted(vars(v).items()) if isinstance(x, (int, float, bool, str))}
        return f"M{type(v).__name__}{simple}"
    return repr(v)


def spec_hash(cap: Captured, target: str = "") -> str:
    h = hashlib.sha256()
    h.update(f"torch_cubridge {__version__} target={target}\n".encode())
    h.update(cap.graph.code.encode())  # canonical aten graph; literals included
    for name, t in sorted(cap.constants.items()):
        h.update(name.encode())
        t = t.detach().cpu().contiguous()
        h.update(str((tuple(t.shape), t.dtype)).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    for path, v in sorted(cap.example.items()):
        h.update(f"{path}={_value_text(v)}\n".encode())
    return h.hexdigest()[:32]
