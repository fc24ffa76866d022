"""Public entry points: a verified program for a spec, its CUDA source and cubin, and explain."""
from __future__ import annotations

from typing import Any, Callable

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
                value_dim: int | None = None) -> str:
    """The expert kernel's source with the program's hooks filled in (`value_dim`: V's head dim where it
    differs from Q's; sm_90a)."""
    return _cuda_source(program, arch=arch, dtype=dtype, head_dim=head_dim, value_dim=value_dim)


def cubin(program: Program, arch: str = "sm_90", dtype: str = "bfloat16", head_dim: int = 128,
          value_dim: int | None = None) -> bytes:
    """The kernel compiled for `arch` (needs NVRTC or nvcc, not a GPU)."""
    return _cubin(program, arch=arch, dtype=dtype, head_dim=head_dim, value_dim=value_dim)


def explain(fn: Callable, *args: Any, **kwargs: Any) -> str:
    """The captured graph, the program, its guards, the verification and how calls are served."""
    target = fn if isinstance(fn, CompiledAttention) else None
    spec = fn.fn if isinstance(fn, CompiledAttention) else fn
    bound = bind_example(spec, args, kwargs)
    try:
        res: Transferred = transfer_stage(spec, bound)
    except UnsupportedSpec as e:
        return f"unsupported: {e}\nserved by: the spec itself"
    lines = ["== captured graph ==", res.captured.graph.code.strip(), "", "== CuIR program ==", str(res.program),
             "", "== " + res.report.summary(), f"generic in sizes: {res.generic}", f"cache key: {res.key}"]
    if target is not None:
        lines.append(target.serving_report(*args, **kwargs))
    elif not on_cuda(bound):
        lines.append("served by: the spec (no CUDA device or CPU inputs)")
    else:
        lines.append("served by: the fused kernel when compiled with @torch_cubridge.compile")
    return "\n".join(lines)
