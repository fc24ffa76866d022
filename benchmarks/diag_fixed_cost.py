"""A decode call's fixed cost and streaming rate, apart: each kernel configuration timed at several key lengths
with L2 emptied by a read before every call (diag_l2_flush.py's "clean" mode, so no write-back lands in the
call), and a line fitted through time against K/V bytes: the slope is the streaming rate, the intercept the
cost a call pays whatever its length (launch, the first copies' latency, the splits' tail, the merge).

Configurations: "name:kind:stages:ctas[:block_n]", kind contiguous or paged16 / paged256; stages, ctas and block_n 0
(or block_n left out) for the tile's own. Usage: python benchmarks/diag_fixed_cost.py [--out DIR] [--lengths 2048,4096,8192,16384,32768]
    [--shape B,H,HKV] [--configs "contig:contiguous:0:0;contig_2x2:contiguous:2:2;paged16:paged16:0:0"]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch_cubridge as tc  # noqa: E402
import torch_cubridge.lower.source as source  # noqa: E402
import torch_cubridge.ops.runner as runner  # noqa: E402
from bench_decode import gqa_decode, paged_gqa_decode, sdpa  # noqa: E402
from timing import events_ms, read_flush  # noqa: E402


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b x: (a, b)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / max(sum((x - mx) ** 2 for x in xs), 1e-30)
    return my - b * mx, b


B, H, HKV, D = 8, 32, 8, 128


@contextmanager
def decode_config(stages: int, ctas: int, block_n: int = 0):
    """The decode tile's ring depth, keys per block and the split rule's CTAs per multiprocessor while compiling
    (0: the tile's own)."""
    base_tile, base_ctas = source.decode_tile, runner.DECODE_CTAS_PER_SM
    if stages or block_n:
        def tile(d, dv=None, paged=False):
            t = base_tile(d, dv, paged)
            return replace(t, stages=stages or t.stages, block_n=block_n or t.block_n)
        source.decode_tile = tile
    runner.DECODE_CTAS_PER_SM = ctas or None
    try:
        yield
    finally:
        source.decode_tile, runner.DECODE_CTAS_PER_SM = base_tile, base_ctas


def decode_case(kind: str, Skv: int, pool_scale: int = 1) -> tuple:
    """(the call to time, its compiled function or None) for B 8, 32:8 heads, D 128, Skv keys: kind contiguous,
    pagedP (pages of P rows in a pool `pool_scale` times the pages read, in random order) or an SDPA backend."""
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(B, H, 1, D, device=dev, dtype=dt)
    if kind.startswith("paged"):
        P = int(kind[5:])
        per = Skv // P
        n = B * per * pool_scale + 7
        kp, vp = (torch.randn(n, HKV, P, D, device=dev, dtype=dt) for _ in range(2))
        table = torch.randperm(n, device=dev)[:B * per].reshape(B, per)
        f = tc.compile(paged_gqa_decode, fallback="raise")
        return (lambda: f(q, kp, vp, table)), f
    k, v = (torch.randn(B, HKV, Skv, D, device=dev, dtype=dt) for _ in range(2))
    if kind == "contiguous":
        f = tc.compile(gqa_decode, fallback="raise")
        return (lambda: f(q, k, v)), f
    return (lambda: sdpa(kind, q, k, v)), None


def main() -> None:
    global B, H, HKV
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--lengths", default="2048,4096,8192,16384,32768")
    ap.add_argument("--shape", default=f"{B},{H},{HKV}", help="batch, query heads, KV heads")
    ap.add_argument("--configs", default="contig:contiguous:0:0;contig_2x2:contiguous:2:2;paged16:paged16:0:0;"
                    "paged16_3x2:paged16:3:2;paged256:paged256:0:0;flash:flash:0:0;cudnn:cudnn:0:0")
    args = ap.parse_args()
    B, H, HKV = (int(x) for x in args.shape.split(","))
    print(torch.cuda.get_device_name(), f"B {B}, {H}:{HKV} heads", flush=True)
    clean = read_flush()
    rows = []
    for cfg in args.configs.split(";"):
        name, kind, st, ctas, *bn = cfg.split(":")
        st, ctas, bn = int(st), int(ctas), int(bn[0]) if bn else 0
        with decode_config(st, ctas, bn):
            for Skv in (int(x) for x in args.lengths.split(",")):
                kv_bytes = 2 * 2 * B * HKV * Skv * D
                fn, _ = decode_case(kind, Skv)
                fn()
                ms = min(events_ms(fn, clean) for _ in range(2))
                rows.append({"config": name, "kind": kind, "shape": [B, H, HKV], "stages": st or None, "ctas_per_sm": ctas or None, "block_n": bn or None,
                             "Skv": Skv, "bytes": kv_bytes, "clean_ms": ms, "tbs": kv_bytes / (ms * 1e-3) / 1e12})
                print(json.dumps(rows[-1]), flush=True)
    fits = {}
    for name in dict.fromkeys(r["config"] for r in rows):
        rs = [r for r in rows if r["config"] == name]
        a, b = fit([r["bytes"] / 1e6 for r in rs], [r["clean_ms"] * 1e3 for r in rs])
        fits[name] = {"fixed_us": a, "stream_tbs": 1 / b if b > 0 else None}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "fixed_cost.json").write_text(json.dumps({"rows": rows, "fits": fits}, indent=1))
    lengths = sorted({r["Skv"] for r in rows})
    print(f"{'config':>12} " + " ".join(f"{s:>7}" for s in lengths) + "   fixed_us stream_TB/s (clean flush)")
    for name, ft in fits.items():
        tb = {r["Skv"]: r["tbs"] for r in rows if r["config"] == name}
        print(f"{name:>12} " + " ".join(f"{tb.get(s, 0):7.2f}" for s in lengths)
              + f"   {ft['fixed_us']:8.1f} {ft['stream_tbs'] or 0:8.3f}")


if __name__ == "__main__":
    main()
