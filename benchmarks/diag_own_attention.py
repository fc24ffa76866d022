"""Diagnosis of one family routed through its compiled attention modules (GPU): the traceback of any
verification trial that raises, and a profile of the routed forward against the model's own code.

Usage: python benchmarks/diag_own_attention.py falcon [--seq 2048]
"""
from __future__ import annotations

import argparse
import copy
import traceback
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

import torch_cubridge.verify.cpu as vcpu
from bench_own_attention import build
from torch_cubridge.integrations import own_attention as oa

_trial = vcpu._trial


def _loud_trial(*a, **k):
    try:
        return _trial(*a, **k)
    except Exception:
        traceback.print_exc()
        raise


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("family")
    ap.add_argument("--seq", type=int, default=2048)
    a = ap.parse_args()
    warnings.simplefilter("ignore")
    vcpu._trial = _loud_trial
    for B, S, hidden, heads in ((2, 200, 64, 4), (4, a.seq, 2048, 16)):
        model = build(a.family, hidden, heads, 2).to("cuda", torch.bfloat16)
        eager = copy.deepcopy(model)
        oa.serve_own_attention(model)
        oa._compiled.clear()
        ids = torch.randint(0, 1024 if hidden > 64 else 128, (B, S), device="cuda")
        with torch.no_grad():
            model(ids, use_cache=False)
            print(B, S, [dict(c.served) for c in oa.tables()],
                  [e.reasons or e.reason for c in oa.tables() for e in c.entries()], flush=True)
            for name, m in (("routed", model), ("eager", eager))[:1 if S < 1024 else 2]:
                m(ids, use_cache=False)
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(3):
                        m(ids, use_cache=False)
                    torch.cuda.synchronize()
                print(f"== {name} B {B} S {S}")
                print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=10, max_name_column_width=50))


if __name__ == "__main__":
    main()
