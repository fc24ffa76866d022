"""`cubridge bench`: a spec against its compiled kernel, SDPA and FlexAttention on the same inputs.

SDPA and FlexAttention run plain (full) attention: the speed a hand-written kernel reaches at this
shape, not the spec's variant. Times are medians of CUDA-event timed runs (wall clock on the CPU);
the chart is plain SVG, so no plotting library is needed.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch


def median_ms(fn: Callable[[], Any], reps: int) -> float:
    fn()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        return statistics.median(times)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def bench_spec(fn: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, reps: int = 30) -> dict[str, Any]:
    """Milliseconds per call of the spec (eager), the compiled spec, and plain SDPA/FlexAttention."""
    from .compile import compile as tc_compile
    import torch.nn.functional as F
    f = tc_compile(fn)
    with torch.no_grad():
        f(q, k, v)  # capture, verify, build: not timed
        served = "kernel" if f.served["kernel"] else "spec"
        rows = {"spec (eager)": median_ms(lambda: fn(q, k, v), reps),
                f"torch_cubridge ({served})": median_ms(lambda: f(q, k, v), reps)}
        gqa = k.shape[1] != q.shape[1]
        rows["SDPA, plain"] = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa), reps)
        try:
            from torch.nn.attention.flex_attention import flex_attention
            flex = torch.compile(flex_attention) if q.is_cuda else flex_attention
            rows["FlexAttention, plain"] = median_ms(lambda: flex(q, k, v, enable_gqa=gqa), reps)
        except Exception:  # no FlexAttention for this device, dtype or build
            pass
    return {"shape": list(q.shape), "kv_shape": list(k.shape), "dtype": str(q.dtype).replace("torch.", ""),
            "device": torch.cuda.get_device_name(q.device) if q.is_cuda else "cpu", "ms": rows}


def svg_bars(title: str, rows: dict[str, float], unit: str = "ms") -> str:
    """A horizontal bar chart as SVG text (no plotting library needed)."""
    w, bar, gap, left = 640, 22, 10, 230
    h = 40 + len(rows) * (bar + gap)
    top = max(rows.values()) or 1.0
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="13">',
           f'<text x="10" y="22" font-weight="bold">{_esc(title)}</text>']
    for i, (name, val) in enumerate(rows.items()):
        y = 36 + i * (bar + gap)
        length = (w - left - 90) * val / top
        out.append(f'<text x="10" y="{y + 16}">{_esc(name)}</text>')
        out.append(f'<rect x="{left}" y="{y}" width="{length:.1f}" height="{bar}" fill="#4c72b0"/>')
        out.append(f'<text x="{left + length + 6:.1f}" y="{y + 16}">{val:.3f} {unit}</text>')
    out.append("</svg>")
    return "\n".join(out)


def _esc(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
