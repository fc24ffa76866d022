"""Where paged decode's gap to contiguous comes from (pages of 256 stayed ~6% behind, NOTES v24): the
paged kernel over pages in random order, over pages in order (identity table), and, with one KV head, over
pages in order that are the contiguous cache's own memory (so only the kernel differs), each timed back
to back with the contiguous kernel on the same keys.

Usage: python benchmarks/diag_paged_gap.py [--out DIR] [--pages 16,256] [--lengths 4096,32768]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import bench, gqa_decode, paged_gqa_decode, tc  # noqa: E402


def case(B: int, H: int, Hkv: int, skv: int, P: int, order: str) -> dict:
    per, dev, dt = skv // P, "cuda", torch.bfloat16
    n = B * per
    q = torch.randn(B, H, 1, 128, device=dev, dtype=dt)
    kp, vp = (torch.randn(n, Hkv, P, 128, device=dev, dtype=dt) for _ in range(2))
    table = (torch.randperm(n, device=dev) if order == "random" else torch.arange(n, device=dev)).reshape(B, per)
    if order == "same_memory":  # Hkv 1: the pages in order are a contiguous [B, 1, S, D] cache
        assert Hkv == 1
        k, v = (x.view(B, 1, skv, 128) for x in (kp, vp))
    else:
        k, v = (x[table].permute(0, 2, 1, 3, 4).flatten(2, 3).contiguous() for x in (kp, vp))
    f, g = tc.compile(paged_gqa_decode, fallback="raise"), tc.compile(gqa_decode, fallback="raise")
    out = f(q, kp, vp, table)
    ref = g(q, k, v)
    assert f.served["spec"] == 0 and g.served["spec"] == 0, (f.served, g.served)
    paged_ms, cont_ms = bench(lambda: f(q, kp, vp, table)), bench(lambda: g(q, k, v))
    nbytes = 2 * (2 * B * Hkv * skv * 128 + 2 * B * H * 128)
    return {"B": B, "H": H, "Hkv": Hkv, "Skv": skv, "page": P, "order": order, "paged_ms": paged_ms,
            "contiguous_ms": cont_ms, "paged_tbs": nbytes / paged_ms * 1e-9, "ratio": cont_ms / paged_ms,
            "max_diff_vs_contiguous": float((out.float() - ref.float()).abs().max())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--pages", default="16,256")
    ap.add_argument("--lengths", default="4096")
    a = ap.parse_args()
    print(torch.cuda.get_device_name(), flush=True)
    rows = []
    for skv in map(int, a.lengths.split(",")):
        for P in map(int, a.pages.split(",")):
            for shape, order in (((8, 32, 8), "random"), ((8, 32, 8), "in_order"), ((8, 32, 8), "random"),
                                 ((64, 4, 1), "same_memory"), ((64, 4, 1), "random")):
                rows.append(case(*shape, skv, P, order))
                r = rows[-1]
                print(f"Skv {skv:6d} page {P:4d} B {r['B']:2d} {r['H']}:{r['Hkv']} {order:12s} paged {r['paged_tbs']:.2f} "
                      f"TB/s, paged/contiguous {r['ratio']:.3f}", flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "paged_gap.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows},
                                                           indent=1))


if __name__ == "__main__":
    main()
