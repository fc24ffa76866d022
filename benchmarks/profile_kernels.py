"""Where one call's GPU time goes: per-kernel device time (torch.profiler) of a compiled variant,
e.g. the document mask's block-class pre-pass against its forward kernel.

Usage: python benchmarks/profile_kernels.py [--plan 4096:128,16384:128] [--variants document,causal]
       ncu --profile-from-start off ... python benchmarks/profile_kernels.py --ncu [--cudnn] ...
Writes profile_kernels.json to $OUT (or --out).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from record import save  # noqa: E402
import torch_cubridge as tc  # noqa: E402
from timing import parse_plan  # noqa: E402
from variants import SPECS, document_ids  # noqa: E402


def inputs(name: str, S: int, D: int, H: int = 16, total: int = 32768):
    B = max(1, total // S)
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    extra = ()
    if name == "document":  # the benchmarks' documents
        extra = (document_ids(B, S, "cuda"),)
    return (q, k, v) + extra


def cudnn_call(name: str, q, k, v) -> None:
    """SDPA's cuDNN backend on the same inputs (full and causal only), the kernel to compare with."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        F.scaled_dot_product_attention(q, k, v, is_causal=name == "causal")


def profile_case(name: str, S: int, D: int, reps: int = 20, ncu: bool = False, cudnn: bool = False) -> dict:
    args = inputs(name, S, D)
    f = tc.compile(SPECS[name], fallback="raise")
    f(*args)
    for _ in range(5):
        f(*args)
    torch.cuda.synchronize()
    if ncu:  # one served call between profiler start and stop (ncu --profile-from-start off)
        if cudnn:
            cudnn_call(name, *args[:3])  # warm: its plan is built outside the profiled range
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        f(*args)
        if cudnn:
            cudnn_call(name, *args[:3])
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        return {"variant": name, "S": S, "D": D, "served": dict(f.served), "us_per_call": {}}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            f(*args)
        torch.cuda.synchronize()
    per = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name] += e.device_time_total / reps
    return {"variant": name, "S": S, "D": D, "served": dict(f.served),
            "us_per_call": {k: round(v, 2) for k, v in sorted(per.items(), key=lambda kv: -kv[1])}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plan", default="4096:128,16384:128")
    ap.add_argument("--variants", default="document,causal")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--ncu", action="store_true", help="only mark one served call for ncu")
    ap.add_argument("--cudnn", action="store_true", help="with --ncu: also one SDPA cuDNN call (full, causal)")
    a = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    rows = []
    for S, D in parse_plan(a.plan):
        for name in a.variants.split(","):
            rows.append(profile_case(name, S, D, ncu=a.ncu, cudnn=a.cudnn))
            print(json.dumps(rows[-1]), flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    save(a.out, "profile_kernels", {"rows": rows})
    for r in rows:
        print(f"{r['variant']:12s} S={r['S']:5d} D={r['D']:3d} " +
              "  ".join(f"{k[:28]} {v:8.1f}us" for k, v in r["us_per_call"].items()))


if __name__ == "__main__":
    main()
