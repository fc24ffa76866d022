"""What a decode benchmark's L2 flush adds to every call it times.

triton's do_bench empties L2 before each timed call by zeroing a 256 MB buffer, which leaves the L2 full of
dirty lines: the timed call's first reads evict them, and the eviction writes ~50 MB back to DRAM inside the
call's time. Prediction: a fixed cost of ~17 us (50 MB at 3 TB/s) in every call, for every implementation.
This times the same calls four ways, each call alone between CUDA events, the median of `reps`:
  dirty  : L2 emptied by writing a 256 MB buffer (as do_bench),
  clean  : L2 emptied by reading a 256 MB buffer (its lines are clean: nothing to write back),
  none   : no flush, calls back to back (K/V larger than L2 still mostly miss),
  bench  : triton.testing.do_bench itself (the figure bench_decode.py reports),
and a device-to-device copy of the K/V bytes the same ways, as the bandwidth anchor.

Usage: python benchmarks/diag_l2_flush.py [--out DIR] [--lengths 4096,32768]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch_cubridge as tc  # noqa: E402
from bench_decode import flex_call, gqa_decode, paged_gqa_decode, sdpa  # noqa: E402
from timing import FLUSH_BYTES, events_ms, read_flush  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--lengths", default="4096,32768")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    from triton.testing import do_bench
    print(torch.cuda.get_device_name(), flush=True)
    buf = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    modes = {"dirty": lambda: buf.zero_(),  # do_bench's kind of flush: a write
             "clean": read_flush(),
             "none": None}
    rows = []
    B, H, Hkv, D, P = 8, 32, 8, 128, 16
    for Skv in (int(x) for x in args.lengths.split(",")):
        dev, dt = "cuda", torch.bfloat16
        q = torch.randn(B, H, 1, D, device=dev, dtype=dt)
        k, v = (torch.randn(B, Hkv, Skv, D, device=dev, dtype=dt) for _ in range(2))
        per = Skv // P
        n = B * per + 7
        kp, vp = (torch.randn(n, Hkv, P, D, device=dev, dtype=dt) for _ in range(2))
        table = torch.randperm(n, device=dev)[:B * per].reshape(B, per)
        kv_bytes = 2 * 2 * B * Hkv * Skv * D
        f = tc.compile(gqa_decode, fallback="raise")
        fp = tc.compile(paged_gqa_decode, fallback="raise")
        f(q, k, v), fp(q, kp, vp, table)
        src = torch.empty(kv_bytes // 2, dtype=dt, device=dev)
        dst = torch.empty_like(src)
        fns = {"ours": lambda: f(q, k, v), "ours_paged16": lambda: fp(q, kp, vp, table),
               "sdpa_flash": lambda: sdpa("flash", q, k, v), "sdpa_cudnn": lambda: sdpa("cudnn", q, k, v),
               "copy": lambda: dst.copy_(src)}
        flex = flex_call(q, k, v)
        if not isinstance(flex, str):
            fns["flex"] = flex
        for rnd in range(args.rounds):
            for name, fn in fns.items():
                row = {"Skv": Skv, "impl": name, "round": rnd, "bytes": kv_bytes}
                for mode, fl in modes.items():
                    row[f"{mode}_ms"] = events_ms(fn, fl)
                row["bench_ms"] = do_bench(fn, warmup=25, rep=100, return_mode="median")
                for m in ("dirty", "clean", "none", "bench"):
                    row[f"{m}_tbs"] = kv_bytes / (row[f"{m}_ms"] * 1e-3) / 1e12
                row["dirty_minus_clean_us"] = (row["dirty_ms"] - row["clean_ms"]) * 1e3
                rows.append(row)
                print(json.dumps(row), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "l2_flush.json").write_text(json.dumps(rows, indent=1))
    print(f"{'Skv':>6} {'impl':>13} {'bench':>6} {'dirty':>6} {'clean':>6} {'none':>6}  TB/s; dirty-clean us")
    for r in rows:
        if r["round"] == args.rounds - 1:
            print(f"{r['Skv']:>6} {r['impl']:>13} {r['bench_tbs']:6.2f} {r['dirty_tbs']:6.2f} {r['clean_tbs']:6.2f} "
                  f"{r['none_tbs']:6.2f}  {r['dirty_minus_clean_us']:5.1f}")


if __name__ == "__main__":
    main()
