"""Verification by execution: the interpreter against the spec in float64.

Fresh random inputs at two or more shapes (odd lengths, Sq != Skv where the
spec allows it), two input magnitudes (so nonlinear score terms such as a
softcap are exercised), extra tensors redrawn each trial.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..ir.program import Program
from .judge import dtype_bound, judge_rows, judge_rows_in
from .inputs import STRUCTURED, batch_moved, example_sizes, has_structured, make_inputs, snap, within_guards
from .reference import attention_output, lse_error, module_copies, reference_device, returned_lse, run_reference, to64

REL_TOL = 1e-4


@dataclass
class Trial:
    sizes: dict[str, int]
    magnitude: float
    rel_err: float
    max_err: float
    ok: bool
    pattern: int | None = None   # a structured mask case (verify.inputs.structured_mask), or random
    ref_dtype: str = "float64"   # the spec's precision the program was judged against (see judge)
    device: str = "cpu"          # where the float64 spec ran (verify.reference.reference_device)


@dataclass
class VerifyReport:
    ok: bool
    trials: list[Trial] = field(default_factory=list)
    reason: str = ""

    def summary(self) -> str:
        lines = [f"verification: {'PASS' if self.ok else 'FAIL'} {self.reason}".rstrip()]
        for t in self.trials:
            s = t.sizes
            kind = "call's own inputs" if t.pattern == -1 else "" if t.pattern is None else f"mask case {t.pattern}"
            lines.append(f"  B={s['B']} H={s['H']} Sq={s['Sq']} Skv={s['Skv']} D={s['D']} x{t.magnitude:g} {kind}: "
                         f"rel L2 {t.rel_err:.2e}, max {t.max_err:.2e} {'ok' if t.ok else 'MISMATCH'}"
                         + ("" if t.ref_dtype == "float64" else f" (against the spec in {t.ref_dtype})")
                         + ("" if t.device == "cpu" else f" [on {t.device}]"))
        return "\n".join(lines)


def verify_shapes(p: Program, example: dict[str, Any], generic: bool) -> list[dict[str, int]]:
    ex = example_sizes(p, example)
    if not generic:
        return [dict(ex), dict(ex)]
    square = ex["Sq"] == ex["Skv"]
    out = []
    for sq, skv in ((37, 53), (77, 70), (1, 9)):
        sq, skv = min(sq, ex["Sq"]), min(skv, ex["Skv"])
        if square:
            skv = sq = min(sq, ex["Sq"])
        s = snap(p, dict(ex, Sq=sq, Skv=skv, B=min(ex["B"], 2)))
        s.update(p.requires)  # sizes the program holds at (a prologue's batch and heads) stay the call's
        if s not in out:
            out.append(s)
    out = [s for s in out if within_guards(p, example, s)]
    if len(out) < 2:  # guards the usual lengths miss (a length that must divide by a chunk): small ones that hold
        for n in SMALL_LENGTHS:
            s = dict(ex, B=min(ex["B"], 2), Sq=n if square else min(n, ex["Sq"]), Skv=n)
            s.update(p.requires)
            if len(out) < 2 and s not in out and n < ex["Skv"] and within_guards(p, example, s):
                out.append(s)
    if len(out) < 2:
        out.append(dict(ex))
    return batch_moved(p, example, out)


SMALL_LENGTHS = (16, 24, 32, 40, 48, 64, 80, 96, 128, 160, 192, 256)


EPILOGUE = "epilogue"  # undefined rows (compare's empty_rows) of a program with an epilogue


def rows_rule(p: Program) -> str:
    """What compare accepts where the spec leaves a row undefined (NaN) for program p."""
    return EPILOGUE if p.epilogue else p.empty_rows


def compare(out: torch.Tensor, ref: torch.Tensor, empty_rows: str, rel_tol: float = REL_TOL,
            max_tol: float = 1e-3, out_dtype: torch.dtype | None = None) -> tuple[float, float, bool]:
    """(rel L2, max abs, ok): ok needs the relative L2 error within rel_tol, every row within max_tol of
    its own scale (verify.judge: a wrong tile or a few wrong rows vanish in a whole-tensor norm), and
    for a kernel's output in a half dtype (`out_dtype`), every element within that dtype's rounding of
    its row."""
    ref = ref.detach().double()
    out = out.detach().to(ref.device, torch.float64)  # where the reference ran (verify.reference)
    if out.shape != ref.shape:
        return float("inf"), float("inf"), False
    nan = torch.isnan(ref)
    if nan.any():
        # rows the spec leaves undefined (softmax over all -inf): the kernel writes 0; or the spec's
        # own maths gives NaN there (a variance of one element) and so does the program
        if empty_rows == EPILOGUE:
            # the kernel's zero rows went on through the epilogue (a projection, a LayerNorm), so they
            # are what that makes of zeros: rows the spec leaves undefined, taken whole along the last axis
            same = (nan == nan[..., :1]).all()
        else:
            same = (torch.isnan(out[nan]) | ((out[nan] == 0) if empty_rows == "zero"
                                             else torch.zeros_like(out[nan], dtype=torch.bool))).all()
        if not same:
            return float("inf"), float("inf"), False
        out, ref = out.masked_fill(nan, 0), ref.masked_fill(nan, 0)
    if torch.isnan(out).any():
        return float("inf"), float("inf"), False
    denom = ref.norm().clamp_min(1e-30)
    rel = float((out - ref).norm() / denom)
    mx = float((out - ref).abs().max()) if out.numel() else 0.0
    ok = rel <= rel_tol and (mx <= 1e-6 or judge_rows(out, ref, max_tol).ok)
    if ok and out_dtype in (torch.bfloat16, torch.float16):
        ok = judge_rows_in(out, ref, out_dtype).ok
    return rel, mx, ok


def judge(fn: Callable, p: Program, bound: dict[str, Any], got: torch.Tensor, ref: torch.Tensor,
          rel_tol: float = REL_TOL, max_tol: float = 1e-3, call_dtype: torch.dtype | None = None,
          out_dtype: torch.dtype | None = None) -> tuple[float, float, bool, str]:
    """(rel, max, ok, the spec's dtype that decided): the program against the spec in float64 first.

    The kernel holds scores in float32, where a finite fill such as -1e9 absorbs s * scale: a fully
    filled row is uniform there, while float64 still resolves the scores. So a program that fails
    the float64 spec is judged again against the spec run in float32 on the same inputs, at the same
    tolerance, where that run leaves undefined (NaN) no row the float64 run defines. It may define
    more: a fill of `finfo(dtype).min` is finite in float32 but, made in float64 and cast by
    `softmax(dtype=torch.float32)`, overflows to -inf, so the float64 run leaves fully masked rows
    NaN that every real dtype (and the program) defines (BLOOM's and Gemma 2's eager attention).
    call_dtype: the real call's dtype, where it is a half type (see below). out_dtype: a kernel's output
    dtype, whose rounding bounds every row (compare); None for the CPU's interpreter.
    """
    rel, mx, ok = compare(got, ref, rows_rule(p), rel_tol, max_tol, out_dtype)
    if ok:
        return rel, mx, ok, "float64"
    ref32 = _spec_in(fn, p, bound, torch.float32, ref.device)
    if ref32 is None or ref32.shape != ref.shape:
        return rel, mx, False, "float64"
    if _undefined_only_in_float32_rows(ref32, ref):
        rel32, mx32, ok32 = compare(got, ref32, rows_rule(p), rel_tol, max_tol, out_dtype)
        if ok32:
            return rel32, mx32, True, "float32"
    # Rows whose answer depends on the dtype the spec runs in: a fill of finfo(q.dtype).min meeting a mask
    # made in the call's dtype (Gemma 2) is the mask's own value in bfloat16 and a far smaller one in float32
    # and float64, so a fully padded row averages over every key in bfloat16 and over the window in the
    # others. A row may match the spec in the call's own dtype (known to that dtype's precision) instead
    # of float64 only where those two answers differ; every other row is judged against float64 as before.
    if call_dtype not in (torch.bfloat16, torch.float16):
        return rel, mx, False, "float64"
    ref_own = _spec_in(fn, p, bound, call_dtype, ref.device)
    if ref_own is None or ref_own.shape != ref.shape or ref.dim() < 2:
        return rel, mx, False, "float64"
    rows = _own_dtype_rows(got.to(ref.device), ref, ref_own, max_tol, 8 * torch.finfo(call_dtype).eps)
    if not rows.any():
        return rel, mx, False, "float64"
    eps = torch.finfo(call_dtype).eps
    got_r = got.to(ref.device)
    rel_a, mx_a, ok_a = compare(got_r[~rows], ref[~rows], rows_rule(p), rel_tol, max_tol, out_dtype)
    rel_b, mx_b, ok_b = compare(got_r[rows], ref_own[rows], rows_rule(p), max(rel_tol, 4 * eps), max(max_tol, 8 * eps))
    if ok_a and ok_b:
        return max(rel_a, rel_b), max(mx_a, mx_b), True, f"float64; {str(call_dtype)[6:]} on {int(rows.sum())} " \
                                                         "dtype-dependent rows"
    return rel, mx, False, "float64"


def _undefined_only_in_float32_rows(ref32: torch.Tensor, ref: torch.Tensor) -> bool:
    """Whether the spec in float32 leaves undefined (NaN) nothing the float64 run defines, or only whole rows:
    rows empty in float32, every score -inf there, where float64 resolves them by its range alone (two fills
    of finfo(float32).min added: -6.8e38 in float64, -inf in float32; GPT-Neo's band buffer where() then its
    padding mask). The kernel holds scores in float32, so such a row is empty to it too, and compare holds the
    program to the empty-row rule there (zero, or the epilogue of zeros). A NaN inside a defined row (an
    overflow in the maths) still sends the judgement back to float64."""
    extra = torch.isnan(ref32) & ~torch.isnan(ref)
    if not extra.any():
        return True
    if ref32.dim() < 2:
        return False
    whole = torch.isnan(ref32).all(-1, keepdim=True).expand_as(ref32)
    return bool((~extra | whole).all())


OWN_DTYPE_SAMPLES = 3  # perturbed runs of the spec in the call's dtype, beside the plain one


def no_worse_than_own_dtype(fn: Callable, p: Program, bound: dict[str, Any], got: torch.Tensor, ref: torch.Tensor,
                             call_dtype: torch.dtype | None, rel_tol: float, max_tol: float
                             ) -> tuple[float, float, bool, str] | None:
    """The GPU verdict's last word for a half-dtype call: the kernel is within what the dtype's own rounding
    moves the spec's answer, overall and in every row. A spec ill-conditioned in its dtype (cpmant's initial
    std of 1.0 gives logits of ~100 from projections rounded to bfloat16) misses float64 by more than any
    fixed tolerance, and no kernel in that dtype can be held tighter than the spec's answer is determined.
    How far rounding moves a row is sampled: the spec in the call's dtype on its inputs, and on inputs moved
    by at most one rounding (x * (1 + eps * u), u uniform in [-1, 1], rounded back), the largest miss of
    float64 per row and overall. One sample alone is too few: in a near-tied row the kernel and the spec
    round differently, and either may land nearer (cpmant: the kernel's row error up to 3x the spec's).
    A wrong kernel (a tile's mask, a lost bias) still differs in a well-determined row by far more than
    rounding moves it. Where rows still differ beyond the sampled rounding and the spec is ill-conditioned
    overall, see below. Never for the CPU's interpreter, whose float64 must meet 1e-4.
    None where the spec cannot run in the call's dtype."""
    if call_dtype not in (torch.bfloat16, torch.float16):
        return None
    rule = rows_rule(p)
    inf = float("inf")
    if ref.dim() < 2 or not compare(got, ref, rule, inf, inf)[2]:  # rows the spec leaves undefined: as before
        return None
    a = ref.double()
    undefined = torch.isnan(a)
    a = a.masked_fill(undefined, 0)
    g = got.to(ref.device, torch.float64).masked_fill(undefined, 0)
    norm = a.norm().clamp_min(1e-30)
    gen = torch.Generator().manual_seed(0)
    rel_own, row_own = 0.0, torch.zeros(a.shape[:-1], dtype=torch.float64, device=a.device)
    for i in range(OWN_DTYPE_SAMPLES + 1):
        b = bound if i == 0 else _moved_by_rounding(bound, torch.finfo(call_dtype).eps, gen)
        own = _spec_in(fn, p, b, call_dtype, ref.device)
        if own is None or own.shape != ref.shape:
            return None
        o = own.to(ref.device, torch.float64)
        if (torch.isnan(o) & ~undefined).any() or torch.isinf(o).any():  # the spec overflows in its dtype
            return None
        o = o.masked_fill(undefined, 0)
        rel_own = max(rel_own, float((o - a).norm() / norm))
        row_own = torch.maximum(row_own, (o - a).abs().amax(-1))
    rel = float((g - a).norm() / norm)
    row_g = (g - a).abs().amax(-1)
    mx = float(row_g.max()) if row_g.numel() else 0.0
    dt = str(call_dtype)[6:]
    if rel > max(rel_tol, rel_own):
        return rel, mx, False, "float64"
    # each element within the spec's own rounding of its row, or within what the kernel's rounding allows it
    # (verify.judge): a floor at the largest row's scale would let a small row be wholly wrong
    within = (g - a).abs() <= torch.maximum(row_own[..., None], dtype_bound(a, call_dtype))
    if bool(within.all()):
        return rel, mx, True, f"float64; within the spec's own rounding in {dt} (rel {rel_own:.1e})"
    # Rows beyond the sampled rounding, where the spec is ill-conditioned in its dtype: its answer there is
    # not known to the tolerance, so the kernel is held instead to the program's exact attention of the very
    # operands it read (the prologue, the spec's own ops, in the call's dtype; the attention in float64; the
    # program itself verified against the spec in float64 on the CPU) at the fixed tolerance.
    if rel_own <= rel_tol or not p.prologue:
        return rel, mx, False, "float64"
    try:
        from ..ir.interpreter import run_bound_program
        exact = attention_output(run_bound_program(p, bound, core=torch.float64), p.out.index, p.out.tuple_len)
    except Exception:
        return rel, mx, False, "float64"
    rel_x, _, ok_x = compare(got, exact, rule, rel_tol, max_tol)
    return rel, mx, ok_x, f"float64 (rel {rel:.1e}, the spec's own rounding in {dt} {rel_own:.1e}); the " \
        f"program's exact attention of the operands the kernel read: rel {rel_x:.1e}"


def _moved_by_rounding(bound: dict[str, Any], eps: float, gen: torch.Generator) -> dict[str, Any]:
    """`bound` with every floating tensor moved by at most one rounding of the call's dtype."""
    out = {}
    for k, v in bound.items():
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            u = torch.rand(v.shape, generator=gen, dtype=torch.float32).to(v.device) * 2 - 1
            v = (v.float() * (1 + eps * u)).to(v.dtype)
        out[k] = v
    return out


def _own_dtype_rows(got: torch.Tensor, ref: torch.Tensor, ref_own: torch.Tensor, max_tol: float,
                    own_tol: float) -> torch.Tensor:
    """Output rows (every index but the last) judged in the call's dtype: the spec's answers in float64 and in
    that dtype differ there beyond its rounding, and the program's misses float64's and meets that dtype's."""
    a, o, g = ref.double(), ref_own.to(ref.device, torch.float64), got.double()
    scale = float(torch.nan_to_num(a, nan=0.0).abs().max().clamp_min(1e-30))

    def far(x: torch.Tensor, y: torch.Tensor, tol: float) -> torch.Tensor:
        return (x - y).abs().nan_to_num(nan=float("inf")).amax(-1) > tol * scale
    return far(a, o, own_tol) & far(g, a, max_tol) & ~far(g, o, own_tol)


def _call_dtype(p: Program, bound: dict[str, Any]) -> torch.dtype | None:
    """The query's dtype in the real call's arguments."""
    from ..ir.bind import lookup
    try:
        q = lookup(bound, p.q.arg)
    except Exception:
        return None
    return q.dtype if isinstance(q, torch.Tensor) else None


def _spec_in(fn: Callable, p: Program, bound: dict[str, Any], dtype: torch.dtype,
             device: torch.device) -> torch.Tensor | None:
    try:
        out = attention_output(run_reference(fn, bound, dtype, device), p.out.index, p.out.tuple_len)
    except Exception:  # a spec that cannot run in this dtype has only its float64 verdict
        return None
    return out if isinstance(out, torch.Tensor) else None


def structured_shape(p: Program, example: dict[str, Any], cap: int = 200) -> dict[str, int]:
    """Sizes for structured masks: long enough that whole 64-key tiles of a row are masked."""
    ex = example_sizes(p, example)
    s = snap(p, dict(ex, B=min(ex["B"], 2), Sq=min(ex["Sq"], cap), Skv=min(ex["Skv"], cap)))
    s.update(p.requires)
    return s if within_guards(p, example, s) else dict(ex)


def trials(p: Program, example: dict[str, Any], shapes: list[dict[str, int]], magnitudes: tuple[float, ...],
           cap: int) -> list[tuple[dict[str, int], float, int | None]]:
    """(sizes, magnitude, structured pattern) for every trial: random redraws, then structured masks."""
    out = [(s, m, None) for s in shapes for m in magnitudes]
    if has_structured(p, example):
        big = structured_shape(p, example, cap)
        out += [(big, 1.0, k) for k in range(STRUCTURED)]
    return out


def verify_program(fn: Callable, p: Program, example: dict[str, Any], generic: bool = True,
                   seed: int = 0) -> VerifyReport:
    with module_copies():
        return _verify_program(fn, p, example, generic, seed)


def _verify_program(fn: Callable, p: Program, example: dict[str, Any], generic: bool, seed: int) -> VerifyReport:
    rep = VerifyReport(ok=True)
    for i, (sizes, mag, pattern) in enumerate(trials(p, example, verify_shapes(p, example, generic), (1.0, 8.0), 200)):
        dev = reference_device(example, sizes)
        try:
            try:
                trial = _trial(fn, p, example, sizes, mag, pattern, 1000 * seed + i + 1, dev)
            except Exception:
                if dev.type == "cpu":
                    raise
                # a spec that makes CPU tensors of its own, or a device out of memory: the CPU decides
                trial = _trial(fn, p, example, sizes, mag, pattern, 1000 * seed + i + 1, torch.device("cpu"))
        except Exception as e:  # a program that cannot run at a shape is not verified
            rep.ok = False
            rep.reason = f"({type(e).__name__}: {e})"
            return rep
        rep.trials.append(trial)
        rep.ok &= trial.ok
    if not rep.ok:
        rep.reason = "(the program disagrees with the spec)"
    return rep


def _trial(fn: Callable, p: Program, example: dict[str, Any], sizes: dict[str, int], mag: float,
           pattern: int | None, seed: int, dev: torch.device) -> Trial:
    """One trial: inputs drawn at `sizes` on `dev`, the program against the spec there."""
    bound = make_inputs(p, example, sizes, seed=seed, magnitude=mag, dtype=torch.float64, pattern=pattern, device=dev)
    # the program sees exactly the spec's float64 inputs: a prologue (RoPE on q) runs on them too
    bound = {k: to64(v, device=dev) for k, v in bound.items()}
    in32 = False
    try:
        full = run_reference(fn, bound, device=dev)
        ref = attention_output(full, p.out.index, p.out.tuple_len)
    except Exception:
        # a spec that fixes float32 somewhere (positions made with .float() meeting float64
        # weights) cannot run in float64: it is judged in float32, program and spec alike
        bound = make_inputs(p, example, sizes, seed=seed, magnitude=mag, dtype=torch.float32, pattern=pattern,
                            device=dev)
        bound = {k: to64(v, torch.float32, dev) for k, v in bound.items()}
        full = run_reference(fn, bound, torch.float32, dev)
        ref = attention_output(full, p.out.index, p.out.tuple_len)
        in32 = True
    args, kwargs = _call(bound, p)
    res = p.run(*args, **kwargs)
    got = attention_output(res, p.out.index, p.out.tuple_len)
    # a mid-sized fill (fp16's -65504) costs the spec's own float32 softmax ~1e-4 of precision
    # (ulp 2^-8 at 65504); a wrong mask is off by O(1), so 1e-3 still separates the two
    if in32:
        rel, mx, ok = compare(got, ref, rows_rule(p), REL_TOL if pattern is None else 1e-3)
        judged = "float32"
    else:
        rel, mx, ok, judged = judge(fn, p, bound, got, ref, rel_tol=REL_TOL if pattern is None else 1e-3,
                                    call_dtype=_call_dtype(p, example))
    if p.out.lse_index >= 0:  # the returned log-sum-exp too (the interpreter's float32 scores: ~1e-7 apart)
        ok = ok and lse_error(returned_lse(res, p.out.lse_index), returned_lse(full, p.out.lse_index)) <= \
            (1e-3 if in32 else REL_TOL)
    return Trial(sizes, mag, rel, mx, ok, pattern, judged, str(ref.device))


def _call(bound: dict[str, Any], p: Program) -> tuple[list[Any], dict[str, Any]]:
    """Bound paths back to a call of the program's signature: the names before a `*args` and its items
    positionally (a `*args` cannot follow keywords), the rest as keywords."""
    args: list[Any] = []
    kw: dict[str, Any] = {}
    star = any(n.startswith("*") and not n.startswith("**") for n in p.signature)
    before = star
    for name in p.signature:
        if name.startswith("**"):
            kw.update({k.split(".", 1)[1]: v for k, v in bound.items() if k.startswith(name[2:] + ".")})
        elif name.startswith("*"):
            i = 0
            while f"{name[1:]}.{i}" in bound:
                args.append(bound[f"{name[1:]}.{i}"])
                i += 1
            before = False
        elif name in bound:
            if before:
                args.append(bound[name])
            else:
                kw[name] = bound[name]
    return args, kw
