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
from bench_decode import gqa_decode, paged_gqa_decode, sdpa, tc  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, default=8)
    ap.add_argument("--skv", type=int, default=32768)
    ap.add_argument("--paged", type=int, default=0, help="page size: the paged kernel next to the contiguous one")
    a = ap.parse_args()
    if a.paged:
        return paged(a.B, a.skv, a.paged)
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


def paged(B: int, skv: int, P: int) -> None:
    """The paged decode kernel and the contiguous one on the same keys, pages in random order."""
    per, dev, dt = skv // P, "cuda", torch.bfloat16
    n = B * per + 7
    q = torch.randn(B, 32, 1, 128, device=dev, dtype=dt)
    kp, vp = (torch.randn(n, 8, P, 128, device=dev, dtype=dt) for _ in range(2))
    table = torch.randperm(n, device=dev)[:B * per].reshape(B, per)
    k, v = (x[table].permute(0, 2, 1, 3, 4).flatten(2, 3).contiguous() for x in (kp, vp))
    f, g = tc.compile(paged_gqa_decode, fallback="raise"), tc.compile(gqa_decode, fallback="raise")
    for _ in range(3):
        f(q, kp, vp, table)
        g(q, k, v)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    f(q, kp, vp, table)
    g(q, k, v)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
