"""Verification of a compiled kernel on the GPU before it is swapped in.

Fresh inputs at two or more shapes with odd lengths, in the call's dtype,
extras redrawn; the output buffer is poisoned with NaN first, so an element
the kernel never writes fails. The reference is the spec in float64.
"""
from __future__ import annotations

import copy
from typing import Any, Callable

import torch

from ..ir.program import Program
from .cpu import Trial, VerifyReport, compare
from .inputs import example_sizes, make_inputs, within_guards
from .reference import attention_output, run_reference

REL_TOL = 1e-2


def gpu_shapes(p: Program, example: dict[str, Any]) -> list[dict[str, int]]:
    ex = example_sizes(p, example)
    fixed = dict(p.requires)
    square = ex["Sq"] == ex["Skv"]
    out = []
    for sq, skv in ((300, 333), (77, 129), (130, 64)):
        sq, skv = min(sq, ex["Sq"]), min(skv, ex["Skv"])
        if square:
            skv = sq
        s = dict(ex, Sq=sq, Skv=skv, B=min(ex["B"], 2))
        s.update(fixed)
        if s not in out and within_guards(p, example, s):
            out.append(s)
    return out or [dict(ex)]


def _to(bound: dict[str, Any], device: torch.device) -> dict[str, Any]:
    out = {}
    for k, v in bound.items():
        if isinstance(v, torch.Tensor):
            out[k] = v.to(device)
        elif isinstance(v, torch.nn.Module):
            out[k] = copy.deepcopy(v).to(device)  # never move the caller's module
        else:
            out[k] = v
    return out


def verify_kernel(run_bound: Callable[..., Any], fn: Callable, p: Program, example: dict[str, Any],
                  dtype: torch.dtype, device: torch.device, seed: int = 0) -> VerifyReport:
    rep = VerifyReport(ok=True)
    for i, sizes in enumerate(gpu_shapes(p, example)):
        for j, mag in enumerate((1.0, 4.0)):
            cpu = make_inputs(p, example, sizes, seed=9000 + 10 * i + j + 1000 * seed, magnitude=mag, dtype=dtype)
            gpu = _to(cpu, device)
            try:
                with torch.no_grad():
                    got = attention_output(run_bound(gpu, poison=True), p.out.index, p.out.tuple_len)
                torch.cuda.synchronize(device)
            except Exception as e:  # a launch failure is a verification failure
                rep.ok = False
                rep.reason = f"({type(e).__name__}: {e})"
                return rep
            ref = attention_output(run_reference(fn, cpu), p.out.index, p.out.tuple_len)
            rel, mx, ok = compare(got, ref, p.empty_rows, rel_tol=REL_TOL, max_tol=5e-2)
            rep.trials.append(Trial(sizes, mag, rel, mx, ok))
            rep.ok &= ok
    if not rep.ok:
        rep.reason = "(the kernel disagrees with the spec)"
    return rep
