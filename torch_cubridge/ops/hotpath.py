"""The host fast path: a call that repeats a launched call's exact layout skips the Python runner.

After the runner serves a call by one launch (`KernelRunner.replayable`), a record of that launch is made
(csrc/host/hotpath.c): the arguments' types, dtypes, devices, shapes, strides and plain values, the stream,
the kernel's parameter blocks and where q's, k's, v's and the output's pointers go in them. A later call
that matches a record in every one of those is launched from C: its pointers patched in, its output
allocated, one cuLaunchKernel, no guard evaluation (the guards are functions of sizes and plain values,
which match the call that passed them). Everything else (another shape, keywords, a module argument,
a tensor that requires grad, rows not 16-byte aligned, another stream, a CUDA graph capturing a decode
call) misses and takes the Python path, which may record it.

The C module is built on a helper thread at the first record (ops/host_module.py); until it is there, where it
cannot be built, or with CUBRIDGE_HOTPATH=0, every call takes the Python path.
"""
from __future__ import annotations

import os
import threading
from types import ModuleType
from typing import Any

import torch

from .host_module import load_module
from ..capture import signature

_PLAIN = (int, float, bool, str, type(None))
MAX_RECORDS = 8  # per compiled function; past it the oldest goes

_module: ModuleType | None = None
_thread: threading.Thread | None = None
_lock = threading.Lock()
failure: str = ""  # why the module is not there, for explain()


def enabled() -> bool:
    return os.environ.get("CUBRIDGE_HOTPATH", "1").strip().lower() not in ("0", "false", "no", "off")


def module() -> ModuleType | None:
    """The C module once built and loaded; the first request starts the build on a helper thread."""
    global _thread
    if not enabled():
        return None
    if _module is not None:
        return _module
    with _lock:
        if _thread is None:
            _thread = threading.Thread(target=_load, name="cubridge-hotpath-build", daemon=True)
            _thread.start()
    return _module


def wait(timeout: float | None = None) -> ModuleType | None:
    """The module, waiting for its build (tests, benchmarks)."""
    module()
    if _thread is not None:
        _thread.join(timeout)
    return _module


def _load() -> None:
    global _module, failure
    try:
        mod = load_module()
        signature.adopt_c(mod)  # before the module is published: call keys come from C from then on
        _module = mod
    except Exception as e:  # no compiler, no headers, read-only without a built module: Python serves
        failure = f"{type(e).__name__}: {e}"


_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)


def record(runner: Any, args: tuple, out: Any) -> Any | None:
    """A record of the launch `runner` just made for `args` (positional only), or None where it cannot be
    replayed: a copy was made (strides or alignment the kernel does not read in place), an argument is
    not a tensor or a plain value, or the module is not built yet."""
    mod = module()
    last = runner.take_launch()
    at = runner.replay_sources()
    if mod is None or last is None or type(out) is not torch.Tensor or at is None or max(at) >= len(args):
        return None
    grid, blocks, stream, device, keep = last
    expect, is_tensor = [], []
    for a in args:
        if type(a) is torch.Tensor:
            expect.append((a.dtype, a.get_device(), tuple(a.shape), a.stride()))
            is_tensor.append(True)
        elif type(a) in _PLAIN:
            expect.append(a)
            is_tensor.append(False)
        else:
            return None
    patches = tuple((src, blk % len(blocks), off, tmap) for src, blk, off, tmap in runner.replay_patches())
    ptrs = [args[i].data_ptr() for i in at] + [out.data_ptr()]
    if any(int.from_bytes(blocks[blk][off:off + 8], "little") != ptrs[src] for src, blk, off, tmap in patches
           if not tmap):
        return None  # the runner copied an argument: the kernel read the copy, not the argument
    kern = runner.kernel
    capturing = _capturing if keep is not None and _capturing is not None else None
    try:
        return mod.Record(tuple(expect), tuple(is_tensor), tuple(at), patches, tuple(bytes(b) for b in blocks),
                          kern.handle(device), tuple(grid), kern.threads, kern.smem_bytes, stream, device,
                          torch.Tensor, tuple(out.shape), out.stride(), at[0], torch._C._cuda_getCurrentRawStream,
                          capturing,
                          (keep, runner))
    except Exception:
        return None
