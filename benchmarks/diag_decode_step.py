"""Where a decode step of bench_generate's 8-layer llama goes, SDPA against the drop-in: wall time per
step (synchronised each step), the GPU's own kernel time per step (torch.profiler), the kernels that
differ, and every synchronising call the step makes (torch.cuda.set_sync_debug_mode).

Usage: python benchmarks/diag_decode_step.py [--B 1] [--ctx 32768] [--steps 20] [--out DIR]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_generate import start, tcx  # noqa: E402


def _prefill(model, B: int, ctx: int):
    from transformers import DynamicCache
    ids = torch.randint(1, model.config.vocab_size, (B, ctx), generator=torch.Generator().manual_seed(0)).cuda()
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(ids, past_key_values=cache, use_cache=True)
    return out.logits[:, -1:].argmax(-1), cache, ctx


def _step(model, tok, cache, pos: int):
    with torch.no_grad():
        out = model(tok, past_key_values=cache, use_cache=True,
                    cache_position=torch.tensor([pos], device="cuda"))
    return out.logits[:, -1:].argmax(-1)


def _syncs(model, tok, cache, pos) -> list[str]:
    """The call sites of every synchronising CUDA call in one step (the innermost frame of this repo or
    transformers)."""
    seen = []

    def show(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1]
                  if "torch_cubridge" in f.filename or "transformers" in f.filename]
        where = f"{frames[-1].filename.split('site-packages/')[-1]}:{frames[-1].lineno} {frames[-1].name}" if frames else "?"
        seen.append(f"{where}: {str(message)[:80]}")
    old = warnings.showwarning
    warnings.showwarning = show
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            _step(model, tok, cache, pos)
    finally:
        torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning = old
    return seen


def measure(model, impl: str, B: int, ctx: int, steps: int) -> dict:
    model.set_attn_implementation(impl)
    tok, cache, pos = _prefill(model, B, ctx)
    for _ in range(3):  # first steps: ours captures and builds the decode program
        tok = _step(model, tok, cache, pos)
        pos += 1
    torch.cuda.synchronize()
    walls = []
    for _ in range(steps):
        t0 = time.perf_counter()
        tok = _step(model, tok, cache, pos)
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
        pos += 1
    # unsynchronised: the host may run ahead between steps, as in generate (argmax's result is on the GPU)
    t0 = time.perf_counter()
    for _ in range(steps):
        tok = _step(model, tok, cache, pos)
        pos += 1
    torch.cuda.synchronize()
    free_ms = (time.perf_counter() - t0) * 1e3 / steps
    syncs = _syncs(model, tok, cache, pos)
    pos += 1
    from torch.profiler import ProfilerActivity, profile
    n = 5
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            tok = _step(model, tok, cache, pos)
            pos += 1
        torch.cuda.synchronize()
    kern = collections.Counter()
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if e.device_type == torch.autograd.DeviceType.CUDA or getattr(e, "is_kernel", False):
            kern[e.key[:90]] += t / n
    walls.sort()
    return {"impl": impl, "B": B, "ctx": ctx, "step_ms_synced_median": walls[len(walls) // 2] * 1e3,
            "step_ms_synced_min": walls[0] * 1e3, "step_ms_free": free_ms,
            "gpu_kernel_us_per_step": sum(kern.values()),
            "top_kernels_us_per_step": dict(kern.most_common(12)), "syncs_per_step": syncs}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    model = start()
    rows = []
    for impl in ("sdpa", tcx.NAME, "sdpa", tcx.NAME):
        rows.append(measure(model, impl, a.B, a.ctx, a.steps))
        torch.cuda.empty_cache()
        print(json.dumps(rows[-1], indent=1), flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / f"decode_step_B{a.B}_{a.ctx}.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    print(f"{'impl':>8} {'synced ms':>9} {'free ms':>8} {'GPU us':>8} {'syncs':>5}")
    for r in rows:
        print(f"{r['impl']:>8} {r['step_ms_synced_median']:9.3f} {r['step_ms_free']:8.3f} "
              f"{r['gpu_kernel_us_per_step']:8.0f} {len(r['syncs_per_step']):5d}")


if __name__ == "__main__":
    main()
