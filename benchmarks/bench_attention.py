"""Forward attention throughput: torch_cubridge vs SDPA (flash, cuDNN), FlexAttention
(torch.compile) and the eager spec, in one run. TFLOP/s over unmasked pairs only.

Usage: python benchmarks/bench_attention.py [--quick] [--out DIR]
Writes bench_attention.json to DIR or $OUT (record.py).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch_cubridge as tc  # noqa: E402
from record import save  # noqa: E402
from timing import add_tflops, backend_times, host_us, parse_plan  # noqa: E402
from variants import SPECS, document_ids, flex_mods, pair_count  # noqa: E402


FP64_MAX_S = 4096  # the longest sequence whose output is checked against the spec in float64


def bench(fn, reps: int = 30) -> float:
    from triton.testing import do_bench
    return do_bench(fn, warmup=25, rep=reps * 4, return_mode="median")  # milliseconds


def sdpa(backend, q, k, v, causal, gqa):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    b = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    with sdpa_kernel([b]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)


def fp64_error(spec, out, q, k, v, extra) -> float:
    """Relative error (Frobenius) of our output against the spec in float64 on the first batch entry,
    every head: the benchmark's own inputs, not a redraw."""
    one = tuple(t[:1].double() if t.is_floating_point() else t[:1] for t in (q, k, v) + extra)
    ref = spec(*one)
    err = float((out[:1].double() - ref).norm() / ref.norm().clamp_min(1e-30))
    del ref, one
    return err


def run_case(name, S, D, H, total, results, with_eager):
    dev = "cuda"
    B = max(1, total // S)
    Hkv = H // 4 if name == "gqa_causal" else H
    q = torch.randn(B, H, S, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(B, Hkv, S, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn(B, Hkv, S, D, device=dev, dtype=torch.bfloat16)
    extra = ()
    doc = None
    if name == "document":
        doc = document_ids(B, S, dev)
        extra = (doc,)
    pairs = pair_count(name, B, S, dev, doc) * H
    flops = 4 * pairs * D
    row = {"variant": name, "S": S, "D": D, "B": B, "H": H, "Hkv": Hkv, "density": pairs / (B * H * S * S)}
    spec = SPECS[name]
    f = tc.compile(spec, fallback="raise")
    t0 = time.perf_counter()
    out = f(q, k, v, *extra)
    torch.cuda.synchronize()
    row["first_call_s"] = time.perf_counter() - t0
    runner = f.kernels()[-1]
    row["build_s"] = runner.info["seconds"] if runner.info["built"] else None
    row["served"] = dict(f.served)
    row["kernel"] = runner.low.tile.kernel
    if S <= FP64_MAX_S:  # at 16k one entry's float64 scores alone take 34 GB
        row["fp64_rel_err"] = fp64_error(spec, out, q, k, v, extra)
        row["matches_fp64"] = row["fp64_rel_err"] < 1e-2  # the GPU tests' bf16 tolerance
    del out
    row["ours_ms"] = bench(lambda: f(q, k, v, *extra))
    causal = name not in ("full", "softcap_full")
    if name in ("full", "causal", "gqa_causal"):
        backend_times(row, ("flash", "cudnn"), lambda be: bench(lambda: sdpa(be, q, k, v, causal, Hkv != H)))
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        score, mask = flex_mods(name, H, S, dev, doc)
        bm = create_block_mask(mask, B if name == "document" else None, None, S, S, device=dev) if mask else None
        torch._dynamo.reset()  # one compile per case; never hit the recompile limit and fall back to eager
        flex = torch.compile(flex_attention)
        t0 = time.perf_counter()
        flex(q, k, v, score_mod=score, block_mask=bm, enable_gqa=Hkv != H)
        torch.cuda.synchronize()
        row["flex_compile_s"] = time.perf_counter() - t0
        row["flex_ms"] = bench(lambda: flex(q, k, v, score_mod=score, block_mask=bm, enable_gqa=Hkv != H))
    except Exception as e:
        row["flex_ms"] = None
        row["flex_error"] = str(e)[:300]
    if with_eager and S <= 4096:
        try:
            row["eager_ms"] = bench(lambda: spec(q, k, v, *extra), reps=5)
        except torch.OutOfMemoryError:
            row["eager_ms"] = None
    add_tflops(row, flops)
    results.append(row)
    del q, k, v
    torch.cuda.empty_cache()
    return row


def host_overhead(n: int = 2000) -> dict:
    q, k, v = (torch.randn(1, 1, 16, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    f = tc.compile(SPECS["causal"], fallback="raise")
    f(q, k, v)
    out = {}
    for name, fn in (("ours", lambda: f(q, k, v)),
                     ("sdpa", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))):
        out[f"{name}_us_per_call"] = host_us(fn, n, warmup=100)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-eager", action="store_true", help="skip timing the eager spec (slow at 4k)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--variants", default=",".join(SPECS))
    ap.add_argument("--plan", default="4096:128,4096:64,1024:128,16384:128", help="S:D,S:D,...")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    names = args.variants.split(",")
    sd = parse_plan(args.plan)
    if args.quick:
        sd = sd[:1]
    plan = [(n, S, D) for S, D in sd for n in names]
    results: list[dict] = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, S, D in plan:
        r = run_case(name, S, D, 16, 32768, results, with_eager=not args.no_eager)
        ok = {True: "ok", False: "WRONG", None: "-"}[r.get("matches_fp64")]
        print(f"{name:15s} S={S:5d} D={D:3d} fp64 {ok:5s} ours {r.get('ours_tflops', 0):6.1f} TF/s  flex "
              f"{r.get('flex_tflops') or 0:6.1f}  flash {r.get('sdpa_flash_tflops') or 0:6.1f}  "
              f"cudnn {r.get('sdpa_cudnn_tflops') or 0:6.1f}  eager {r.get('eager_tflops') or 0:6.1f}", flush=True)
        (out / "bench_partial.json").write_text(json.dumps(results, indent=1))
    oh = host_overhead()
    save(out, "bench_attention", {"results": results, "host_overhead": oh})
    full4k = {(r["S"], r["D"]): r["ours_tflops"] for r in results if r["variant"] == "full"}
    print("\nvariant          S     D   ours TF/s  /cudnn  /flash  /flex  /own-full  fp64  first-call s")
    for r in results:
        def ratio(k_):
            return f"{r['ours_tflops'] / r[k_]:6.2f}" if r.get(k_) else "     -"
        own = r["ours_tflops"] / full4k[(r["S"], r["D"])] if (r["S"], r["D"]) in full4k else float("nan")
        ok = {True: "ok", False: "WRONG", None: "-"}[r.get("matches_fp64")]
        print(f"{r['variant']:15s} {r['S']:5d} {r['D']:4d} {r['ours_tflops']:9.1f} {ratio('sdpa_cudnn_tflops')} "
              f"{ratio('sdpa_flash_tflops')} {ratio('flex_tflops')} {own:9.2f} {ok:>5s} {r['first_call_s']:10.2f}")
    print(f"host overhead per tiny call: ours {oh['ours_us_per_call']:.1f} us, SDPA {oh['sdpa_us_per_call']:.1f} us")


if __name__ == "__main__":
    main()
