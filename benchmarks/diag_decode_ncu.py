"""One decode call each of ours, SDPA-flash and SDPA-cuDNN inside a profiler range, for ncu
(benchmarks/ncu_decode.sh): where the decode kernel's last percent to SDPA-flash goes.

Usage: ncu --profile-from-start off ... python benchmarks/diag_decode_ncu.py [--B 8] [--skv 32768]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import gqa_decode, sdpa, tc  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, default=8)
    ap.add_argument("--skv", type=int, default=32768)
    a = ap.parse_args()
    q = torch.randn(a.B, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(a.B, 8, a.skv, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    f = tc.compile(gqa_decode, fallback="raise")
    for _ in range(3):
        f(q, k, v)
        sdpa("flash", q, k, v)
        sdpa("cudnn", q, k, v)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    f(q, k, v)
    sdpa("flash", q, k, v)
    sdpa("cudnn", q, k, v)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
