"""The spec hash: canonical graph, constants, shapes and dtypes that matter,
version and target. Stable across processes (no ids, no addresses)."""
from __future__ import annotations

import hashlib
import os
from functools import lru_cache
from typing import Any

import torch

from ..version import __version__
from .trace import Captured


def _value_text(v: Any, module_values: bool = True) -> str:
    if isinstance(v, torch.Tensor):
        return f"T{tuple(v.shape)}{v.dtype}"
    if isinstance(v, torch.nn.Module):
        simple = {k: x for k, x in sorted(vars(v).items()) if isinstance(x, (int, float, bool, str))}
        return f"M{type(v).__name__}{simple if module_values else ''}"
    return repr(v)


@lru_cache(maxsize=1)
def package_digest() -> str:
    """This package's Python source: a verdict recorded by other code is not this code's verdict."""
    h = hashlib.sha256()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    files = []  # plain strings, not pathlib: this runs in a warm process's first call (17 ms on the H100 host)
    for here, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        files += [os.path.join(here, n) for n in names if n.endswith(".py")]
    for rel, f in sorted((os.path.relpath(f, root).replace(os.sep, "/"), f) for f in files):
        h.update(rel.encode())
        with open(f, "rb") as fh:
            h.update(fh.read())
    return h.hexdigest()[:16]


def spec_hash(cap: Captured, target: str = "", module_values: bool = True) -> str:
    """module_values=False: the trace hash, blind to module arguments' plain attributes (layer_idx): the
    modules of a model's layers give one trace hash where their traces are one graph."""
    h = hashlib.sha256()
    h.update(f"torch_cubridge {__version__} {package_digest()} torch {torch.__version__} target={target}\n".encode())
    h.update(cap.graph.code.encode())  # canonical aten graph; literals included
    for name, t in sorted(cap.constants.items()):
        h.update(name.encode())
        t = t.detach().cpu().contiguous()
        h.update(str((tuple(t.shape), t.dtype)).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    for path, v in sorted(cap.example.items()):
        h.update(f"{path}={_value_text(v, module_values)}\n".encode())
    return h.hexdigest()[:32]
