"""The spec evaluated in float64, the ground truth for verification, or in float32, the kernel's own
precision (see verify.cpu.judge): on the CPU, or on the call's CUDA device for large trials."""
from __future__ import annotations

import contextlib
import copy
import threading
from typing import Any, Callable, Iterator

import torch

from ..capture.trace import _rebuild_call
from ..ir.bind import call_device

CPU = torch.device("cpu")
# Trials with at least this many score elements (B * H * Sq * Skv) run in float64 on the call's CUDA
# device where it has one: a paged decode held at its shape (B 8, 32 heads, 4k keys) spent 35 s of its
# first call verifying on the CPU. Smaller trials stay on the CPU, where the float64 maths is the same.
DEVICE_MIN_SCORES = 1 << 20


def reference_device(example: dict[str, Any], sizes: dict[str, int]) -> torch.device:
    """Where a trial at `sizes` runs its float64 spec and program: the call's CUDA device for large ones,
    by scores or by arguments that keep their size at any length (a page pool: redrawing 2 x 268M
    elements for each trial took most of a 32k paged first call on the CPU)."""
    dev = call_device(example)
    if dev.type != "cuda":
        return CPU
    big = sizes["B"] * sizes["H"] * sizes["Sq"] * sizes["Skv"] >= DEVICE_MIN_SCORES
    return dev if big or _elements(example) >= DEVICE_MIN_ELEMENTS else CPU


DEVICE_MIN_ELEMENTS = 1 << 25


def _elements(example: dict[str, Any]) -> int:
    return sum(v.numel() for v in example.values() if isinstance(v, torch.Tensor))


_local = threading.local()


@contextlib.contextmanager
def module_copies() -> Iterator[None]:
    """Within: a module argument is converted once per (dtype, device) and reused by every trial. An
    8-layer llama's first generate spent 13 of 46 s copying each layer's attention module (42M
    parameters) to float64 for every trial and every run of the spec."""
    outer = getattr(_local, "memo", None)
    _local.memo = {} if outer is None else outer
    try:
        yield
    finally:
        _local.memo = outer


BIG = 1 << 24  # elements: a tensor this large that keeps its size in every trial is drawn once per verification


def once(key: tuple, hold: Any, make: Callable[[], Any]) -> Any:
    """make() once per `key` within module_copies() (every trial of one verification), else every time.
    `hold` is kept with the result, so an id() in the key is not reused while the memo lives."""
    memo = getattr(_local, "memo", None)
    if memo is None:
        return make()
    if key not in memo:
        memo[key] = (hold, make())
    return memo[key][1]


def to64(v: Any, dtype: torch.dtype = torch.float64, device: torch.device = CPU) -> Any:
    """v on `device` with its floating-point tensors (a module's too, on a copy) in `dtype`."""
    if isinstance(v, torch.nn.Module):
        if _module_in(v, dtype, device):  # a copy made here already
            return v
        return once((id(v), dtype, device), v, lambda: _module_copy(v, dtype, device))
    if isinstance(v, torch.Tensor):
        if v.numel() >= BIG:  # a page pool drawn once (verify/inputs.py) is converted once too
            return once(("to", id(v), dtype, device), v, lambda: _converted(v, dtype, device))
        return _converted(v, dtype, device)
    if isinstance(v, (tuple, list)):  # (cos, sin) passed as one argument
        return type(v)(to64(x, dtype, device) for x in v)
    return v


def _converted(v: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    v = v.detach().to(device)
    return v.to(dtype) if v.is_floating_point() else v


def _module_copy(m: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """m with its parameters and buffers (and its submodules') converted, the caller's untouched; plain
    attributes are shared (a deep copy of a model's config and rotary tables cost seconds)."""
    c = copy.copy(m)

    def conv(t: torch.Tensor) -> torch.Tensor:
        t = t.detach().to(device)
        return t.to(dtype) if t.is_floating_point() else t
    c.__dict__["_parameters"] = {k: None if t is None else torch.nn.Parameter(conv(t), requires_grad=False)
                                 for k, t in m._parameters.items()}
    c.__dict__["_buffers"] = {k: None if t is None else conv(t) for k, t in m._buffers.items()}
    c.__dict__["_modules"] = {k: None if s is None else _module_copy(s, dtype, device) for k, s in m._modules.items()}
    return c


def _module_in(m: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> bool:
    ts = [t for t in (*m.parameters(), *m.buffers()) if t.is_floating_point()]
    return bool(ts) and all(t.dtype == dtype and t.device == device and not t.requires_grad for t in ts)


def run_reference(fn: Callable, bound: dict[str, Any], dtype: torch.dtype = torch.float64,
                  device: torch.device = CPU) -> Any:
    """The spec on `device` with every floating-point input cast to `dtype` (float64: the ground truth)."""
    b = {k: to64(v, dtype, device) for k, v in bound.items()}
    args, kwargs = _rebuild_call(fn, b)
    with torch.no_grad():
        return fn(*args, **kwargs)


def attention_output(result: Any, index: int, tuple_len: int) -> torch.Tensor:
    return result[index] if tuple_len else result


def returned_lse(result: Any, lse_index: int) -> torch.Tensor | None:
    """The rows' log-sum-exp a result holds at `lse_index` (Output.lse_index; -1: none)."""
    return result[lse_index] if lse_index >= 0 and isinstance(result, (tuple, list)) else None


def lse_error(got: torch.Tensor | None, ref: torch.Tensor | None) -> float:
    """How far a returned log-sum-exp is from the spec's: the largest |got - ref| / max(1, |ref|) over rows
    with a key (a row with every key masked is -inf in both, or it is inf)."""
    if ref is None:
        return 0.0
    if got is None or tuple(got.shape) != tuple(ref.shape):
        return float("inf")
    ref = ref.detach().double()
    got = got.detach().to(ref.device, torch.float64)
    empty = torch.isneginf(ref)
    if not torch.equal(empty, torch.isneginf(got)) or torch.isnan(got).any() or torch.isnan(ref).any():
        return float("inf")
    if bool(empty.all()):
        return 0.0
    g, r = got[~empty], ref[~empty]
    return float(((g - r).abs() / r.abs().clamp_min(1.0)).max())


def reference_output(fn: Callable, bound: dict[str, Any], index: int, tuple_len: int,
                     device: torch.device = CPU, lse_index: int = -1) -> tuple[Any, ...]:
    """(the spec's output, the dtype it ran in): float64, or float32 for a spec that fixes float32
    somewhere (positions made with .float() meeting float64 weights) and so cannot run in float64.
    With `lse_index`, the log-sum-exp the spec returns there comes third."""
    try:
        res, dt = run_reference(fn, bound, device=device), "float64"
    except Exception:
        res, dt = run_reference(fn, bound, torch.float32, device), "float32"
    out = attention_output(res, index, tuple_len)
    return (out, dt, returned_lse(res, lse_index)) if lse_index >= 0 else (out, dt)
