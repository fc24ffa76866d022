"""Where a decode call's time goes, CTA by CTA: the kernel built with CUBRIDGE_TRACE records, per CTA, the GPU's
global timer at entry, when its first K/V block is in shared memory, after its last block, and at its end
(decode_kernel.cuh). After a clean L2 flush (a read, diag_l2_flush.py), each configuration is called a few
times and the timelines summarised: when CTAs start, how long their first block takes to arrive, how long
they stream, and how far apart they finish.

Configurations as diag_fixed_cost.py's ("name:kind:stages:ctas"), our kernels only. Usage:
python benchmarks/diag_decode_timeline.py [--out DIR] [--lengths 4096] [--configs ...]
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from torch_cubridge.ops.launch import libcuda  # noqa: E402
from bench_decode import source_defines  # noqa: E402
from diag_fixed_cost import decode_case, decode_config  # noqa: E402
from timing import read_flush  # noqa: E402

SLOTS = 4 * 65536


def trace_of(kern, name: bytes = b"cubridge_trace") -> tuple[int, int]:
    """The device address and size of the kernel module's cubridge_trace (or another global)."""
    cu = libcuda()
    ld = kern._only or next(iter(kern._per_device.values()))
    ptr, size = ctypes.c_uint64(), ctypes.c_size_t()
    fn = cu.lib.cuModuleGetGlobal_v2
    fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_void_p, ctypes.c_char_p]
    cu.check(fn(ctypes.byref(ptr), ctypes.byref(size), ctypes.c_void_p(ld.module), name), "cuModuleGetGlobal")
    return ptr.value, size.value


def read_words(ptr: int, ctype, n: int) -> list[int]:
    """n words of type `ctype` from device address `ptr`."""
    cu = libcuda()
    host = (ctype * n)()
    fn = cu.lib.cuMemcpyDtoH_v2
    fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t]
    cu.check(fn(ctypes.addressof(host), ptr, ctypes.sizeof(host)), "cuMemcpyDtoH")
    return list(host)


def read_trace(ptr: int, n: int) -> list[tuple[int, int, int, int]]:
    words = read_words(ptr, ctypes.c_uint64, 4 * n)
    return [tuple(words[4 * i:4 * i + 4]) for i in range(n)]


def summary(rows: list[tuple[int, int, int, int]]) -> dict:
    t0 = min(r[0] for r in rows)
    us = lambda x: x / 1e3  # noqa: E731 (ns -> us)
    start = [us(r[0] - t0) for r in rows]
    first = [us(r[1] - r[0]) for r in rows]
    stream = [us(r[2] - r[1]) for r in rows]
    loop_end = [us(r[2] - t0) for r in rows]
    end = [us(r[3] - t0) for r in rows]
    med = statistics.median
    return {"ctas": len(rows), "start_med_us": med(start), "start_max_us": max(start),
            "first_block_med_us": med(first), "first_block_max_us": max(first),
            "stream_med_us": med(stream), "stream_min_us": min(stream), "stream_max_us": max(stream),
            "loop_end_med_us": med(loop_end), "loop_end_max_us": max(loop_end), "end_max_us": max(end)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--lengths", default="4096")
    ap.add_argument("--configs", default="contig:contiguous:0:0;contig_2x2:contiguous:2:2;paged16:paged16:0:0;"
                    "paged256:paged256:0:0")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--pool-scale", default="1", help="paged: pools of this many times the pages read (comma list)")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), flush=True)
    clean = read_flush()
    out = []
    with source_defines({"CUBRIDGE_TRACE": 1}):
        for cfg in args.configs.split(";"):
            name, kind, st, ctas = cfg.split(":")
            with decode_config(int(st), int(ctas)):
                for Skv, scale in ((int(x), int(m)) for x in args.lengths.split(",") for m in args.pool_scale.split(",")):
                    if scale > 1 and not kind.startswith("paged"):
                        continue
                    fn, f = decode_case(kind, Skv, scale)
                    fn()
                    torch.cuda.synchronize()
                    kern = f.kernels()[-1].kernel
                    ptr, _ = trace_of(kern)
                    sm_ptr, _ = trace_of(kern, b"cubridge_trace_sm")
                    for i in range(args.calls):
                        clean()
                        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        s.record()
                        fn()
                        e.record()
                        torch.cuda.synchronize()
                        # the grid: as many CTAs as wrote an entry this call (entries of other calls are older)
                        rows = read_trace(ptr, 4096)
                        newest = max(r[0] for r in rows)
                        live = [r for r in rows if r[0] and newest - r[0] < 40_000 and r[3] >= r[0]]
                        row = {"config": name, "Skv": Skv, "pool_scale": scale, "call": i, "event_us": s.elapsed_time(e) * 1e3, **summary(live)}
                        if i == args.calls - 1:  # the last call CTA by CTA: index, multiprocessor, the four times
                            sms = read_words(sm_ptr, ctypes.c_uint32, 4096)
                            row["raw"] = [(c, sms[c], *rows[c]) for c in range(4096) if rows[c] in live]
                        out.append(row)
                        print(json.dumps({k: v for k, v in row.items() if k != "raw"}), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "decode_timeline.json").write_text(json.dumps(out, indent=1))
    keys = ("event_us", "ctas", "start_max_us", "first_block_med_us", "first_block_max_us", "stream_med_us",
            "stream_max_us", "loop_end_med_us", "loop_end_max_us", "end_max_us")
    print(f"{'config':>11} {'Skv':>6} {'pool':>4} " + " ".join(f"{k[:-3] if k.endswith('_us') else k:>10}" for k in keys))
    for r in out:
        if r["call"] == args.calls - 1:
            print(f"{r['config']:>11} {r['Skv']:>6} {r['pool_scale']:>4} " + " ".join(f"{r[k]:10.1f}" for k in keys))


if __name__ == "__main__":
    main()
