"""A/B of the paged decode's page layout, same kernel source, same random tables: heads-first pages
[N, Hkv, P, D] (vLLM) against slots-first [N, P, Hkv, D] (flash-attn, transformers' continuous batching), both
against the contiguous decode. 32:8 heads, D 128, bf16, Sq 1. --ncu LAYOUT,P: run only that case once more after
warm-up (for `ncu --kernel-name cubridge_decode --launch-skip ...`).
Usage (device): python3 benchmarks/ab_page_layout.py --out $OUT"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F

import torch_cubridge as tc
from bench_decode import gqa_decode, paged_gqa_decode
from timing import interleaved_ms
from torch_cubridge.integrations.flash_specs import paged_decode_attention


def slots_gqa_decode(q, k_pages, v_pages, block_table):
    """The same attention over slots-first pages [N, P, Hkv, D]."""
    B, Hkv, D = q.shape[0], k_pages.shape[2], k_pages.shape[3]
    k = k_pages[block_table].reshape(B, -1, Hkv, D).transpose(1, 2)
    v = v_pages[block_table].reshape(B, -1, Hkv, D).transpose(1, 2)
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def case(B: int, Skv: int, P: int, H: int = 32, Hkv: int = 8, D: int = 128) -> tuple[dict, dict]:
    dev, dt = "cuda", torch.bfloat16
    per = Skv // P
    n = B * per + 7
    q = torch.randn(B, H, 1, D, device=dev, dtype=dt)
    table = torch.randperm(n, device=dev)[:B * per].reshape(B, per)
    hf = [torch.randn(n, Hkv, P, D, device=dev, dtype=dt) for _ in range(2)]
    sf = [x.transpose(1, 2).contiguous() for x in hf]  # the same keys, slots-first
    k, v = (p[table].permute(0, 2, 1, 3, 4).flatten(2, 3).contiguous() for p in hf)
    fh, fs, g = (tc.compile(f, fallback="raise") for f in (paged_gqa_decode, slots_gqa_decode, gqa_decode))
    ref = gqa_decode(q.double(), k.double(), v.double())
    lens = torch.full((B,), Skv, dtype=torch.int32, device=dev)
    fl = tc.compile(lambda q, k, v, t, n: paged_decode_attention(q, k, v, t, n, D ** -0.5, -1, 0.0, None),
                    fallback="raise")
    q2, t32 = q.transpose(1, 2), table.int()
    fns = {"heads_first": lambda: fh(q, *hf, table), "slots_first": lambda: fs(q, *sf, table),
           "slots_first_i32": lambda: fs(q, *sf, t32),
           "lens_i64": lambda: fl(q2, *sf, table, lens).transpose(1, 2),
           "lens_i32": lambda: fl(q2, *sf, t32, lens).transpose(1, 2),
           "contiguous": lambda: g(q, k, v)}
    row = {"B": B, "Skv": Skv, "page": P}
    for name, fn in fns.items():
        row[f"{name}_err"] = float((fn().double() - ref).norm() / ref.norm())
    row["served"] = {"heads_first": dict(fh.served), "slots_first": dict(fs.served), "lens": dict(fl.served)}
    return row, fns


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--rows", default="8x32768,8x4096,1x32768")
    ap.add_argument("--pages", default="16,256")
    ap.add_argument("--ncu", default="", help="LAYOUT,P,BxS: that case once after warm-up, nothing timed")
    a = ap.parse_args()
    if a.ncu:
        layout, P, shape = a.ncu.split(",")
        B, S = map(int, shape.split("x"))
        _, fns = case(B, S, int(P))
        for _ in range(3):
            fns[layout]()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push("measure")  # ncu --nvtx --nvtx-include measure/
        fns[layout]()
        torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()
        return
    print(torch.cuda.get_device_name(), flush=True)
    nbytes = lambda B, S: 2 * 2 * B * 8 * S * 128  # noqa: E731
    rows = []
    for P in map(int, a.pages.split(",")):
        for spec in a.rows.split(","):
            B, S = map(int, spec.split("x"))
            row, fns = case(B, S, P)
            times, errors = interleaved_ms(fns)
            row.update({f"{k}_ms": t for k, t in times.items()}, errors=errors)
            row.update({f"{k}_tbs": nbytes(B, S) / (t * 1e-3) / 1e12 for k, t in times.items() if t})
            rows.append(row)
            print(json.dumps(row), flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "ab_page_layout.json").write_text(json.dumps(rows, indent=1))
    names = ["heads_first", "slots_first", "slots_first_i32", "lens_i64", "lens_i32", "contiguous"]
    print(f"{'B':>2} {'Skv':>6} {'P':>4} " + " ".join(f"{n[:10]:>10}" for n in names) + "  (TB/s)")
    for r in rows:
        print(f"{r['B']:2d} {r['Skv']:6d} {r['page']:4d} " + " ".join(f"{r.get(n + '_tbs', 0):10.2f}" for n in names))


if __name__ == "__main__":
    main()
