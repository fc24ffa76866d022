"""A/B in one process: the Hopper kernel with and without span skipping of empty key blocks
(Variant::kClassSpans), same shapes, same GPU. Usage: python benchmarks/ab_block_spans.py"""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
import torch_cubridge as tc  # noqa: E402
import torch_cubridge.lower.source as src  # noqa: E402
from variants import SPECS  # noqa: E402

warnings.filterwarnings("ignore")
print(torch.cuda.get_device_name(), flush=True)
orig = src.variant_source


def no_spans(*a, **k):
    text, fields, scale = orig(*a, **k)
    i = text.rindex("};")
    return text[:i] + "  static constexpr bool kClassSpans = false;\n" + text[i:], fields, scale


for S in (4096, 16384):
    B, H, D = 32768 // S, 16, 128
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for name in ("full", "causal", "sliding_1024"):
        res = {}
        for tag, fn in (("spans", orig), ("no_spans", no_spans), ("spans_again", orig)):
            src.variant_source = fn
            f = tc.compile(SPECS[name], fallback="raise")
            f(q, k, v)
            res[tag] = do_bench(lambda: f(q, k, v), warmup=25, rep=200, return_mode="median")
        print(f"{name:13s} S={S:5d} " + "  ".join(f"{t} {ms:.3f} ms" for t, ms in res.items()), flush=True)
src.variant_source = orig
