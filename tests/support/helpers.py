"""fp64 comparison helpers shared by the tests."""
from __future__ import annotations

import torch


def rel_err(out, ref) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    nan = torch.isnan(ref)
    if nan.any():  # rows the spec leaves undefined: the program writes 0
        assert (out[nan] == 0).all()
        out, ref = out.masked_fill(nan, 0), ref.masked_fill(nan, 0)
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def to64(args):
    return tuple(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)


def graph_replay(f, *args):
    """f(*args) captured in a CUDA graph and replayed once; the captured output, synchronised."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = f(*args)
    g.replay()
    torch.cuda.synchronize()
    return out


def first(x):
    return x[0] if isinstance(x, tuple) else x


def count_captures(monkeypatch) -> list:
    """A list that gains an item at every capture the pipeline makes from now on (the real capture still runs)."""
    import torch_cubridge.pipeline as pipeline
    calls: list = []
    real = pipeline.capture
    monkeypatch.setattr(pipeline, "capture", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls
