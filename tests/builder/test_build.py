"""CUDA source -> cubin (needs nvcc or NVRTC, not a GPU)."""

from __future__ import annotations

import re

import pytest

from torch_cubridge import build, config
from torch_cubridge.build import nvcc, nvrtc
from torch_cubridge.build.arch import parse_arch

TINY = r"""
#include <cuda_bf16.h>
struct FwdArgs { float* out; long long n; double scale; };
struct Params { long long add; };
extern "C" __global__ void cubridge_tiny(FwdArgs a, Params p) {
  long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (i < a.n) a.out[i] = __bfloat162float(__float2bfloat16((float)(i * a.scale + p.add + TINY_BIAS)));
}
"""

needs_nvcc = pytest.mark.skipif(not nvcc.available(), reason="nvcc not installed")
needs_nvrtc = pytest.mark.skipif(not nvrtc.available(), reason="libnvrtc or CUDA headers not found")


def _assert_cubin(blob: bytes, name: str = "cubridge_tiny") -> None:
    assert blob[:4] == b"\x7fELF"
    assert name.encode() in blob


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90", "sm_90a"])
def test_nvcc_builds_cubin(arch: str) -> None:
    blob = nvcc.compile_cubin(TINY, arch, [], {"TINY_BIAS": 1})
    _assert_cubin(blob)


@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90", "sm_90a"])
def test_nvrtc_builds_cubin(arch: str) -> None:
    blob = nvrtc.compile_cubin(TINY, arch, [], {"TINY_BIAS": 1})
    _assert_cubin(blob)


@needs_nvcc
def test_line_info_is_built_in_under_its_variable_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUBRIDGE_LINEINFO=1 (profiling with ncu): the binary carries its source lines; without it, not."""
    plain = nvcc.compile_cubin(TINY, "sm_90", [], {"TINY_BIAS": 1})
    monkeypatch.setenv("CUBRIDGE_LINEINFO", "1")
    lined = nvcc.compile_cubin(TINY, "sm_90", [], {"TINY_BIAS": 1})
    assert b".nv_debug_line_sass" in lined and b".nv_debug_line_sass" not in plain


@needs_nvcc
def test_compile_cubin_includes_csrc(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUBRIDGE_COMPILER", "nvcc")
    src = '#include "cubridge/variant.cuh"\n' + TINY
    blob = build.compile_cubin(src, "sm_90", include_dirs=[config.csrc_dir()], defines={"TINY_BIAS": 0})
    _assert_cubin(blob)


@pytest.mark.parametrize("backend", ["nvcc", "nvrtc"])
def test_compile_error_carries_log(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    mod = nvcc if backend == "nvcc" else nvrtc
    if not mod.available():
        pytest.skip(f"{backend} unavailable")
    monkeypatch.setenv("CUBRIDGE_COMPILER", backend)
    with pytest.raises(build.BuildError) as ei:
        build.compile_cubin("this is not cuda;", "sm_90", include_dirs=[])
    assert ei.value.log.strip()
    assert backend in str(ei.value)


def test_missing_define_is_a_build_error() -> None:
    if not (nvcc.available() or nvrtc.available()):
        pytest.skip("no compiler")
    with pytest.raises(build.BuildError):
        build.compile_cubin(TINY, "sm_90", include_dirs=[])  # TINY_BIAS undefined


def test_toolchain_id_names_compiler_and_version() -> None:
    if not (nvcc.available() or nvrtc.available()):
        pytest.skip("no compiler")
    assert re.match(r"^(nvrtc|nvcc)-\d+\.\d+", build.toolchain_id())


def test_backend_falls_back_to_nvcc(monkeypatch: pytest.MonkeyPatch) -> None:
    if not nvcc.available():
        pytest.skip("nvcc not installed")
    monkeypatch.setattr(nvrtc, "available", lambda: False)
    assert build.backend() == "nvcc"


def test_forced_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUBRIDGE_COMPILER", "nvcc")
    assert build.backend() == "nvcc"
    monkeypatch.setenv("CUBRIDGE_COMPILER", "clang")
    with pytest.raises(ValueError):
        build.backend()


def test_readonly_forbids_compiling(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUBRIDGE_READONLY", "1")
    with pytest.raises(build.BuildError, match="READONLY"):
        build.compile_cubin(TINY, "sm_90", include_dirs=[])


def test_arch_parsing() -> None:
    assert parse_arch("sm_90a").compute == "compute_90a"
    assert nvcc.arch_flags("sm_80") == ["-arch=sm_80"]
    assert nvcc.arch_flags("sm_90a") == ["-gencode", "arch=compute_90a,code=sm_90a"]
    for bad in ("90", "sm90", "compute_90", "sm_90;rm"):
        with pytest.raises(build.BuildError):
            parse_arch(bad)


def test_kernel_key_asks_no_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    """A warm or read-only process finds its kernels without loading a compiler, and caches built with
    nvcc serve where only NVRTC exists: the key never asks which compiler there is."""
    import torch

    import torch_cubridge as tc
    from torch_cubridge.lower import lower
    from torch_cubridge.ops import kernel

    def spec(q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2) * 0.125, -1) @ v

    p = tc.transfer(spec, *(torch.randn(1, 2, 16, 64) for _ in range(3)))
    low = lower(p, "sm_90a", "bfloat16", 64)
    before = kernel.kernel_key(low, "sm_90a")

    def no_compiler() -> str:
        raise AssertionError("the kernel key asked for the compiler")

    monkeypatch.setattr(kernel, "toolchain_id", no_compiler)
    monkeypatch.setattr(build, "toolchain_id", no_compiler)
    for which in ("nvcc", "nvrtc"):
        monkeypatch.setenv("CUBRIDGE_COMPILER", which)
        assert kernel.kernel_key(low, "sm_90a") == before


def _c_write(buf, data: bytes) -> None:
    """What a C function does with the `char*` it is handed: writes into the object's memory, immutable or not."""
    import ctypes
    assert len(data) <= len(buf)
    if isinstance(buf, bytearray):
        addr = ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))
    else:
        addr = id(buf) + bytes.__basicsize__ - 1  # a bytes object's characters
    ctypes.memmove(addr, data, len(data))


class _NvrtcAsC:
    """cuda.bindings.nvrtc's calls as its C library behaves in them (no libnvrtc on this machine): the log and
    cubin calls write into the buffers they are handed."""

    class nvrtcResult:
        NVRTC_SUCCESS = 0

    def __init__(self, log: bytes, cubin: bytes, bytes_only: bool = False) -> None:
        self.log, self.cubin, self.bytes_only = log, cubin, bytes_only

    def _take(self, buf) -> None:
        if self.bytes_only and type(buf) is not bytes:  # a binding whose char* takes bytes alone
            raise TypeError(f"expected bytes, {type(buf).__name__} found")

    def nvrtcCreateProgram(self, *args):
        return 0, "program"

    def nvrtcCompileProgram(self, prog, n, opts):
        return (0,)

    def nvrtcGetProgramLogSize(self, prog):
        return 0, len(self.log) + 1  # its NUL: an empty log's size is 1

    def nvrtcGetProgramLog(self, prog, buf):
        self._take(buf)
        _c_write(buf, self.log + b"\0")
        return (0,)

    def nvrtcGetCUBINSize(self, prog):
        return 0, len(self.cubin)

    def nvrtcGetCUBIN(self, prog, buf):
        self._take(buf)
        _c_write(buf, self.cubin)
        return (0,)

    def nvrtcDestroyProgram(self, prog):
        return (0,)


@pytest.mark.parametrize("bytes_only", [False, True])
@pytest.mark.parametrize("log", [b"", b"x", b"a warning"])
def test_the_cuda_python_nvrtc_path_writes_into_buffers_of_its_own(log: bytes, bytes_only: bool) -> None:
    """An empty log is one byte: a buffer made as `b" " * size` is then the interpreter's shared b" ", and NVRTC's
    NUL turned every later b" " of the process into a NUL byte (a print's separators came out as NULs)."""
    import ctypes
    cubin = b"\x7fELF" + bytes(range(60))
    try:
        ok, got, text = nvrtc._CudaPythonNvrtc(_NvrtcAsC(log, cubin, bytes_only)).compile(b"src", [])
        assert ok and got == cubin and type(got) is bytes and text == log.decode()
        assert " ".encode()[0] == 32, "NVRTC wrote into the interpreter's b' '"  # (b" "[0] is folded at compile time)
    finally:
        ctypes.memset(id(b" ") + bytes.__basicsize__ - 1, 32, 1)  # whatever happened, the next test gets b" " back
