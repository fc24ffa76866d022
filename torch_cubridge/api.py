"""Public entry points: transfer a spec to a verified CuIR program, and explain it."""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable

from .capture.checks import check_call
from .capture.hashing import spec_hash
from .capture.trace import Captured, bind_example, capture
from .errors import UnsupportedSpec
from .ir.program import Program
from .transfer import symbolic_transfer
from .transfer.generalize import generalize
from .verify.cpu import VerifyReport, verify_program


@dataclass
class TransferResult:
    program: Program
    captured: Captured
    generic: bool
    report: VerifyReport
    key: str
    backend: str


def transfer_bound(fn: Callable, bound: dict[str, Any], backend: str = "symbolic",
                   llm_options: dict | None = None) -> TransferResult:
    check_call(bound)
    cap = capture(fn, bound)
    key = spec_hash(cap)
    try:
        prog = symbolic_transfer(cap)
        used = "symbolic"
    except UnsupportedSpec as e:
        if backend not in ("auto", "llm"):
            raise
        from .transfer.llm import llm_transfer
        prog = llm_transfer(cap, reason=str(e), **(llm_options or {}))
        used = "llm"
    prog, generic = generalize(fn, bound, prog, symbolic_transfer if used == "symbolic" else (lambda c: prog))
    prog = with_requirements(prog, bound, generic)
    report = verify_program(fn, prog, bound, generic)
    if not report.ok:
        raise UnsupportedSpec("the transferred program failed verification against the spec\n" + report.summary(),
                              op="verify")
    return TransferResult(prog, cap, generic, report, key, used)


def with_requirements(prog: Program, bound: dict[str, Any], generic: bool) -> Program:
    """Sizes of extent 1 were broadcasts at capture; a specialised program holds at its shape only."""
    from dataclasses import replace
    from .verify.inputs import example_sizes
    sizes = example_sizes(prog, bound)
    keep = ("B", "H", "Hkv", "Sq", "Skv")
    req = tuple((k, sizes[k]) for k in keep if sizes[k] == 1 or not generic)
    return replace(prog, requires=req)


def transfer(fn: Callable, *example_args: Any, **example_kwargs: Any) -> Program:
    """Capture fn at the example arguments and return its verified CuIR program.

    Raises UnsupportedSpec (naming the op and the reason) when the spec cannot
    be mapped or the program does not match the spec on fresh inputs.
    """
    return transfer_bound(fn, bind_example(fn, example_args, example_kwargs)).program


def explain(fn: Callable, *args: Any, **kwargs: Any) -> str:
    """The captured graph, the program, the verification and how calls are served."""
    from .compile import CompiledAttention
    target = fn if isinstance(fn, CompiledAttention) else None
    spec = fn.fn if isinstance(fn, CompiledAttention) else fn
    bound = bind_example(spec, args, kwargs)
    lines = []
    try:
        res = transfer_bound(spec, bound)
    except UnsupportedSpec as e:
        return f"unsupported: {e}\nserved by: the spec itself"
    lines += ["== captured graph ==", res.captured.graph.code.strip(), "", "== CuIR program ==", str(res.program),
              "", "== " + res.report.summary(), f"generic in sizes: {res.generic}", f"cache key: {res.key}"]
    if target is not None:
        lines.append(target.serving_report(*args, **kwargs))
    else:
        from .compile import kernel_status
        lines.append(kernel_status(res.program, bound))
    return "\n".join(lines)


def warn_once(cache: set, key: Any, msg: str) -> None:
    if key not in cache:
        cache.add(key)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
