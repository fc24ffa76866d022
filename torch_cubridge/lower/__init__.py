"""Lower: CuIR to CUDA source (hooks of the expert kernel filled) and to a cubin."""
from __future__ import annotations

from ..ir.program import Program
from .backward import LoweredBackward, lower_backward
from .source import Lowered, lower


def cuda_source(p: Program, arch: str = "sm_90", dtype: str = "bfloat16", head_dim: int = 128,
                value_dim: int | None = None, backward: bool = False, learnable: tuple[str, ...] = ()) -> str:
    if backward:
        return lower_backward(p, arch, dtype, head_dim, value_dim, learnable=tuple(learnable)).source
    return lower(p, arch, dtype, head_dim, value_dim=value_dim).source


def cubin(p: Program, arch: str = "sm_90", dtype: str = "bfloat16", head_dim: int = 128,
          value_dim: int | None = None, backward: bool = False, learnable: tuple[str, ...] = ()) -> bytes:
    """Compile without a GPU (NVRTC where available, else nvcc)."""
    from ..build import compile_cubin
    from ..config import csrc_dir
    return compile_cubin(cuda_source(p, arch, dtype, head_dim, value_dim, backward, learnable), arch,
                         include_dirs=[csrc_dir()])


__all__ = ["cuda_source", "cubin", "lower", "Lowered", "lower_backward", "LoweredBackward"]
