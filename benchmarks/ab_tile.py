"""A/B of Hopper kernel tile shapes per head dim, in one process on one GPU: every variant is compiled
once per tile (the source differs, so the cache keys do) and timed back to back.

Usage: python benchmarks/ab_tile.py [--tiles "block_n=128;block_n=192"] [--dims 64,32]
                                    [--variants full,causal,...] [--S 4096] [--out DIR]
Each tile is a set of Tile field overrides on lower/tiles.py's choice ("default": none); for example
"block_m=128,warps=12" is two consumer warpgroups, "stages=3" a deeper ring.
Writes ab_tile.json. TFLOP/s over unmasked pairs, B*S = 32k, H 16, bf16.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
import torch_cubridge as tc  # noqa: E402
import torch_cubridge.lower.tiles as tiles  # noqa: E402
from bench_attention import bench  # noqa: E402
from variants import SPECS, pair_count  # noqa: E402


def overrides(spec: str) -> dict[str, int]:
    if spec.strip() in ("", "default"):
        return {}
    return {k.strip(): int(v) for k, v in (kv.split("=") for kv in spec.split(","))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiles", default="block_n=128;block_n=192")
    ap.add_argument("--dims", default="64,32")
    ap.add_argument("--variants", default="full,causal,document,sliding_1024,alibi_causal")
    ap.add_argument("--S", type=int, default=4096)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    print(torch.cuda.get_device_name(), flush=True)
    original = tiles.sm90_tile
    rows = []
    S, H = a.S, 16
    B = max(1, 32768 // S)
    for D in map(int, a.dims.split(",")):
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        lens = torch.randint(S // 8, S // 2, (64,), generator=torch.Generator().manual_seed(S))
        doc = torch.repeat_interleave(torch.arange(64), lens)[:S][None].expand(B, S).contiguous().cuda()
        for name in a.variants.split(","):
            extra = (doc,) if name == "document" else ()
            flops = 4 * pair_count(name, B, S, "cuda", doc if name == "document" else None) * H * D
            row = {"variant": name, "D": D, "S": S}
            ref = None
            for spec in a.tiles.split(";"):
                over = overrides(spec)
                tiles.sm90_tile = lambda *args, over=over: (lambda t: t and replace(t, **over))(original(*args))
                try:
                    f = tc.compile(SPECS[name], fallback="raise")
                    out = f(q, k, v, *extra)
                    tile = f.kernels()[-1].low.tile
                    assert f.served["kernel"] == 1 and all(getattr(tile, k) == v for k, v in over.items())
                    ref = out if ref is None else ref
                    row[f"{spec}_maxdiff"] = float((out.float() - ref.float()).abs().max())  # tiles agree
                    ms = bench(lambda: f(q, k, v, *extra))
                    row[f"{spec}_tflops"] = flops / ms / 1e9
                    del out
                finally:
                    tiles.sm90_tile = original
            rows.append(row)
            print(row, flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "ab_tile.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows},
                                                         indent=2))


if __name__ == "__main__":
    main()
