"""Decode throughput: one (or a few) query tokens against a long KV cache, GQA. torch_cubridge vs SDPA
(flash, cuDNN, efficient) and FlexAttention in one run, in TB/s of K and V read (plus Q and O). The
implementations of a row are timed in turn, three passes, the best of each (timing.interleaved_ms; since v29:
before, one after the other, so the first timed after a first call's idle stretch could read low).

Usage: python benchmarks/bench_decode.py [--out DIR] [--lengths 4096,32768] [--sq 1,4]
Writes bench_decode.json to DIR or $OUT.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Iterator

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch_cubridge as tc  # noqa: E402
from record import save  # noqa: E402
from timing import best_host_us, clean_flush_ms, interleaved_ms  # noqa: E402


def gqa_decode(q, k, v):
    """The spec a user writes for decoding against a cache: every cached key is visible."""
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def paged_gqa_decode(q, k_pages, v_pages, block_table):
    """The same attention with the cache in pages [N, Hkv, P, D] read through a block table (vLLM style)."""
    k = k_pages[block_table].permute(0, 2, 1, 3, 4).flatten(2, 3)
    v = v_pages[block_table].permute(0, 2, 1, 3, 4).flatten(2, 3)
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def bench(fn) -> float:
    from triton.testing import do_bench
    return do_bench(fn, warmup=25, rep=200, return_mode="median")  # milliseconds


def first_call(spec, *args) -> tuple:
    """(spec compiled, its first call's output, the row's first_call_s and kernel): the first call captures,
    verifies, builds and GPU-verifies, timed to its end on the GPU."""
    f = tc.compile(spec, fallback="raise")
    t0 = time.perf_counter()
    out = f(*args)
    torch.cuda.synchronize()
    r = f.kernels()[-1]
    return f, out, {"first_call_s": time.perf_counter() - t0,
                    "kernel": r.low.tile.kernel + ("-paged" if r.low.paged else "")}


def sdpa(backend: str, q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    b = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
         "efficient": SDPBackend.EFFICIENT_ATTENTION}[backend]
    with sdpa_kernel([b]):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def flex_call(q, k, v):
    """FlexAttention (compiled, GQA) over q, k, v [B, H, S, D] as a call to time, or why it cannot run."""
    try:
        from torch.nn.attention.flex_attention import flex_attention
        torch._dynamo.reset()
        flex = torch.compile(flex_attention)
        flex(q, k, v, enable_gqa=True)
        return lambda: flex(q, k, v, enable_gqa=True)
    except Exception as e:
        return str(e)[:200]


def run(B: int, H: int, Hkv: int, Sq: int, Skv: int, D: int) -> dict:
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(B, H, Sq, D, device=dev, dtype=dt)
    k, v = (torch.randn(B, Hkv, Skv, D, device=dev, dtype=dt) for _ in range(2))
    nbytes = 2 * (2 * B * Hkv * Skv * D + 2 * B * H * Sq * D)
    row = {"B": B, "H": H, "Hkv": Hkv, "Sq": Sq, "Skv": Skv, "D": D, "bytes": nbytes}
    f, out, first = first_call(gqa_decode, q, k, v)
    row.update(first)
    ref = gqa_decode(q.double(), k.double(), v.double())
    row["rel_err_vs_fp64"] = float((out.double() - ref).norm() / ref.norm())
    fns = {"ours": lambda: f(q, k, v)}
    fns.update({f"sdpa_{be}": (lambda be=be: sdpa(be, q, k, v)) for be in ("flash", "cudnn", "efficient")})
    flex = flex_call(q, k, v)
    if isinstance(flex, str):
        row["flex_ms"], row["flex_error"] = None, flex
    else:
        fns["flex"] = flex
    times, errors = interleaved_ms(fns)  # every implementation in turn, best of three passes
    row.update({f"{name}_ms": ms for name, ms in times.items()})
    row.update({f"{name}_error": e for name, e in errors.items()})
    # the same calls after a flush that leaves clean lines (do_bench's leaves ~50 MB to write back in the call)
    row.update({f"{name}_clean_ms": ms for name, ms in clean_flush_ms({n: fns[n] for n in times if times[n]}).items()})
    for key in [x for x in row if x.endswith("_ms")]:
        if row[key]:
            row[key.replace("_ms", "_tbs")] = nbytes / (row[key] * 1e-3) / 1e12
    return row


def run_paged(B: int, H: int, Hkv: int, Skv: int, D: int, P: int) -> dict:
    """Paged decode (Sq 1) against the contiguous kernel at the same shape, timed back to back; then the
    next step of a decode loop, the table one page wider: the same program (generic in the table width),
    no capture, checked against float64."""
    dev, dt = "cuda", torch.bfloat16
    per = Skv // P
    n = B * per + 7
    q = torch.randn(B, H, 1, D, device=dev, dtype=dt)
    kp, vp = (torch.randn(n, Hkv, P, D, device=dev, dtype=dt) for _ in range(2))
    table = torch.randperm(n, device=dev)[:B * per].reshape(B, per)
    nbytes = 2 * (2 * B * Hkv * Skv * D + 2 * B * H * D)
    row = {"B": B, "H": H, "Hkv": Hkv, "Sq": 1, "Skv": Skv, "D": D, "page": P, "bytes": nbytes}
    f, out, first = first_call(paged_gqa_decode, q, kp, vp, table)
    row.update(first)
    ref = paged_gqa_decode(q.double(), kp.double(), vp.double(), table)
    row["rel_err_vs_fp64"] = float((out.double() - ref).norm() / ref.norm())
    k, v = (p[table].permute(0, 2, 1, 3, 4).flatten(2, 3).contiguous() for p in (kp, vp))
    g = tc.compile(gqa_decode, fallback="raise")
    g(q, k, v)
    times, _ = interleaved_ms({"ours": lambda: f(q, kp, vp, table), "contiguous": lambda: g(q, k, v),
                               "spec": lambda: paged_gqa_decode(q, kp, vp, table)})  # the spec: gather, then SDPA
    row.update({f"{name}_ms": ms for name, ms in times.items()})
    contiguous_ms = row["contiguous_ms"]
    row["ours_tbs"] = nbytes / (row["ours_ms"] * 1e-3) / 1e12
    row["paged_over_contiguous"] = contiguous_ms / row["ours_ms"]
    clean = clean_flush_ms({"ours": lambda: f(q, kp, vp, table), "contiguous": lambda: g(q, k, v)})
    row["paged_over_contiguous_clean"] = clean["contiguous"] / clean["ours"]
    wider = torch.cat([table, torch.randint(0, n, (B, 1), device=dev)], 1)
    t0 = time.perf_counter()
    out = f(q, kp, vp, wider)
    torch.cuda.synchronize()
    row["wider_table_call_s"] = time.perf_counter() - t0
    row["programs"] = len(f.entries())  # 1: the wider table is served by the first call's program
    row["served"] = dict(f.served)
    ref = paged_gqa_decode(q.double(), kp.double(), vp.double(), wider)
    row["wider_rel_err_vs_fp64"] = float((out.double() - ref).norm() / ref.norm())
    # host time per call: a positional call of one layout (the host fast path's record replays it); with the
    # table as a keyword (no record: the guards, then the C Decoder); the same through the Python runner;
    # the contiguous kernel's positional call
    row["host_us"] = best_host_us(lambda: f(q, kp, vp, table))
    row["replayed"] = sum(rec.hits for rec in f._hot)
    f(q, kp, vp, block_table=table)  # a keyword call: its own entry, whose runner the Decoder serves
    hits = sum(r.decoder_hits for r in f.kernels())
    row["decoder_host_us"] = best_host_us(lambda: f(q, kp, vp, block_table=table))
    row["c_launched"] = sum(r.decoder_hits for r in f.kernels()) > hits
    runners = f.kernels()  # the keyword call's own entry among them
    for r in runners:
        r._decoder_ok = False
    row["python_host_us"] = best_host_us(lambda: f(q, kp, vp, block_table=table))
    for r in runners:
        r._decoder_ok = r.decodable
    row["contiguous_host_us"] = best_host_us(lambda: g(q, k, v))
    return row


@contextmanager
def source_defines(defines: dict[str, object]) -> Iterator[None]:
    """Kernels lowered inside get these preprocessor defines ahead of their source (the kernel cache keys by
    source, so each set is its own build): copy.cuh's and decode_kernel.cuh's switches, the diagnostics' trace."""
    import torch_cubridge.lower as lowering
    base = lowering.lower
    head = "".join(f"#define {n} {v}\n" for n, v in defines.items())
    lowering.lower = lambda *a, **kw: replace(low := base(*a, **kw), source=head + low.source)
    try:
        yield
    finally:
        lowering.lower = base


def ab(configs: str, lengths: list[int], B: int = 8) -> list[dict]:
    """Decode kernel variants timed back to back in this process: "stages=3,ctas=2;splits=4;..." sets the
    K/V ring depth (DecodeTile), the split rule's CTAs per multiprocessor (ops/decode_launch.py; either left out:
    the tile's own, printed as None), a fixed number
    of splits or the copies' L2 prefetch hint (l2=0, 128 or 256, copy.cuh); SDPA-flash is timed at each length in the same process."""
    import torch_cubridge.lower.choice as source  # the kernel choice reads decode_tile here
    import torch_cubridge.ops.decode_launch as runner
    base_tile, base_ctas, base_split = source.decode_tile, runner.DECODE_CTAS_PER_SM, runner.decode_split
    out = []
    for Skv in lengths:
        dev, dt = "cuda", torch.bfloat16
        q = torch.randn(B, 32, 1, 128, device=dev, dtype=dt)
        k, v = (torch.randn(B, 8, Skv, 128, device=dev, dtype=dt) for _ in range(2))
        nbytes = 2 * (2 * B * 8 * Skv * 128 + 2 * B * 32 * 128)
        ms = bench(lambda: sdpa("flash", q, k, v))
        out.append({"B": B, "Skv": Skv, "impl": "sdpa_flash", "ms": ms, "tbs": nbytes / (ms * 1e-3) / 1e12})
        ms = bench(lambda: sdpa("cudnn", q, k, v))
        out.append({"B": B, "Skv": Skv, "impl": "sdpa_cudnn", "ms": ms, "tbs": nbytes / (ms * 1e-3) / 1e12})
        print(json.dumps(out[-1]), flush=True)
        for cfg in configs.split(";"):
            kv = dict(x.split("=") for x in cfg.split(",")) if cfg.strip() else {}
            st = int(kv.get("stages", 0)) or None
            ctas = int(kv["ctas"]) if "ctas" in kv else base_ctas  # None: the tile's own (decode_ctas_per_sm)
            bn = int(kv.get("bn", 0))  # keys per K/V block (DecodeTile's BLOCK_N)
            if st is not None or bn:
                source.decode_tile = lambda d, dv=None, paged=False, st=st, bn=bn: replace(
                    t := base_tile(d, dv, paged), stages=st or t.stages, block_n=bn or t.block_n)
            runner.DECODE_CTAS_PER_SM = ctas
            l2 = int(kv["l2"]) if "l2" in kv else None  # the copies' L2 prefetch hint, a define ahead of the source
            n = int(kv.get("splits", 0))
            if n:
                runner.decode_split = lambda c, n_blk, sms, per_sm=1, min_blocks=1, n=n: (-(-n_blk // -(-n_blk // n)), -(-n_blk // n))
            try:
                with source_defines({} if l2 is None else {"CUBRIDGE_L2_PREFETCH": l2}):
                    f = tc.compile(gqa_decode, fallback="raise")
                    o = f(q, k, v)
                ref = gqa_decode(q.double(), k.double(), v.double())
                ms = bench(lambda: f(q, k, v))
                out.append({"B": B, "Skv": Skv, "stages": st, "block_n": bn or None, "ctas_per_sm": ctas, "splits": n or None, "l2": l2, "ms": ms,
                             "tbs": nbytes / (ms * 1e-3) / 1e12,
                             "rel_err_vs_fp64": float((o.double() - ref).norm() / ref.norm())})
            finally:
                source.decode_tile, runner.DECODE_CTAS_PER_SM = base_tile, base_ctas
                runner.decode_split = base_split
            print(json.dumps(out[-1]), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--lengths", default="4096,32768")
    ap.add_argument("--sq", default="1,4")
    ap.add_argument("--batch", default="8", help="batch sizes of the contiguous rows")
    ap.add_argument("--pages", default="16,256", help="page sizes for the paged rows ('' for none)")
    # a paged program is generic in the table width since 974d213 (it was held at its shape and verified
    # there: 90 s at 4k on the CPU at 6946744, 20 s at 32k on the GPU at e61b27b)
    ap.add_argument("--paged-lengths", default="4096,32768")
    ap.add_argument("--paged-batch", default="8", help="batch sizes of the paged rows")
    ap.add_argument("--ab", default="", help='decode kernel A/B, e.g. "stages=2;stages=3,bn=128;ctas=3"')
    a = ap.parse_args()
    warnings.filterwarnings("ignore")
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    if a.ab:
        res = [r for B in map(int, a.batch.split(",")) for r in ab(a.ab, [int(x) for x in a.lengths.split(",")], B)]
        save(a.out, "bench_decode_ab", {"rows": res})
        for r in res:
            what = r.get("impl") or (f"stages {r['stages']} block_n {r.get('block_n')} ctas/SM {r['ctas_per_sm']} "
                                     f"splits {r['splits']}")
            print(f"B {r['B']:2d} {r['Skv']:6d} {what}: {r['tbs']:.2f} TB/s")
        return
    rows = []
    for B in map(int, a.batch.split(",")):
        for Sq in [int(x) for x in a.sq.split(",") if x]:
            for Skv in map(int, a.lengths.split(",")):
                rows.append(run(B, 32, 8, Sq, Skv, 128))
            print(json.dumps(rows[-1]), flush=True)
    paged = []
    for P in [int(x) for x in a.pages.split(",") if x]:
        for Skv in [int(x) for x in a.paged_lengths.split(",") if x]:
            for B in map(int, a.paged_batch.split(",")):
                paged.append(run_paged(B, 32, 8, Skv, 128, P))
            print(json.dumps(paged[-1]), flush=True)
    save(a.out, "bench_decode", {"rows": rows, "paged": paged})
    print(f"{'B':>2} {'Sq':>3} {'Skv':>6} {'kernel':>7} {'ours TB/s':>9} {'flash':>6} {'cudnn':>6} {'flex':>6} {'/flash':>6} {'/flex':>6}"
          "  clean flush: ours /flash  /flex")
    for r in rows:
        g = lambda k: r.get(k) or 0.0  # noqa: E731
        ratio = lambda a, b: g(a) / g(b) if g(b) else 0.0  # noqa: E731
        print(f"{r['B']:2d} {r['Sq']:3d} {r['Skv']:6d} {r['kernel']:>7} {g('ours_tbs'):9.2f} {g('sdpa_flash_tbs'):6.2f} "
              f"{g('sdpa_cudnn_tbs'):6.2f} {g('flex_tbs'):6.2f} {ratio('sdpa_flash_ms', 'ours_ms'):6.2f} "
              f"{ratio('flex_ms', 'ours_ms'):6.2f}  {g('ours_clean_tbs'):16.2f} {ratio('sdpa_flash_clean_ms', 'ours_clean_ms'):6.2f} "
              f"{ratio('flex_clean_ms', 'ours_clean_ms'):6.2f}")
    print(f"{'B':>2} {'page':>4} {'Skv':>6} {'kernel':>12} {'TB/s':>6} {'paged/contiguous':>16} {'clean':>6} {'spec ms':>8} "
          f"{'first s':>7} {'wider s':>7} {'programs':>8} {'host us replay/C/Py/contig':>26}")
    for r in paged:
        print(f"{r['B']:2d} {r['page']:4d} {r['Skv']:6d} {r['kernel']:>12} {r['ours_tbs']:6.2f} "
              f"{r['paged_over_contiguous']:16.3f} {r['paged_over_contiguous_clean']:6.3f} {r['spec_ms']:8.3f} {r['first_call_s']:7.2f} "
              f"{r['wider_table_call_s']:7.3f} {r['programs']:8d} "
              f"{r['host_us']:6.1f}/{r['decoder_host_us']:5.1f}/{r['python_host_us']:5.1f}/{r['contiguous_host_us']:5.1f}")


if __name__ == "__main__":
    main()
