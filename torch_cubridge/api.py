"""Public entry points: a verified program for a spec, its CUDA source and cubin, and explain."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from .capture.trace import bind_example
from .compile import CompiledAttention
from .errors import UnsupportedSpec
from .ir.program import Program
from .lower import cubin as _cubin
from .lower import cuda_source as _cuda_source
from .pipeline import Transferred, on_cuda, transfer_stage

transfer_bound = transfer_stage  # the stage itself, for callers holding bound arguments


def transfer(fn: Callable, *example_args: Any, **example_kwargs: Any) -> Program:
    """Capture fn at the example arguments and return its verified CuIR program.

    Raises UnsupportedSpec (naming the op and the reason) when the spec cannot
    be mapped or the program does not match the spec on fresh inputs. The
    program records the guards (sizes, Python values) under which it holds;
    `Program.run` refuses calls outside them.
    """
    return transfer_stage(fn, bind_example(fn, example_args, example_kwargs)).program


def cuda_source(program: Program, arch: str = "sm_90", dtype: str = "bfloat16", head_dim: int = 128,
                value_dim: int | None = None, backward: bool = False, learnable: Sequence[str] = ()) -> str:
    """The expert kernel's source with the program's hooks filled in (`value_dim`: V's head dim where it
    differs from Q's; sm_90a). `backward`: the backward kernels' (dQ, dK, dV; lower/backward.py), with the
    gradients of the extra tensors named in `learnable` that the score reads (lower/sites.py)."""
    return _cuda_source(program, arch=arch, dtype=dtype, head_dim=head_dim, value_dim=value_dim, backward=backward,
                        learnable=tuple(learnable))


def cubin(program: Program, arch: str = "sm_90", dtype: str = "bfloat16", head_dim: int = 128,
          value_dim: int | None = None, backward: bool = False, learnable: Sequence[str] = ()) -> bytes:
    """The kernel compiled for `arch` (needs NVRTC or nvcc, not a GPU); `backward`, `learnable` as
    cuda_source's."""
    return _cubin(program, arch=arch, dtype=dtype, head_dim=head_dim, value_dim=value_dim, backward=backward,
                  learnable=tuple(learnable))


def explain(fn: Callable, *args: Any, **kwargs: Any) -> str:
    """The captured graph, the program, its guards, the verification and how calls are served."""
    return explain_call(fn, args, kwargs).text


@dataclass
class Explained:
    """explain()'s report, and what it found."""
    text: str
    result: Transferred | None = None         # the verified program; None where refused
    refusal: UnsupportedSpec | None = None    # why there is none
    raised: Exception | None = None           # what the spec itself raised on this call, where it did


def explain_call(fn: Callable, args: tuple, kwargs: dict) -> Explained:
    """explain(fn, *args, **kwargs), with the program, the refusal or the spec's own error it found."""
    target = fn if isinstance(fn, CompiledAttention) else None
    spec = fn.fn if isinstance(fn, CompiledAttention) else fn
    bound = bind_example(spec, args, kwargs)
    try:
        res: Transferred = transfer_stage(spec, bound)
    except UnsupportedSpec as e:
        raised = spec_error(spec, args, kwargs)
        if raised is not None:  # not a refusal of ours: no call like this one runs at all
            return Explained(f"the spec raises on these inputs: {type(raised).__name__}: {raised}\n"
                             "served by: nothing (the spec itself raises on this call)", refusal=e, raised=raised)
        return Explained(f"unsupported: {e}\nserved by: the spec itself", refusal=e)
    lines = ["== captured graph ==", res.captured.graph.code.strip(), "", "== CuIR program ==",
             fold_guards(str(res.program), res.program), "", "== " + res.report.summary(),
             f"generic in sizes: {res.generic}", f"cache key: {res.key}"]
    if target is not None:
        lines.append(target.serving_report(*args, **kwargs))
    elif not on_cuda(bound):
        lines.append("served by: the spec (no CUDA device or CPU inputs)")
    else:
        lines.append("served by: the fused kernel when compiled with @torch_cubridge.compile")
    return Explained("\n".join(lines), result=res)


def spec_error(fn: Callable, args: tuple, kwargs: dict) -> Exception | None:
    """What fn(*args, **kwargs) raises, or None where it runs (a refusal may be the spec's own error)."""
    try:
        with torch.no_grad():
            fn(*args, **kwargs)
    except Exception as e:
        return e
    return None


GUARDS_WIDTH, GUARDS_ROWS = 100, 6  # explain folds a guards line over this width into this many rows


def fold_guards(text: str, program: Program) -> str:
    """The program's text with a long guards line folded: the guards that pin a value first (head dim 64,
    softcap == 50.0), then the other short ones, wrapped into GUARDS_ROWS rows, then a count of the rest."""
    head = "  guards : "
    lines = text.splitlines()
    at = next((i for i, ln in enumerate(lines) if ln.startswith(head)), None)
    if at is None or len(lines[at]) <= GUARDS_WIDTH:
        return text
    every = [str(g) for g in program.guards]
    pins = [g for g in every if re.fullmatch(r"\(\w+(\.shape\[\d+\])? == -?[\d.]+\)", g)]
    ordered = pins + [g for g in every if g not in pins and len(g) <= GUARDS_WIDTH // 2]
    rows, row, shown = [], "", 0
    for g in ordered:
        if row and len(head) + len(row) + len(g) + 5 > GUARDS_WIDTH:
            if len(rows) + 1 == GUARDS_ROWS:
                break
            rows.append(row)
            row = ""
        row = f"{row} and {g}" if row else g
        shown += 1
    rows += [row] if row else []
    if len(every) > shown:
        rows.append(f"{len(every) - shown} more condition(s) (Program.guards holds them all)")
    return "\n".join(lines[:at] + [head + rows[0]] + ["       and " + r for r in rows[1:]] + lines[at + 1:])
