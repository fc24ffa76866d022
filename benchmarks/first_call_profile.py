"""Where a cold first call spends its time (cProfile), at a benchmark shape on the GPU.
Usage: python benchmarks/first_call_profile.py [variant] [S] [D]"""
from __future__ import annotations

import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
import torch_cubridge as tc  # noqa: E402
from variants import SPECS  # noqa: E402

name, S, D = (sys.argv[1:] + ["causal", "4096", "128"][len(sys.argv) - 1:])[:3]
S, D = int(S), int(D)
print(torch.cuda.get_device_name(), flush=True)
torch.zeros(1, device="cuda")
import torch_cubridge.pipeline  # noqa: E402,F401  (imports are not the first call's cost)
q, k, v = (torch.randn(32768 // S, 16, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
f = tc.compile(SPECS[name], fallback="raise")
pr = cProfile.Profile()
t0 = time.perf_counter()
pr.enable()
f(q, k, v)
torch.cuda.synchronize()
pr.disable()
print(f"first call {time.perf_counter() - t0:.2f} s, served {dict(f.served)}", flush=True)
pstats.Stats(pr).sort_stats("cumulative").print_stats(45)
pstats.Stats(pr).sort_stats("tottime").print_stats(15)
