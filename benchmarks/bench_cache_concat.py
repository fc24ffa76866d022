"""Decode against a KV cache that the spec itself concatenates with the new keys (torch.cat inside the
attention function), as many hand-written decode loops do. torch_cubridge vs the spec as written
(cat + SDPA) and SDPA-flash over K/V concatenated beforehand (what reading the cache once costs), in
one run; then a loop of steps over a cache growing by one key each, counting programs (one capture
for every length, since the computed K/V's length is tied to the cache's, transfer/lengths.py).

Usage: python benchmarks/bench_cache_concat.py [--out DIR] [--lengths 4096,32768]
Writes bench_cache_concat.json to DIR or $OUT.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch_cubridge as tc  # noqa: E402
from record import save  # noqa: E402
from bench_decode import bench, sdpa  # noqa: E402
from timing import graph_replay  # noqa: E402


def cached_decode(q, k_new, v_new, k_cache, v_cache):
    """One decode step: the cache and the new token's key and value joined inside the spec."""
    k = torch.cat([k_cache, k_new], dim=2)
    v = torch.cat([v_cache, v_new], dim=2)
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def run(B: int, H: int, Hkv: int, cached: int, D: int, steps: int) -> dict:
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(B, H, 1, D, device=dev, dtype=dt)
    kn, vn = (torch.randn(B, Hkv, 1, D, device=dev, dtype=dt) for _ in range(2))
    kc, vc = (torch.randn(B, Hkv, cached, D, device=dev, dtype=dt) for _ in range(2))
    kv_bytes = 2 * 2 * B * Hkv * (cached + 1) * D
    row = {"B": B, "H": H, "Hkv": Hkv, "cached": cached, "D": D, "kv_bytes": kv_bytes}
    f = tc.compile(cached_decode, fallback="raise")
    t0 = time.perf_counter()
    out = f(q, kn, vn, kc, vc)
    torch.cuda.synchronize()
    row["first_call_s"] = time.perf_counter() - t0
    ref = cached_decode(*(t.double() for t in (q, kn, vn, kc, vc)))
    row["rel_err_vs_fp64"] = float((out.double() - ref).norm() / ref.norm())
    k, v = torch.cat([kc, kn], 2), torch.cat([vc, vn], 2)
    row["ours_ms"] = bench(lambda: f(q, kn, vn, kc, vc))
    row["spec_ms"] = bench(lambda: cached_decode(q, kn, vn, kc, vc))
    row["flash_preconcat_ms"] = bench(lambda: sdpa("flash", q, k, v))
    # the GPU's own time, without the host path (at 4k a call's host time exceeds the kernel's):
    # both replayed from CUDA graphs
    row["ours_graph_ms"] = bench(graph_replay(lambda: f(q, kn, vn, kc, vc)))
    row["flash_preconcat_graph_ms"] = bench(graph_replay(lambda: sdpa("flash", q, k, v)))
    # a loop over a growing cache: views of one buffer, one key longer each step
    kbuf, vbuf = (torch.randn(B, Hkv, cached + steps, D, device=dev, dtype=dt) for _ in range(2))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(steps):
        f(q, kn, vn, kbuf[:, :, : cached + i], vbuf[:, :, : cached + i])
    torch.cuda.synchronize()
    row["loop_step_ms"] = (time.perf_counter() - t0) / steps * 1e3
    row["programs"] = len(f.entries())
    row["served_kernel"] = f.served["kernel"]
    row["served_spec"] = f.served["spec"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--lengths", default="4096,32768")
    ap.add_argument("--steps", type=int, default=32)
    a = ap.parse_args()
    print(torch.cuda.get_device_name())
    rows = [run(8, 32, 8, n, 128, a.steps) for n in (int(x) for x in a.lengths.split(","))]
    save(a.out, "bench_cache_concat", {"rows": rows})
    print(f"{'cached':>7} {'ours ms':>8} {'spec ms':>8} {'flash*':>8} {'/spec':>6} {'/flash*':>7} "
          f"{'graph/flash*':>12} {'loop ms':>8} {'progs':>5} {'kernel':>6} {'spec':>5}")
    for r in rows:
        print(f"{r['cached']:>7} {r['ours_ms']:8.3f} {r['spec_ms']:8.3f} {r['flash_preconcat_ms']:8.3f} "
              f"{r['spec_ms'] / r['ours_ms']:6.2f} {r['flash_preconcat_ms'] / r['ours_ms']:7.2f} "
              f"{r['flash_preconcat_graph_ms'] / r['ours_graph_ms']:12.2f} "
              f"{r['loop_step_ms']:8.3f} {r['programs']:>5} {r['served_kernel']:>6} {r['served_spec']:>5}")


if __name__ == "__main__":
    main()
