"""Where the host time of a generate decode step goes, SDPA against the drop-in, measured inside generate
itself: the attention functions' own host time per call (timed around it), the mask function's, the
garbage collector's (gc.callbacks), and the rest of a step; then one cProfile'd generate of each (the top
functions by own time, written as text).

bench_generate's 8-layer llama at B 1 runs about 10 ms a step on the H100 machines' host, of which the
GPU needs about 1.3: a few per cent between the two there is host time, and this says whose.

Both run in the same generates, alternating every step (bench_generate's `alternating_steps`): rounds of whole
generates drift by 20-50% on these hosts.

Usage: python benchmarks/diag_step_host.py [--B 1] [--ctx 4096] [--new 64] [--rounds 4] [--out DIR]
(writes step_host.json, profile_sdpa.txt, profile_cubridge.txt)
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import gc
import io
import json
import os
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_generate import IMPLS, _generate, _median, alternating_steps, start  # noqa: E402


class _Clock:
    """Each call's host time inside the wrapped functions, by implementation, and the garbage collector's."""

    def __init__(self) -> None:
        self.calls: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
        self.gc, self._gc0 = 0.0, 0.0

    def wrap(self, impl: str, what: str, fn):
        calls = self.calls[impl, what]

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                calls.append(time.perf_counter() - t0)
        return timed

    def on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc0 = time.perf_counter()
        else:
            self.gc += time.perf_counter() - self._gc0


def _interfaces():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    return AttentionInterface._global_mapping, AttentionMaskInterface._global_mapping


def measure(model, ids: torch.Tensor, new: int, rounds: int) -> dict:
    """Generates alternating the two every step (bench_generate.alternating), each attention and mask
    call of each timed."""
    clock = _Clock()
    attn, mask = _interfaces()
    saved = {i: (attn[i], mask.get(i)) for i in IMPLS}
    for i in IMPLS:
        attn[i] = clock.wrap(i, "attention", saved[i][0])
        if saved[i][1] is not None:
            mask[i] = clock.wrap(i, "mask", saved[i][1])
    gc.callbacks.append(clock.on_gc)
    try:
        steps = alternating_steps(model, ids, new, rounds, IMPLS)
    finally:
        gc.callbacks.remove(clock.on_gc)
        for i in IMPLS:
            attn[i] = saved[i][0]
            if saved[i][1] is not None:
                mask[i] = saved[i][1]
    layers = model.config.num_hidden_layers
    out = {"B": ids.shape[0], "ctx": ids.shape[1], "new": new, "rounds": rounds, "gc_ms_total": 1e3 * clock.gc}
    for i in IMPLS:
        step = _median([t for j, t in steps if j == i]) * 1e3
        att = _median(clock.calls[i, "attention"]) * 1e6
        msk = _median(clock.calls[i, "mask"] or [0.0]) * 1e6
        out[i] = {"median_step_ms": step, "attention_us_per_call": att, "attention_calls": len(clock.calls[i, "attention"]),
                  "mask_us_per_call": msk, "mask_calls": len(clock.calls[i, "mask"]),
                  "rest_ms_per_step": step - (layers * att + msk) / 1e3}
    return out


def profiled(model, impl: str, ids: torch.Tensor, new: int) -> str:
    model.set_attn_implementation(impl)
    prof = cProfile.Profile()
    prof.enable()
    _generate(model, ids, new + 1)
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(60)
    return s.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    model = start()
    ids = torch.randint(1, model.config.vocab_size, (a.B, a.ctx), generator=torch.Generator().manual_seed(0)).cuda()
    for impl in IMPLS:  # ours captures and builds; SDPA's cuDNN plans for every length
        model.set_attn_implementation(impl)
        _generate(model, ids, a.new + 1)
    res = measure(model, ids, a.new, a.rounds)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for impl in IMPLS:
        (out / f"profile_{impl}.txt").write_text(profiled(model, impl, ids, a.new))
    (out / "step_host.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), **res}, indent=1))
    print(json.dumps(res))
    print(f"{'impl':>8} {'step ms':>7} {'attn us/call':>12} {'mask us':>7} {'rest ms':>7}")
    for impl in IMPLS:
        r = res[impl]
        print(f"{impl:>8} {r['median_step_ms']:7.3f} {r['attention_us_per_call']:12.1f} {r['mask_us_per_call']:7.1f} "
              f"{r['rest_ms_per_step']:7.3f}")


if __name__ == "__main__":
    main()
