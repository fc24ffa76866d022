"""Per-call host time of our launchers vs torch SDPA on a tiny shape.

Usage (GPU machine): python benchmarks/launch_overhead.py [--n 10000]
Writes launch_overhead.json to $OUT when OUT is set.

Two numbers per row:
  stream_us  N launches back to back, one host clock around them, / N
             (the brief's measure; includes any queue back-pressure)
  host_us    the same N in batches of 200 with a sync between batches,
             only the launch loops timed: the pure host cost per call
Also times compiling a tiny kernel with each available compiler.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import struct
import time
from pathlib import Path
from typing import Callable

import torch

from torch_cubridge import build, config
from torch_cubridge.build import nvcc, nvrtc
from torch_cubridge.ops import launch as L
from timing import host_us  # benchmarks/, beside this script

NOOP_SRC = r"""
#include <cuda_bf16.h>
#include "cubridge/variant.cuh"
extern "C" __global__ void noop(cubridge::FwdArgs a, cubridge::DefaultVariant::Params p) {
  if (a.B < 0) ((float*)a.o)[threadIdx.x] = (float)p.unused;  // never true
}
"""
N_FWD_FIELDS = 23  # cubridge::FwdArgs: 5 pointers, 17 long longs, 1 double
BATCH = 200


def _time(fn: Callable[[], None], n: int) -> dict[str, float]:
    stream_us = host_us(fn, n, warmup=200)
    host_s = 0.0
    for _ in range(max(1, n // BATCH)):
        t0 = time.perf_counter()
        for _ in range(BATCH):
            fn()
        host_s += time.perf_counter() - t0
        torch.cuda.synchronize()
    return {"stream_us": stream_us, "host_us": host_s / (max(1, n // BATCH) * BATCH) * 1e6}


def _compile_times(arch: str) -> dict[str, float]:
    inc = [config.csrc_dir()]
    res = {}
    for name, mod in (("nvrtc", nvrtc), ("nvcc", nvcc)):
        if not mod.available():
            continue
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            mod.compile_cubin(NOOP_SRC, arch, inc, None)
            times.append(time.perf_counter() - t0)
        res[f"{name}_first_s"] = times[0]
        res[f"{name}_best_s"] = min(times)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=10000)
    n = ap.parse_args().n

    dev = torch.cuda.get_device_name()
    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}"
    compile_s = _compile_times(arch)
    cubin = build.compile_cubin(NOOP_SRC, arch, include_dirs=[config.csrc_dir()])

    out = torch.empty(64, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    fields = [out.data_ptr()] * 5 + [1] * 17
    fwd = struct.pack("<5Q17qd", *fields, 0.125)
    params = struct.pack("<q", 0)
    blocks = [fwd, params]
    grid = (1, 1, 1)

    rows: dict[str, dict[str, float]] = {}
    backends = ["ctypes"]
    try:
        L._cuda_python_driver()
        backends.append("cuda-python")
    except L.CudaDriverError:
        pass
    for be in backends:
        k = L.CubinKernel(cubin, "noop", threads=128, smem_bytes=0, backend=be)
        k.launch(grid, blocks, stream)
        rows[f"CubinKernel[{be}] prepacked"] = _time(lambda k=k: k.launch(grid, blocks, stream), n)
        packer = struct.Struct("<5Q17qd")

        def with_pack(k=k) -> None:
            k.launch(grid, [packer.pack(*fields, 0.125), params], stream)

        rows[f"CubinKernel[{be}] + struct.pack"] = _time(with_pack, n)

    # Lower bound: the bare driver call through ctypes, no wrapper at all.
    k = L.CubinKernel(cubin, "noop", threads=128, smem_bytes=0, backend="ctypes")
    k.launch(grid, blocks, stream)
    ld, kp, raw = k._only or next(iter(k._per_device.values())), k._kparams, L.libcuda().lib.cuLaunchKernel
    rows["raw ctypes cuLaunchKernel"] = _time(
        lambda: raw(ld.fn_obj, 1, 1, 1, 128, 1, 1, 0, stream, kp, None), n
    )
    # Same, but through a PyDLL handle that keeps the GIL during the call.
    pyraw = ctypes.PyDLL("libcuda.so.1").cuLaunchKernel
    pyraw.argtypes, pyraw.restype = raw.argtypes, ctypes.c_int
    rows["raw ctypes (PyDLL, GIL held)"] = _time(
        lambda: pyraw(ld.fn_obj, 1, 1, 1, 128, 1, 1, 0, stream, kp, None), n
    )

    if "cuda-python" in backends:
        drv = L._cuda_python_driver()
        kc = L.CubinKernel(cubin, "noop", threads=128, smem_bytes=0, backend="cuda-python")
        kc.launch(grid, blocks, stream)
        ldc = kc._only or next(iter(kc._per_device.values()))
        cs, kpa = drv.CUstream(stream), kc._kparams_addr
        rows["raw cuda-python cuLaunchKernel"] = _time(
            lambda: drv.cuLaunchKernel(ldc.fn_obj, 1, 1, 1, 128, 1, 1, 0, cs, kpa, 0), n
        )

    q = torch.randn(1, 1, 16, 64, device="cuda", dtype=torch.bfloat16)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    rows["torch SDPA B1 H1 S16 D64 bf16"] = _time(lambda: sdpa(q, q, q), n)
    torch.cuda.synchronize()

    print(f"device: {dev} ({arch}), torch {torch.__version__}, N={n}")
    print("compile (tiny kernel incl. cuda_bf16.h + variant.cuh):")
    for key, v in compile_s.items():
        print(f"  {key:16s} {v:8.3f} s")
    print(f"{'launcher':38s} {'stream_us':>10s} {'host_us':>10s}")
    for name, r in rows.items():
        print(f"{name:38s} {r['stream_us']:10.2f} {r['host_us']:10.2f}")

    if os.environ.get("OUT"):
        result = {"device": dev, "arch": arch, "torch": torch.__version__, "n": n,
                  "compile_s": compile_s, "launch": rows, "auto_backend": L.auto_backend()}
        path = Path(os.environ["OUT"]) / "launch_overhead.json"
        path.write_text(json.dumps(result, indent=2))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
