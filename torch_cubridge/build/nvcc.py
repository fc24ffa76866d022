"""nvcc backend: writes the source to a temp dir and runs `nvcc -cubin`.

Slower than NVRTC (process start + host-side front end), but needs only a
CUDA toolkit, so it is the fallback.
"""

from __future__ import annotations

import functools
import re
import subprocess
import tempfile
from pathlib import Path

from .. import config
from .arch import parse_arch
from .errors import BuildError, CompilerUnavailable
from .flags import define_flag, line_info_flags

_TIMEOUT_S = 600


def _nvcc() -> Path:
    path = config.nvcc_path()
    if path is None:
        raise CompilerUnavailable("nvcc not found (set CUDA_HOME or put nvcc on PATH)", compiler="nvcc")
    return path


def available() -> bool:
    return config.nvcc_path() is not None


@functools.lru_cache(maxsize=4)
def _version(nvcc: Path) -> str:
    out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, check=False)
    m = re.search(r"V(\d+\.\d+\.\d+)", out.stdout)
    if out.returncode != 0 or not m:
        raise BuildError("could not read nvcc version", out.stdout + out.stderr, compiler="nvcc")
    return m.group(1)


def toolchain_id() -> str:
    return f"nvcc-{_version(_nvcc())}"


def arch_flags(arch: str) -> list[str]:
    a = parse_arch(arch)
    if a.suffix:
        # Arch-specific targets (sm_90a) need the matching virtual arch.
        return ["-gencode", f"arch={a.compute},code={a.sm}"]
    return [f"-arch={a.sm}"]


def compile_cubin(
    source: str, arch: str, include_dirs: list[Path], defines: dict | None
) -> bytes:
    nvcc = _nvcc()
    with tempfile.TemporaryDirectory(prefix="cubridge-nvcc-") as tmp:
        src, out = Path(tmp) / "kernel.cu", Path(tmp) / "kernel.cubin"
        src.write_text(source)
        # No --use_fast_math: kernels opt into fast intrinsics explicitly.
        cmd = [str(nvcc), "-cubin", *arch_flags(arch), "-O3", "-std=c++17", *line_info_flags()]
        cmd += [f"-I{d}" for d in include_dirs]
        cmd += [define_flag(k, v) for k, v in (defines or {}).items()]
        cmd += ["-o", str(out), str(src)]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired as e:
            raise BuildError(f"timed out after {_TIMEOUT_S}s: {' '.join(cmd)}", compiler="nvcc") from e
        if res.returncode != 0 or not out.is_file():
            raise BuildError(
                f"exit {res.returncode}: {' '.join(cmd)}", res.stderr + res.stdout, compiler="nvcc"
            )
        return out.read_bytes()
