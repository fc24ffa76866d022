"""The kernel build, started on a helper thread before verification ends.

NVRTC takes 1.3-1.5 s for a new Hopper kernel; the size probes, the guards' symbolic trace and CPU
verification about 0.8 s. So the kernel of the transferred program is built meanwhile on a helper thread
(NVRTC drops the GIL). Lowering reads neither guards, nor required sizes, nor scalar values, so the program
before generalisation and guarding lowers to the same source as a rule; where it does not, the second
source builds on the other worker and the first is wasted. A program that then fails verification leaves
a cubin in the cache that nothing serves. The compiler itself is loaded there too while the first capture
runs (warm_compiler). A call that wants gradients has its backward kernel built there too
(build_backward_early), which its first backward takes (backward_cubin).
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from .. import config
from ..ir.program import Program

_early: dict[str, Future] = {}
_early_lock = threading.Lock()
_builder: ThreadPoolExecutor | None = None
_compiler_warm = threading.Event()


def build_early(prog: Program, bound: dict[str, Any], device: torch.device) -> None:
    """Start building the kernel a call of `prog` on `device` asks for first (its fast-tanh variant); never
    raises: the build is tried again, in order, where the kernel is asked for."""
    try:
        if config.is_readonly():
            return
        from ..lower import lower
        from ..lower.choice import choose_kernel
        from ..ops.kernel import kernel_key, load_kernel
        from .arch import arch_for
        arch = arch_for(device)
        low = lower(prog, choice=choose_kernel(prog, bound, arch), fast_tanh=True)
        key = kernel_key(low, arch)
        with _early_lock:
            if key in _early:
                return
            for done in [k for k, f in _early.items() if f.done()]:  # never asked for: verification failed
                del _early[done]  # (its cubin stays in the disk cache)
            _early[key] = _helper().submit(load_kernel, low, arch)
    except Exception:
        return


def build_backward_early(prog: Program, bound: dict[str, Any], device: torch.device) -> None:
    """Where the call wants gradients (grad mode on, a tensor argument that requires them), start building the
    backward kernel its first backward asks for (ops/backward_gpu.GpuBackward: the same source, key and disk
    cache), so that NVRTC's 1-2 s for it run beside the forward's build and verification, not after them.
    Never raises: the backward builds it in order where this did not."""
    try:
        from ..capture.nesting import caller_wants_grad
        wanting = [t for t in bound.values() if isinstance(t, torch.Tensor) and t.requires_grad]
        if config.is_readonly() or not caller_wants_grad() or not wanting:
            return
        from ..ir.bind import lookup, operand_value, to_canonical
        from ..ir.prologue import run_prologue
        from ..lower.backward import lower_backward
        from .arch import backward_arch
        from ..ops.kernel import backward_key
        made = run_prologue(prog, bound, device)  # with gradients off (a stage's): shapes and dtypes alone
        q, v = (operand_value(bound, op, made) for op in (prog.q, prog.v))
        if q.dtype not in (torch.bfloat16, torch.float16):
            return
        qkv = {op.arg for op in (prog.q, prog.k, prog.v)}
        others = any(t.is_floating_point() for n, t in bound.items()
                     if isinstance(t, torch.Tensor) and t.requires_grad and n not in qkv)

        def learnable(x: Any) -> bool:  # an argument that requires gradients, or a step made from one
            if x.arg is not None:
                t = lookup(bound, x.arg)
                return isinstance(t, torch.Tensor) and t.requires_grad
            return x.step is not None and others
        learn = tuple(x.name for x in prog.extras if x.dtype.startswith(("float", "bfloat")) and learnable(x))
        arch = backward_arch(device)
        low = lower_backward(prog, arch, str(q.dtype).removeprefix("torch."), to_canonical(q, prog.q).shape[-1],
                             to_canonical(v, prog.v).shape[-1], learnable=learn,
                             deterministic=torch.are_deterministic_algorithms_enabled())
        key = backward_key(low, arch)
        with _early_lock:
            if key not in _early:
                _early[key] = _helper().submit(_cached_cubin, key, low.source, arch, low.kernels[1])
    except Exception:
        return


def backward_cubin(key: str, source: str, arch: str, kernel: str) -> tuple[bytes, dict]:
    """ops.kernel.cached_cubin, or the early build of the same backward source where one was started
    (info["early"] then)."""
    with _early_lock:
        fut = _early.pop(key, None)
    if fut is not None:
        try:
            cubin, info = fut.result()
            return cubin, {**info, "early": True}
        except Exception:
            pass  # built again here, where its error is reported
    return _cached_cubin(key, source, arch, kernel)


def _cached_cubin(key: str, source: str, arch: str, kernel: str) -> tuple[bytes, dict]:
    from ..ops.kernel import cached_cubin
    return cached_cubin(key, source, arch, kernel)


def warm_compiler() -> None:
    """Once per process, for a call that may build: load the compiler on the helper while capture runs."""
    if _compiler_warm.is_set():
        return
    _compiler_warm.set()
    if not config.is_readonly():
        from . import warm_up
        with _early_lock:
            _helper().submit(warm_up)


def building(low: Any, arch: str) -> bool:
    """Whether an early build of this source is still running."""
    from ..ops.kernel import kernel_key
    with _early_lock:
        fut = _early.get(kernel_key(low, arch))
    return fut is not None and not fut.done()


def load(low: Any, arch: str) -> tuple[Any, dict, dict]:
    """load_kernel, or the early build of the same source when one was started."""
    from ..ops.kernel import kernel_key, load_kernel
    with _early_lock:
        fut = _early.pop(kernel_key(low, arch), None)
    if fut is not None:
        try:
            return fut.result()
        except Exception:
            pass  # built again here, where its error is reported
    return load_kernel(low, arch)


def _helper() -> ThreadPoolExecutor:
    global _builder
    if _builder is None:
        _builder = ThreadPoolExecutor(max_workers=2, thread_name_prefix="cubridge-build")
    return _builder
