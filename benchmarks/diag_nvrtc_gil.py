"""Does an NVRTC build leave the GIL to other threads? (pipeline.build_early relies on it.)

Builds one Hopper kernel (the zoo's causal program, D 128) on the main thread, then again (another
define, so nothing is memoised) on a helper thread while the main thread counts in a loop; prints the
build times and the loop's rate during the build against its rate alone.
Usage: python benchmarks/diag_nvrtc_gil.py [backend: cuda-python|ctypes]
"""
from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "tests")]
import torch  # noqa: E402

import torch_cubridge as tc  # noqa: E402
from torch_cubridge.build import nvrtc  # noqa: E402
from torch_cubridge.config import csrc_dir  # noqa: E402
from torch_cubridge.lower import lower  # noqa: E402
from zoo import CASES  # noqa: E402


def spin(seconds: float, stop=None) -> float:
    n, t0 = 0, time.perf_counter()
    while (stop is None and time.perf_counter() - t0 < seconds) or (stop is not None and not stop.is_set()):
        n += 1
    return n / (time.perf_counter() - t0)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "ctypes":
        nvrtc._api.cache_clear()
        nvrtc._load_cuda_python = lambda: None
    c = next(c for c in CASES if c.name == "causal_sdpa")
    src = lower(tc.transfer(c.fn, *c.make(2, 4, 2, 70, 128, torch.float32)), arch="sm_90a", head_dim=128).source
    print("nvrtc through", nvrtc._api().origin)
    t0 = time.perf_counter()
    nvrtc.compile_cubin(src, "sm_90a", [csrc_dir()], {"CB_GIL_PROBE": 1})
    alone = time.perf_counter() - t0
    base = spin(1.0)
    stop, took = threading.Event(), {}

    def build() -> None:
        t = time.perf_counter()
        nvrtc.compile_cubin(src, "sm_90a", [csrc_dir()], {"CB_GIL_PROBE": 2})
        took["s"] = time.perf_counter() - t
        stop.set()

    th = threading.Thread(target=build)
    th.start()
    during = spin(0, stop)
    th.join()
    print(f"build alone {alone:.2f} s, on a helper thread {took['s']:.2f} s; main loop {during / base:.2f} of its "
          "rate alone (1.0: the GIL was free)")


if __name__ == "__main__":
    main()
