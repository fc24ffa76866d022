"""A pairwise bias looked up through data-indexed ids (`table[tq[:, :, None], tk[:, None, :]]`, token
types or segments): the kernel reading through the ids against the same spec with the gather left to the
prologue (PyTorch builds a [B, Sq, Skv] table per call), against SDPA given that table as a float mask,
and the spec itself. bf16, milliseconds per call (do_bench, median).

Usage: python benchmarks/bench_pairwise.py [--out DIR]   (writes bench_pairwise.json)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "tests" / "support")]
from paths import SEARCH  # noqa: E402
sys.path[:0] = [str(p) for p in SEARCH]
import torch_cubridge as tc  # noqa: E402
from record import save  # noqa: E402
from test_data_indexed import make, type_bias  # noqa: E402


def type_bias_again(q, k, v, tq, tk, table):
    """type_bias with another graph (the scale applied to q first), so another spec hash: the disk cache
    keys verified programs by the captured graph, and the same graph would recall type_bias's program."""
    s = (q * q.shape[-1] ** -0.5) @ k.transpose(-1, -2)
    return torch.softmax(s + table[tq[:, :, None], tk[:, None, :]][:, None], -1) @ v


def main() -> None:
    from triton.testing import do_bench
    from torch_cubridge.transfer.symbolic import offscore
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    warnings.filterwarnings("ignore")
    print(torch.cuda.get_device_name(), flush=True)
    rows = []
    for B, H, S in ((8, 16, 4096), (2, 16, 16384)):
        args = make(B=B, H=H, Sq=S, Skv=S, D=128, T=8, dtype=torch.bfloat16, device="cuda")
        args = args[:5] + (args[5].to(torch.bfloat16),)  # the table in the scores' dtype: the spec runs in bf16
        row = {"B": B, "H": H, "S": S, "D": 128}
        ids = tc.compile(type_bias, fallback="raise")
        ref = ids(*args)
        row["ids_ms"] = do_bench(lambda: ids(*args), return_mode="median")
        real = offscore.OffScorePath._pairwise
        offscore.OffScorePath._pairwise = lambda self, node, val: False  # the old way: a prologue table
        try:
            table = tc.compile(type_bias_again, fallback="raise")  # another spec hash: not the cached program
            table(*args)
            assert table.kernels()[-1].p.prologue, "the prologue's table was not used"
            out = table(*args)
            row["prologue_table_ms"] = do_bench(lambda: table(*args), return_mode="median")
        finally:
            offscore.OffScorePath._pairwise = real
        row["agree"] = float((out.float() - ref.float()).norm() / ref.float().norm())
        q, k, v, tq, tk, t = args
        bias = t[tq[:, :, None], tk[:, None, :]][:, None]
        row["sdpa_given_table_ms"] = do_bench(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias),
                                              return_mode="median")
        row["spec_ms"] = do_bench(lambda: type_bias(*args), return_mode="median") if S <= 4096 else None
        rows.append(row)
        print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
    Path(a.out).mkdir(parents=True, exist_ok=True)
    save(a.out, "bench_pairwise", {"rows": rows})
    for r in rows:
        print(f"B {r['B']} H {r['H']} S {r['S']}: ids {r['ids_ms']:.2f} ms, prologue table {r['prologue_table_ms']:.2f}, "
              f"SDPA given the table {r['sdpa_given_table_ms']:.2f}, spec {r['spec_ms'] or 0:.2f}")


if __name__ == "__main__":
    main()
