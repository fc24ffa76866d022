"""Paged decode kernel variants in one process: the K/V ring depth, the split rule's CTAs per
multiprocessor and the key block of the paged tile only (the contiguous kernel it is compared with keeps its own).

Usage: python benchmarks/ab_paged.py [--configs "2,2;3,2;3,1"] [--pages 16,256] [--out DIR]
(writes paged_ab.json: run_paged's row per config and page size)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_decode as bd  # noqa: E402
import torch_cubridge.lower.source as source  # noqa: E402
from torch_cubridge.ops.runner import KernelRunner  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="2,2;3,2;3,1;2,2", help="stages,ctas_per_sm[,block_n] of the paged tile; ...")
    ap.add_argument("--pages", default="16,256")
    ap.add_argument("--skv", type=int, default=4096)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    warnings.filterwarnings("ignore")
    print(torch.cuda.get_device_name(), flush=True)
    base_tile, base_ctas = source.decode_tile, KernelRunner._ctas_per_sm
    rows = []
    for cfg in a.configs.split(";"):
        st, ctas, *bn = map(int, cfg.split(","))
        bn = bn[0] if bn else 64
        source.decode_tile = lambda d, dv=None, paged=False, st=st, bn=bn: (
            replace(base_tile(d, dv, paged), stages=st, block_n=bn) if paged else base_tile(d, dv, paged))
        KernelRunner._ctas_per_sm = lambda self, ctas=ctas: ctas if self.paged is not None else base_ctas(self)
        try:
            for P in map(int, a.pages.split(",")):
                row = dict(bd.run_paged(8, 32, 8, a.skv, 128, P), stages=st, ctas_per_sm=ctas, block_n=bn)
                rows.append(row)
                print(f"stages {st} ctas/SM {ctas} block {bn} pages {P}: {row['ours_tbs']:.2f} TB/s, "
                      f"{row['paged_over_contiguous']:.3f} of contiguous", flush=True)
        finally:
            source.decode_tile, KernelRunner._ctas_per_sm = base_tile, base_ctas
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "paged_ab.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
