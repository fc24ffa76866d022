"""Where the host time of a generate decode step goes, SDPA against the drop-in, measured inside generate
itself: per step, the attention functions' own host time (each layer's call, timed around it), the mask
function's, the garbage collector's (gc.callbacks), and the rest; then one cProfile'd round of each
(the top functions by own time, written as text).

bench_generate's 8-layer llama at B 1 runs about 10 ms a step on the H100 machines' host, of which the
GPU needs about 1.3: a few per cent between the two there is host time, and this says whose.

Usage: python benchmarks/diag_step_host.py [--B 1] [--ctx 4096] [--new 64] [--rounds 5] [--out DIR]
(writes step_host.json, profile_sdpa.txt, profile_cubridge.txt)
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import pstats
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_generate import _generate, _Stamps, model_8_layers, tcx  # noqa: E402


class _Clock:
    """Host time spent inside wrapped functions, and in the garbage collector."""

    def __init__(self) -> None:
        self.t = {"attention": 0.0, "mask": 0.0, "gc": 0.0}
        self.n = {"attention": 0, "mask": 0, "gc": 0}
        self._gc0 = 0.0

    def wrap(self, what: str, fn):
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.t[what] += time.perf_counter() - t0
                self.n[what] += 1
        return timed

    def on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc0 = time.perf_counter()
        else:
            self.t["gc"] += time.perf_counter() - self._gc0
            self.n["gc"] += 1


def _interfaces():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    return AttentionInterface._global_mapping, AttentionMaskInterface._global_mapping


def round_of(model, impl: str, ids: torch.Tensor, new: int, profile: bool = False) -> dict:
    model.set_attn_implementation(impl)
    clock = _Clock()
    attn, mask = _interfaces()
    saved = attn[impl], mask.get(impl)
    attn[impl] = clock.wrap("attention", saved[0])
    if saved[1] is not None:
        mask[impl] = clock.wrap("mask", saved[1])
    gc.callbacks.append(clock.on_gc)
    stamps = _Stamps(new + 1)
    prof = cProfile.Profile() if profile else None
    try:
        if prof:
            prof.enable()
        _generate(model, ids, new + 1, stamps)
    finally:
        if prof:
            prof.disable()
        gc.callbacks.remove(clock.on_gc)
        attn[impl] = saved[0]
        if saved[1] is not None:
            mask[impl] = saved[1]
    steps = sorted(b - a for a, b in zip(stamps.t, stamps.t[1:]))
    span = stamps.t[-1] - stamps.t[0]
    # the prefill's calls (one attention call a layer, one mask) are in the totals: taken out by count
    per = {k: clock.t[k] / max(1, clock.n[k]) for k in ("attention", "mask")}
    row = {"impl": impl, "median_step_ms": 1e3 * steps[len(steps) // 2], "mean_step_ms": 1e3 * span / new,
           "attention_us_per_call": 1e6 * per["attention"], "attention_calls": clock.n["attention"],
           "mask_us_per_call": 1e6 * per["mask"], "mask_calls": clock.n["mask"],
           "gc_ms_total": 1e3 * clock.t["gc"], "gc_collections": clock.n["gc"]}
    layers = model.config.num_hidden_layers
    row["attention_us_per_step"] = row["attention_us_per_call"] * layers
    if prof:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(40)
        row["profile"] = s.getvalue()
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    warnings.filterwarnings("ignore")
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    tcx.register()
    model = model_8_layers()
    ids = torch.randint(1, model.config.vocab_size, (a.B, a.ctx), generator=torch.Generator().manual_seed(0)).cuda()
    impls = ("sdpa", tcx.NAME)
    for impl in impls:  # ours captures and builds; SDPA's cuDNN plans
        round_of(model, impl, ids, 2)
        round_of(model, impl, ids, a.new)
    rows = []
    for i in range(a.rounds):
        for impl in impls:
            rows.append(round_of(model, impl, ids, a.new))
            print(json.dumps(rows[-1]), flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for impl in impls:
        (out / f"profile_{impl}.txt").write_text(round_of(model, impl, ids, a.new, profile=True)["profile"])
    (out / "step_host.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "B": a.B, "ctx": a.ctx,
                                                     "rows": rows}, indent=1))
    print(f"{'impl':>8} {'step ms':>7} {'attn us/call':>12} {'attn us/step':>12} {'mask us':>7} {'gc ms':>6}")
    for impl in impls:
        rs = [r for r in rows if r["impl"] == impl]
        med = lambda k: sorted(r[k] for r in rs)[len(rs) // 2]  # noqa: E731
        print(f"{impl:>8} {med('median_step_ms'):7.3f} {med('attention_us_per_call'):12.1f} "
              f"{med('attention_us_per_step'):12.0f} {med('mask_us_per_call'):7.1f} {med('gc_ms_total'):6.1f}")


if __name__ == "__main__":
    main()
