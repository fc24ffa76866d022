"""Why a program is not generic in the sequence length on this machine: generalize's probes, with
the exception each raises. Usage: python benchmarks/diag_generic.py [variant]"""
from __future__ import annotations

import sys
import traceback
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
import importlib  # noqa: E402
g = importlib.import_module("torch_cubridge.transfer.generalize")
from torch_cubridge.capture.trace import capture  # noqa: E402
from torch_cubridge.pipeline import transfer_stage  # noqa: E402
from variants import SPECS  # noqa: E402

name = sys.argv[1] if len(sys.argv) > 1 else "causal"
B, S = (int(x) for x in (sys.argv[2:4] if len(sys.argv) > 3 else (2, 300)))
dev = "cuda" if torch.cuda.is_available() else "cpu"
q, k, v = (torch.randn(B, 16, S, 128, device=dev, dtype=torch.bfloat16) for _ in range(3))
orig = g.make_inputs


def traced(p, example, sizes, **kw):
    b = orig(p, example, sizes, **kw)
    try:
        capture(SPECS[name], b)
    except Exception:
        print("probe", sizes, "capture raised:\n", traceback.format_exc()[-1500:])
    return b


g.make_inputs = traced
res = transfer_stage(SPECS[name], {"q": q, "k": k, "v": v})
p = getattr(res, "program", None)
print(type(res).__name__, "requires", getattr(p, "requires", None), "generic", getattr(res, "generic", None))
if p is not None:
    from torch_cubridge.verify.cpu import verify_shapes
    from torch_cubridge.verify.gpu import gpu_shapes
    ex = {"q": q, "k": k, "v": v}
    print("cpu shapes", verify_shapes(p, ex, True))
    print("gpu shapes", gpu_shapes(p, ex))
    print("guards", [str(x) for x in p.guards])
    from torch_cubridge.ir.guards import bound_failing
    from torch_cubridge.verify.inputs import make_inputs
    small = dict(verify_shapes(p, ex, True)[0], B=2, Sq=37, Skv=37)
    print("failing at", small, bound_failing(p.guards, make_inputs(p, ex, small, seed=0, values=False)))
