"""NVRTC backend: CUDA C++ source -> cubin in-process (no subprocess, no temp files).

Uses cuda-python's `cuda.bindings.nvrtc` when importable, else ctypes on a
libnvrtc found by `toolkit` (the nvidia wheels that CUDA torch depends on,
torch/lib, or a CUDA toolkit). Both talk to the same C API.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

from .arch import parse_arch
from .errors import BuildError, CompilerUnavailable
from .flags import define_flag, line_info_flags
from .toolkit import cuda_include_dirs, nvrtc_library_candidates

_NVRTC_SUCCESS = 0


class _CtypesNvrtc:
    """The handful of libnvrtc entry points we need, through ctypes."""

    def __init__(self, lib: ctypes.CDLL, path: str) -> None:
        self.lib = lib
        self.origin = path
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p

    def _check(self, rc: int, what: str) -> None:
        if rc != _NVRTC_SUCCESS:
            msg = self.lib.nvrtcGetErrorString(rc).decode()
            raise BuildError(f"{what} failed: {msg}", compiler="nvrtc")

    def version(self) -> tuple[int, int]:
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        return major.value, minor.value

    def compile(self, source: bytes, opts: list[bytes]) -> tuple[bool, bytes, str]:
        prog = ctypes.c_void_p()
        self._check(
            self.lib.nvrtcCreateProgram(ctypes.byref(prog), source, b"kernel.cu", 0, None, None),
            "nvrtcCreateProgram",
        )
        try:
            c_opts = (ctypes.c_char_p * len(opts))(*opts)
            rc = self.lib.nvrtcCompileProgram(prog, len(opts), c_opts)
            size = ctypes.c_size_t()
            self._check(self.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size)), "log size")
            log_buf = ctypes.create_string_buffer(size.value)
            self._check(self.lib.nvrtcGetProgramLog(prog, log_buf), "get log")
            log = log_buf.value.decode(errors="replace")
            if rc != _NVRTC_SUCCESS:
                return False, b"", log
            self._check(self.lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "cubin size")
            cubin = ctypes.create_string_buffer(size.value)
            self._check(self.lib.nvrtcGetCUBIN(prog, cubin), "get cubin")
            return True, cubin.raw, log
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(prog))


class _CudaPythonNvrtc:
    """Same operations through cuda-python's `cuda.bindings.nvrtc`."""

    origin = "cuda.bindings.nvrtc"

    def __init__(self, mod) -> None:
        self.m = mod

    def _check(self, res: tuple, what: str):
        err = res[0]
        if err != self.m.nvrtcResult.NVRTC_SUCCESS:
            raise BuildError(f"{what} failed: {err.name}", compiler="nvrtc")
        return res[1:]

    def version(self) -> tuple[int, int]:
        major, minor = self._check(self.m.nvrtcVersion(), "nvrtcVersion")
        return int(major), int(minor)

    def _into(self, call, prog, size: int, what: str) -> bytes:
        """`call(prog, buffer)` into a buffer of our own, NVRTC writing into it: a bytearray, or where a binding
        takes bytes only, a fresh bytes (bytes(n) is never a shared object; `b" " * 1` is)."""
        buf: bytearray | bytes = bytearray(size)
        try:
            self._check(call(prog, buf), what)
        except TypeError:
            buf = bytes(max(size, 1))
            self._check(call(prog, buf), what)
        return bytes(buf)

    def compile(self, source: bytes, opts: list[bytes]) -> tuple[bool, bytes, str]:
        (prog,) = self._check(
            self.m.nvrtcCreateProgram(source, b"kernel.cu", 0, [], []), "nvrtcCreateProgram"
        )
        try:
            (err,) = self.m.nvrtcCompileProgram(prog, len(opts), opts)
            # NVRTC writes into the buffer it is handed: a bytearray of our own. `b" " * size`, cuda-python's
            # sample, is the interpreter's shared b" " when the log is empty (size 1), and NVRTC's NUL then
            # made every later b" " (a print separator, encoded) a NUL byte in this process
            (size,) = self._check(self.m.nvrtcGetProgramLogSize(prog), "log size")
            log = self._into(self.m.nvrtcGetProgramLog, prog, size, "get log").rstrip(b"\0 ").decode(errors="replace")
            if err != self.m.nvrtcResult.NVRTC_SUCCESS:
                return False, b"", log
            (size,) = self._check(self.m.nvrtcGetCUBINSize(prog), "cubin size")
            return True, self._into(self.m.nvrtcGetCUBIN, prog, size, "get cubin"), log
        finally:
            self.m.nvrtcDestroyProgram(prog)


def _load_cuda_python():
    try:
        from cuda.bindings import nvrtc as mod  # type: ignore[import-not-found]
    except ImportError:
        return None
    api = _CudaPythonNvrtc(mod)
    try:
        api.version()  # cuda-python loads libnvrtc lazily; this forces it
    except Exception:
        return None
    return api


def _load_ctypes():
    for cand in nvrtc_library_candidates():
        try:
            lib = ctypes.CDLL(cand)
        except OSError:
            continue
        api = _CtypesNvrtc(lib, cand)
        try:
            api.version()
        except (BuildError, AttributeError):
            continue
        return api
    return None


@functools.lru_cache(maxsize=1)
def _api():
    return _load_cuda_python() or _load_ctypes()


def available() -> bool:
    """NVRTC is usable only with both the library and the CUDA headers."""
    return _api() is not None and bool(cuda_include_dirs())


def version() -> tuple[int, int]:
    api = _api()
    if api is None:
        raise CompilerUnavailable("libnvrtc not found", compiler="nvrtc")
    return api.version()


def toolchain_id() -> str:
    major, minor = version()
    return f"nvrtc-{major}.{minor}"


def compile_cubin(
    source: str, arch: str, include_dirs: list[Path], defines: dict | None
) -> bytes:
    api = _api()
    if api is None:
        raise CompilerUnavailable("libnvrtc not found", compiler="nvrtc")
    sys_inc = cuda_include_dirs()
    if not sys_inc:
        raise CompilerUnavailable("no CUDA include dir with cuda_bf16.h found", compiler="nvrtc")
    a = parse_arch(arch)
    opts = [f"--gpu-architecture={a.sm}", "-std=c++17", *line_info_flags()]
    opts += [f"-I{d}" for d in [*include_dirs, *sys_inc]]
    opts += [define_flag(k, v) for k, v in (defines or {}).items()]
    ok, cubin, log = api.compile(source.encode(), [o.encode() for o in opts])
    if not ok:
        raise BuildError(f"compilation for {a.sm} failed", log, compiler="nvrtc")
    return cubin

