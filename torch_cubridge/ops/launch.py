"""Launching a cubin's kernel on torch's CUDA stream, with little host overhead.

Kernels take C structs by value (`kernel(FwdArgs a, Params p)`); the caller
packs each struct into bytes and passes one block per parameter. Per call we
only copy those bytes into preallocated ctypes buffers and call cuLaunchKernel:
no host sync, no device allocation, no new ctypes arrays.

Two launch paths share the same module handling:
  "ctypes"      cuLaunchKernel straight from libcuda.so.1
  "cuda-python" cuda.bindings.driver.cuLaunchKernel
backend="auto" launches through ctypes at once and moves to cuda-python, measured faster per call
(4.6 against 5.6 us a launch, H200: its Cython wrapper converts the 11 arguments faster than ctypes'
argtypes do), once its driver module has been imported on a helper thread: that import costs a new
process ~50 ms, which a warm first call must not wait for. Once the host fast path's C module is built
(ops/hotpath.py, on a helper thread), "auto" launches through its `launch`: the blocks' bytes straight to
cuLaunchKernel, no copy into ctypes buffers, no lock (the named backends keep their own path).
Context setup, error names and parameter introspection always go through
ctypes on libcuda, which every CUDA driver installs.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Callable, Sequence

import torch

BACKENDS = ("auto", "ctypes", "cuda-python")

_CUDA_SUCCESS = 0
_CUDA_ERROR_INVALID_VALUE = 1
_CUDA_ERROR_INVALID_CONTEXT = 201
_ATTR_MAX_THREADS_PER_BLOCK = 0
_ATTR_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
_DEFAULT_SMEM_LIMIT = 48 * 1024  # above this the kernel must opt in

_vp = ctypes.c_void_p


class CudaDriverError(RuntimeError):
    pass


class _Libcuda:
    """ctypes bindings for the driver calls we need (one per process)."""

    def __init__(self) -> None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise CudaDriverError(f"cannot load the CUDA driver (libcuda.so.1): {e}") from e
        self.lib = lib
        u, i, sz = ctypes.c_uint, ctypes.c_int, ctypes.c_size_t
        sigs = {
            "cuInit": [u],
            "cuGetErrorName": [i, ctypes.POINTER(ctypes.c_char_p)],
            "cuDeviceGet": [ctypes.POINTER(i), i],
            "cuDevicePrimaryCtxRetain": [ctypes.POINTER(_vp), i],
            "cuCtxGetCurrent": [ctypes.POINTER(_vp)],
            "cuCtxSetCurrent": [_vp],
            "cuModuleLoadData": [ctypes.POINTER(_vp), ctypes.c_char_p],
            "cuModuleGetFunction": [ctypes.POINTER(_vp), _vp, ctypes.c_char_p],
            "cuModuleUnload": [_vp],
            "cuFuncSetAttribute": [_vp, i, i],
            "cuFuncGetAttribute": [ctypes.POINTER(i), i, _vp],
            "cuLaunchKernel": [_vp, u, u, u, u, u, u, u, _vp, _vp, _vp],
        }
        for name, argtypes in sigs.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
        # CUDA >= 12 drivers: tensor maps for the Hopper kernel's TMA copies.
        self.encode_tiled = getattr(lib, "cuTensorMapEncodeTiled", None)
        if self.encode_tiled is not None:
            u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
            self.encode_tiled.argtypes = [_vp, i, u, _vp, u64p, u64p, u32p, u32p, i, i, i, i]
            self.encode_tiled.restype = ctypes.c_int
        # CUDA >= 12.4 drivers: lets us check the packed struct sizes.
        self.get_param_info = getattr(lib, "cuFuncGetParamInfo", None)
        if self.get_param_info is not None:
            self.get_param_info.argtypes = [_vp, sz, ctypes.POINTER(sz), ctypes.POINTER(sz)]
            self.get_param_info.restype = ctypes.c_int
        self.check(lib.cuInit(0), "cuInit")

    def error_name(self, rc: int) -> str:
        s = ctypes.c_char_p()
        if self.lib.cuGetErrorName(rc, ctypes.byref(s)) != _CUDA_SUCCESS or not s.value:
            return f"CUresult {rc}"
        return s.value.decode()

    def check(self, rc: int, what: str) -> None:
        if rc != _CUDA_SUCCESS:
            raise CudaDriverError(f"{what} failed: {self.error_name(rc)} ({rc})")

    def make_primary_current(self, ordinal: int) -> None:
        """Make torch's context (the device's primary one) current on this thread."""
        dev, ctx = ctypes.c_int(), _vp()
        self.check(self.lib.cuDeviceGet(ctypes.byref(dev), ordinal), "cuDeviceGet")
        self.check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
        self.check(self.lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    def param_sizes(self, fn: int) -> tuple[int, ...] | None:
        if self.get_param_info is None:
            return None
        sizes, off, size = [], ctypes.c_size_t(), ctypes.c_size_t()
        while True:
            rc = self.get_param_info(fn, len(sizes), ctypes.byref(off), ctypes.byref(size))
            if rc == _CUDA_ERROR_INVALID_VALUE:  # past the last parameter
                return tuple(sizes)
            if rc != _CUDA_SUCCESS:
                return None
            sizes.append(size.value)

    def func_attr(self, fn: int, attr: int) -> int:
        v = ctypes.c_int()
        self.check(self.lib.cuFuncGetAttribute(ctypes.byref(v), attr, fn), "cuFuncGetAttribute")
        return v.value


_libcuda: _Libcuda | None = None
_libcuda_lock = threading.Lock()


def libcuda() -> _Libcuda:
    global _libcuda
    if _libcuda is None:
        with _libcuda_lock:
            if _libcuda is None:
                _libcuda = _Libcuda()
    return _libcuda


def _cuda_python_driver():
    try:
        from cuda.bindings import driver  # type: ignore[import-not-found]
    except ImportError as e:
        raise CudaDriverError(
            "launch backend 'cuda-python' needs the cuda-python package "
            "(pip install cuda-bindings); or use backend='ctypes'"
        ) from e
    return driver


_driver_mod = None  # cuda.bindings.driver once imported (see _start_driver_import)
_driver_thread: threading.Thread | None = None


def _start_driver_import() -> None:
    """Import cuda-python's driver module off the calling thread, once per process."""
    global _driver_mod, _driver_thread
    if _driver_thread is not None or _driver_mod is not None:
        return
    import sys
    if "cuda.bindings.driver" in sys.modules:
        _driver_mod = sys.modules["cuda.bindings.driver"]
        return

    def work() -> None:
        global _driver_mod
        try:
            _driver_mod = _cuda_python_driver()
        except Exception:  # no cuda-python: ctypes stays
            pass

    with _libcuda_lock:
        if _driver_thread is None:
            _driver_thread = threading.Thread(target=work, name="cubridge-cuda-python-import", daemon=True)
            _driver_thread.start()


_c_launch = None  # the host fast path module's launch, once it is loaded


def _host_launch():
    """The C module's launch once it is built (its first request starts the build), else None."""
    global _c_launch
    from . import hotpath  # a sibling that imports nothing of this module
    mod = hotpath.module()
    if mod is not None:
        _c_launch = getattr(mod, "launch", None)
    return _c_launch


def auto_backend() -> str:
    """The path backend="auto" launches through now: cuda-python once its driver module is imported."""
    return "cuda-python" if _driver_mod is not None else "ctypes"


def _cuda_python_call(drv):
    """cuLaunchKernel through cuda-python, returning the CUresult as an int."""
    launch = drv.cuLaunchKernel
    ok = drv.CUresult.CUDA_SUCCESS

    def call(f, gx, gy, gz, bx, by, bz, smem, stream, params, extra) -> int:
        (err,) = launch(f, gx, gy, gz, bx, by, bz, smem, stream, params, extra)
        return _CUDA_SUCCESS if err == ok else int(err)

    return call


class _Loaded:
    """One device's module + function handle, and the call that launches it."""

    __slots__ = ("module", "fn", "fn_obj", "launch")


class CubinKernel:
    """A kernel from a cubin, loaded lazily on each device it is launched on."""

    def __init__(
        self,
        cubin: bytes,
        name: str,
        *,
        threads: int,
        smem_bytes: int,
        backend: str = "auto",
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend {backend!r}; expected one of {BACKENDS}")
        self._upgrade = False  # auto: ctypes until cuda-python's driver module is there
        self._auto = backend == "auto"  # auto: the C module's launch once it is built
        if backend == "auto":
            _start_driver_import()
            self._upgrade = _driver_mod is None
            backend = "ctypes" if self._upgrade else "cuda-python"
        if threads <= 0 or smem_bytes < 0:
            raise ValueError(f"bad launch shape: threads={threads}, smem_bytes={smem_bytes}")
        self.cubin = bytes(cubin)
        self.name = name
        self.threads = int(threads)
        self.smem_bytes = int(smem_bytes)
        self.backend = backend
        self._is_cuda_python = backend == "cuda-python"
        self._per_device: dict[int, _Loaded] = {}
        self._only: _Loaded | None = None  # set when one GPU is visible: skips the device lookup
        self._load_lock = threading.Lock()
        # Launch state, reused every call; locked because the driver call drops the GIL.
        self._call_lock = threading.Lock()
        self._sizes: tuple[int, ...] | None = None
        self._bufs: list[ctypes.Array] = []
        self._views: list[memoryview] = []
        self._kparams = None
        self._kparams_addr = 0
        self._stream_key = -1
        self._stream_obj = None

    # ---- loading (slow path, once per device) --------------------------
    def _load(self, ordinal: int) -> _Loaded:
        with self._load_lock:
            hit = self._per_device.get(ordinal)
            if hit is not None:
                return hit
            torch.cuda.init()
            cu = libcuda()
            cu.make_primary_current(ordinal)
            ld = _Loaded()
            if self.backend == "cuda-python":
                self._load_cuda_python(ld)
            else:
                self._load_ctypes(cu, ld)
            self._check_function(cu, ld.fn)
            self._per_device[ordinal] = ld
            if torch.cuda.device_count() == 1:
                self._only = ld
            return ld

    def _load_ctypes(self, cu: _Libcuda, ld: _Loaded) -> None:
        mod, fn = _vp(), _vp()
        cu.check(cu.lib.cuModuleLoadData(ctypes.byref(mod), self.cubin), "cuModuleLoadData")
        cu.check(
            cu.lib.cuModuleGetFunction(ctypes.byref(fn), mod, self.name.encode()),
            f"cuModuleGetFunction({self.name!r})",
        )
        if self.smem_bytes > _DEFAULT_SMEM_LIMIT:
            cu.check(
                cu.lib.cuFuncSetAttribute(fn, _ATTR_MAX_DYNAMIC_SHARED_SIZE_BYTES, self.smem_bytes),
                f"cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES={self.smem_bytes})",
            )
        ld.module, ld.fn, ld.fn_obj = mod.value, fn.value, fn
        ld.launch = cu.lib.cuLaunchKernel

    def _load_cuda_python(self, ld: _Loaded) -> None:
        drv = _cuda_python_driver()

        def check(res, what: str):
            if res[0] != drv.CUresult.CUDA_SUCCESS:
                raise CudaDriverError(f"{what} failed: {res[0].name}")
            return res[1] if len(res) > 1 else None

        mod = check(drv.cuModuleLoadData(self.cubin), "cuModuleLoadData")
        fn = check(drv.cuModuleGetFunction(mod, self.name.encode()), f"cuModuleGetFunction({self.name!r})")
        if self.smem_bytes > _DEFAULT_SMEM_LIMIT:
            attr = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            check(drv.cuFuncSetAttribute(fn, attr, self.smem_bytes), "cuFuncSetAttribute")
        ld.module, ld.fn, ld.fn_obj = int(mod), int(fn), fn
        ld.launch = _cuda_python_call(drv)

    def _to_cuda_python(self) -> None:
        """auto: the same loaded functions, launched through cuda-python from now on."""
        drv = _driver_mod
        with self._load_lock, self._call_lock:
            if not self._upgrade:
                return
            for ld in self._per_device.values():
                ld.fn_obj = drv.CUfunction(ld.fn)
                ld.launch = _cuda_python_call(drv)
            self.backend = "cuda-python"
            self._is_cuda_python = True
            self._upgrade = False

    def _check_function(self, cu: _Libcuda, fn: int) -> None:
        max_threads = cu.func_attr(fn, _ATTR_MAX_THREADS_PER_BLOCK)
        if self.threads > max_threads:
            raise CudaDriverError(
                f"{self.name}: {self.threads} threads per block, but the kernel allows {max_threads}"
            )
        sizes = cu.param_sizes(fn)
        if sizes is not None:
            self._sizes = sizes

    def handle(self, ordinal: int) -> int:
        """The CUfunction on device `ordinal`, loaded there (the host fast path launches it itself)."""
        ld = self._per_device.get(ordinal) or self._load(ordinal)
        return int(ld.fn)

    # ---- params --------------------------------------------------------
    def _setup_params(self, blocks: Sequence[bytes]) -> None:
        got = tuple(len(b) for b in blocks)
        if self._sizes is not None and got != self._sizes:
            raise ValueError(
                f"{self.name}: kernel parameters are {self._sizes} bytes, got blocks of {got}"
            )
        self._sizes = got
        self._bufs = [ctypes.create_string_buffer(n) for n in got]
        # Copy through memoryviews: slice assignment is a plain memcpy, where
        # ctypes.memmove would be a foreign call (~1 us each, measured).
        self._views = [memoryview(b).cast("B") for b in self._bufs]
        self._kparams = (_vp * len(got))(*[ctypes.addressof(b) for b in self._bufs])
        self._kparams_addr = ctypes.addressof(self._kparams)

    def _stream(self, stream: int):
        # cuda-python wants a CUstream; build one only when the stream changes.
        if stream != self._stream_key:
            self._stream_obj = _cuda_python_driver().CUstream(stream)
            self._stream_key = stream
        return self._stream_obj

    # ---- launching (hot path) ------------------------------------------
    def launch(
        self, grid: tuple[int, int, int], args: bytes | Sequence[bytes], stream: int
    ) -> None:
        """Enqueue the kernel on `stream` (a CUstream handle as int). Does not sync."""
        ld = self._only
        if ld is None:
            ordinal = torch.cuda.current_device()
            ld = self._per_device.get(ordinal) or self._load(ordinal)
        blocks = (args,) if isinstance(args, (bytes, bytearray, memoryview)) else args
        if type(blocks) is not tuple:
            blocks = tuple(blocks)
        c_launch = (_c_launch or _host_launch()) if self._auto else None
        if c_launch is not None:
            call = (ld.fn, grid[0], grid[1], grid[2], self.threads, self.smem_bytes, stream, blocks, self._sizes)
            rc = c_launch(*call)
            if rc != -1:  # -1: blocks past the C buffer, launched below
                if rc != _CUDA_SUCCESS:
                    self._launch_failed(rc, grid, c_launch, call)
                return
        if self._upgrade and _driver_mod is not None:
            self._to_cuda_python()
        with self._call_lock:
            views = self._views
            if len(blocks) != len(views):
                self._setup_params(blocks)
                views = self._views
            try:
                for view, blk in zip(views, blocks):
                    view[:] = blk  # raises ValueError on a size mismatch
            except (ValueError, TypeError):
                self._setup_params(blocks)  # raises with the expected sizes
                raise
            if self._is_cuda_python:
                s, params = self._stream(stream), self._kparams_addr
            else:
                s, params = stream, self._kparams
            call = (ld.fn_obj, grid[0], grid[1], grid[2], self.threads, 1, 1, self.smem_bytes, s, params, 0)
            rc = ld.launch(*call)
            if rc != _CUDA_SUCCESS:
                self._launch_failed(rc, grid, ld.launch, call)

    def _launch_failed(self, rc: int, grid, launch: Callable[..., int], call: tuple) -> None:
        """Raise for a failed launch; `launch(*call)` makes it again (the C launch or the Python one)."""
        cu = libcuda()
        if rc == _CUDA_ERROR_INVALID_CONTEXT:
            # A thread where torch never made its context current: fix, retry once.
            cu.make_primary_current(torch.cuda.current_device())
            rc = launch(*call)
            if rc == _CUDA_SUCCESS:
                return
        raise CudaDriverError(
            f"cuLaunchKernel({self.name}, grid={tuple(grid)}, block={self.threads}, "
            f"smem={self.smem_bytes}) failed: {cu.error_name(rc)} ({rc})"
        )

    def close(self) -> None:
        """Unload the modules. Only after the device has finished every launch of this kernel."""
        cu = libcuda()
        with self._load_lock:
            for ld in self._per_device.values():
                cu.lib.cuModuleUnload(ld.module)
            self._per_device.clear()
            self._only = None
