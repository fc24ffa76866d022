"""CUDA C++ source -> cubin, with NVRTC preferred and nvcc as fallback.

CUBRIDGE_COMPILER=nvrtc|nvcc forces a backend; CUBRIDGE_READONLY=1 forbids
compiling at all (deployments run only what is already in the cache).
"""

from __future__ import annotations

from pathlib import Path

from .. import config
from . import nvcc, nvrtc
from .errors import BuildError, CompilerUnavailable

__all__ = ["BuildError", "CompilerUnavailable", "backend", "compile_cubin", "toolchain_id", "warm_up"]


def backend() -> str:
    """The backend compile_cubin will use: "nvrtc" or "nvcc"."""
    pref = config.compiler_preference()
    if pref != "auto":
        return pref
    if nvrtc.available():
        return "nvrtc"
    if nvcc.available():
        return "nvcc"
    raise CompilerUnavailable(
        "neither NVRTC (libnvrtc + cuda_bf16.h) nor nvcc was found; install a CUDA "
        "build of torch (it brings nvidia-cuda-nvrtc) or a CUDA toolkit"
    )


def warm_up() -> None:
    """Find and load the compiler ahead of the first build (libnvrtc, the CUDA headers): 0.1-0.4 s of a new
    process's first build, taken while the spec is captured instead (pipeline.transfer_stage). Never raises."""
    try:
        backend()
    except Exception:
        pass


def toolchain_id() -> str:
    """Compiler name and version, e.g. "nvrtc-13.0" or "nvcc-13.0.88" (for cache keys)."""
    return nvrtc.toolchain_id() if backend() == "nvrtc" else nvcc.toolchain_id()


def compile_cubin(
    source: str,
    arch: str = "sm_90",
    *,
    include_dirs: list[Path],
    defines: dict | None = None,
) -> bytes:
    """Compile one translation unit to a cubin for `arch` ("sm_80", "sm_90", "sm_90a")."""
    if config.is_readonly():
        raise BuildError("CUBRIDGE_READONLY=1: compiling is disabled; the kernel must come from the cache")
    dirs = [Path(d) for d in include_dirs]
    if backend() == "nvrtc":
        return nvrtc.compile_cubin(source, arch, dirs, defines)
    return nvcc.compile_cubin(source, arch, dirs, defines)
