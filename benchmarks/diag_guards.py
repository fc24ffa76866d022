"""Which symbolic facts pin sizes for a spec at a shape on this machine: each guard the
symbolic trace records that the converter cannot express, and the sizes used as values.
Usage: python benchmarks/diag_guards.py [variant] [B] [S]"""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
G = importlib.import_module("torch_cubridge.capture.guards")
from variants import SPECS  # noqa: E402

name = sys.argv[1] if len(sys.argv) > 1 else "causal"
B, S = (int(x) for x in (sys.argv[2:4] if len(sys.argv) > 3 else (8, 4096)))
dev = "cuda" if torch.cuda.is_available() else "cpu"
bound = {n: torch.empty(B, 16, S, 128, device=dev, dtype=torch.bfloat16) for n in "qkv"}
for meta in (False, True):  # the call's device, then meta fakes: does the device change the facts?
    b = {n: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta") for n, t in bound.items()} \
        if meta else bound
    tr = G.symbolic_trace(SPECS[name], b, list(b))
    if tr is None:
        print("meta" if meta else dev, "trace failed")
        continue
    gm, env, owner = tr
    where = {s: G.dim(p, d) for s, (p, d) in owner.items()}
    print("meta" if meta else dev, "value symbols", sorted(map(str, G._value_symbols(gm))))
    print("  owner:", {str(k): v for k, v in owner.items()})
    print("  replacements:", {str(k): str(v) for k, v in env.replacements.items()})
    print("  var_to_range (narrowed):", {str(k): str(v) for k, v in env.var_to_range.items()
                                         if str(v) not in ("VR[2, int_oo]", "VR[0, int_oo]")})
    for g in env.guards:
        print("  guard:", str(g.expr)[:300])
    print("  size_guards ->", [str(x)[:120] for x in (G.size_guards(SPECS[name], b, (("q", 2), ("k", 2))) or ["None"])])
    for g in env.guards:
        try:
            G._to_expr(g.expr, where)
        except G._Opaque as e:
            print("  opaque:", type(g.expr).__name__, str(g.expr)[:300], "|", e)
    print("  deferred asserts:", [str(a.expr)[:200] for v in env.deferred_runtime_asserts.values() for a in v][:5])
    for n in gm.graph.nodes:
        if n.op == "call_function":
            for a in list(n.args) + list(n.kwargs.values()):
                v = a.meta.get("val") if isinstance(a, torch.fx.Node) else None
                if isinstance(v, G._SYM):
                    print("  value arg:", n.target, a.name, v.node.expr)
