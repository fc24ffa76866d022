"""Verification of a compiled kernel on the GPU before it is swapped in.

Fresh inputs at two or more shapes with odd lengths, in the call's dtype,
extras redrawn; the output buffer is poisoned with NaN first, so an element
the kernel never writes fails. The reference is the spec in float64 (in float32 where a finite
fill resolves only in float64: see verify.cpu.judge); a half-dtype kernel that misses it is held to the
spec's own precision in that dtype (verify.cpu.no_worse_than_own_dtype). Every row is held to the kernel's
rounding in its dtype (verify.judge), not only the whole tensor's norm.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..ir.program import Program
from ..lower.tiles import DECODE_MAX_QUERIES, decode_call
from .cpu import Trial, VerifyReport, compare, judge, no_worse_than_own_dtype, rows_rule, trials
from .inputs import batch_moved, example_sizes, make_inputs, snap, within_guards
from .reference import (CPU, attention_output, lse_error, module_copies, reference_device, reference_output,
                        returned_lse)

REL_TOL = 1e-2
LSE_TOL = 1e-2  # a returned log-sum-exp, relative where it is above 1 in magnitude
# The call's own inputs are checked against a float64 reference of the whole call: up to 2^26
# score elements (seconds). Past that (8k x 8k x 2 heads took 100 s on the CPU) only the redrawn cases run.
OWN_INPUTS_LIMIT = 1 << 26


def gpu_shapes(p: Program, example: dict[str, Any]) -> list[dict[str, int]]:
    ex = example_sizes(p, example)
    fixed = dict(p.requires)
    square = ex["Sq"] == ex["Skv"]
    out = []
    pairs = ((300, 333), (77, 129), (130, 64))
    decode = decode_call(ex["Sq"]) and not square
    if decode:  # the decode kernel: one and several packed row tiles, one and many KV splits
        pairs = ((ex["Sq"], 333), (1, 129), (DECODE_MAX_QUERIES, 1000), (5, 77), (3, 4099))
    for sq, skv in pairs:
        skv = min(skv, ex["Skv"])
        sq = min(sq, skv) if decode else min(sq, ex["Sq"])  # any few queries the guards allow, never more than keys
        if square:
            skv = sq
        s = snap(p, dict(ex, Sq=sq, Skv=skv, B=min(ex["B"], 2)))
        s.update(fixed)
        if s not in out and within_guards(p, example, s):
            out.append(s)
    return batch_moved(p, example, out or [dict(ex)])


def to_device(bound: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """A trial's bound arguments on `device`: tensors moved, a module argument copied there where it is not."""
    out = {}
    for k, v in bound.items():
        if isinstance(v, torch.Tensor):
            out[k] = v.to(device)
        elif isinstance(v, torch.nn.Module):  # read where it lies; a copy moves, never the caller's module
            on = all(t.device == device for t in (*v.parameters(), *v.buffers()))
            out[k] = v if on else copy.deepcopy(v).to(device)
        else:
            out[k] = v
    return out


@dataclass
class GpuCase:
    """One trial's inputs (on the device) and the spec's output on them, computed before the kernel exists."""
    bound: dict[str, Any]
    sizes: dict[str, int]
    mag: float
    pattern: int | None
    ref: torch.Tensor
    ref_dtype: str
    ref_lse: torch.Tensor | None = None  # the log-sum-exp the spec returns too (Output.lse_index)


def gpu_cases(fn: Callable, p: Program, example: dict[str, Any], dtype: torch.dtype, device: torch.device,
              seed: int = 0) -> list[GpuCase]:
    """The trials and their float64 references: the call's own inputs first (`example`, on the device),
    then redrawn ones. Needs no kernel, so it runs while NVRTC builds one."""
    with module_copies():
        ex = example_sizes(p, example)
        raw: list[tuple[dict[str, Any], dict[str, int], float, int | None]] = []
        if ex["B"] * ex["H"] * ex["Sq"] * ex["Skv"] <= OWN_INPUTS_LIMIT:
            raw.append((example, ex, 1.0, -1))
        for i, (sizes, mag, pattern) in enumerate(trials(p, example, gpu_shapes(p, example), (1.0, 4.0), 333)):
            # drawn where they run: a pool drawn once per verification (verify/inputs.py) is then one device
            # tensor, converted to float64 once, where drawing it on the CPU copied 1 GB to the device and
            # converted it again for every trial (a 32k paged first call, H100)
            drawn = make_inputs(p, example, sizes, seed=9000 + i + 1000 * seed, magnitude=mag, dtype=dtype,
                                pattern=pattern, device=device)
            raw.append((to_device(drawn, device), sizes, mag, pattern))
        return [GpuCase(b, sizes, mag, pattern, *_reference(fn, p, b, reference_device(example, sizes)))
                for b, sizes, mag, pattern in raw]


def verify_kernel(run_bound: Callable[..., Any], fn: Callable, p: Program, example: dict[str, Any],
                  dtype: torch.dtype, device: torch.device, seed: int = 0,
                  cases: list[GpuCase] | None = None) -> VerifyReport:
    """`example` is the first real call's own arguments (on the device): they are the first trial.
    `cases`: gpu_cases of the same arguments, where the caller computed them already."""
    if cases is None:
        cases = gpu_cases(fn, p, example, dtype, device, seed)
    rep = VerifyReport(ok=True)
    with module_copies():
        for c in cases:
            try:
                with torch.no_grad():
                    res = run_bound(c.bound, poison=True)
                got = attention_output(res, p.out.index, p.out.tuple_len)
                torch.cuda.synchronize(device)
            except Exception as e:  # a launch failure is a verification failure
                rep.ok = False
                rep.reason = f"({type(e).__name__}: {e})"
                return rep
            rel, mx, ok, judged = kernel_verdict(fn, p, c.bound, got, c.ref, c.ref_dtype, dtype)
            if p.out.lse_index >= 0:  # the returned log-sum-exp, in the call's dtype (bf16: 2^-8 apart)
                ok = ok and lse_error(returned_lse(res, p.out.lse_index), c.ref_lse) <= LSE_TOL
            rep.trials.append(Trial(c.sizes, c.mag, rel, mx, ok, c.pattern, judged, str(c.ref.device)))
            rep.ok &= ok
    if not rep.ok:
        rep.reason = "(the kernel disagrees with the spec)"
    return rep


def kernel_verdict(fn: Callable, p: Program, bound: dict[str, Any], got: torch.Tensor, ref: torch.Tensor,
                   ref_dtype: str, dtype: torch.dtype) -> tuple[float, float, bool, str]:
    """(rel, max, ok, what decided) for a kernel's output `got` in `dtype` on inputs `bound`, against the
    spec's output `ref` (in `ref_dtype`): a pure function of tensors, so it is tested without a GPU. Every
    row is held to the kernel's rounding in `dtype` (verify.judge), besides the norm-wise REL_TOL."""
    if ref_dtype != "float64":
        return (*compare(got, ref, rows_rule(p), REL_TOL, 5e-2, dtype), ref_dtype)
    rel, mx, ok, judged = judge(fn, p, bound, got, ref, rel_tol=REL_TOL, max_tol=5e-2, call_dtype=dtype,
                                out_dtype=dtype)
    if not ok:
        ok_own = no_worse_than_own_dtype(fn, p, bound, got, ref, dtype, REL_TOL, 5e-2)
        if ok_own is not None and ok_own[2]:
            return ok_own
    return rel, mx, ok, judged


def _reference(fn: Callable, p: Program, bound: dict[str, Any], dev: torch.device) -> tuple[torch.Tensor, str]:
    """The spec's output on `dev` (large trials on the GPU), or on the CPU where it cannot run there."""
    if dev.type != "cpu":
        try:
            return reference_output(fn, bound, p.out.index, p.out.tuple_len, dev, p.out.lse_index)
        except Exception:  # a spec that makes CPU tensors of its own, or a device out of memory
            pass
    return reference_output(fn, bound, p.out.index, p.out.tuple_len, CPU, p.out.lse_index)
