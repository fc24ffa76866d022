"""Launching cubins on a real GPU through CubinKernel."""

from __future__ import annotations

import importlib.util
import struct
import threading

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

NVALS = 20
# 23 eight-byte fields, like cubridge::FwdArgs; Params is one more struct.
SRC = r"""
struct Args { float* out; long long n; long long vals[%(nvals)d]; double scale; };
struct Params { long long add; double mul; };

extern "C" __global__ void write_vals(Args a, Params p) {
  long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (i < a.n) a.out[i] = (float)((a.vals[i %% %(nvals)d] * a.scale + p.add) * p.mul);
}

extern "C" __global__ void smem_roundtrip(Args a, Params p) {
  extern __shared__ float buf[];
  int n = (int)a.vals[0];  // floats of dynamic smem in use
  for (int j = threadIdx.x; j < n; j += blockDim.x) buf[j] = (float)(j + p.add);
  __syncthreads();
  for (int j = threadIdx.x; j < n; j += blockDim.x) a.out[j] = buf[n - 1 - j];
}
""" % {"nvals": NVALS}

BACKENDS = ["auto", "ctypes"]
if importlib.util.find_spec("cuda") and importlib.util.find_spec("cuda.bindings"):
    BACKENDS.append("cuda-python")


@pytest.fixture(scope="module")
def cubin() -> bytes:
    from torch_cubridge import build

    major, minor = torch.cuda.get_device_capability()
    return build.compile_cubin(SRC, f"sm_{major}{minor}", include_dirs=[])


def _pack(out: torch.Tensor, vals: list[int], scale: float, add: int, mul: float) -> list[bytes]:
    args = struct.pack(f"<Qq{NVALS}qd", out.data_ptr(), out.numel(), *vals, scale)
    return [args, struct.pack("<qd", add, mul)]


def _expected(n: int, vals: list[int], scale: float, add: int, mul: float) -> torch.Tensor:
    v = torch.tensor(vals, dtype=torch.float64)[torch.arange(n) % NVALS]
    return ((v * scale + add) * mul).float()


def _launch_on_a_new_thread(k, grid: tuple, blocks: list[bytes], stream: int) -> list[BaseException]:
    """k.launch from a thread of its own (no current CUDA context yet); what it raised."""
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            k.launch(grid, blocks, stream)
        except BaseException as e:  # surfaced by the caller
            errors.append(e)
    t = threading.Thread(target=worker)
    t.start()
    t.join()
    return errors


@pytest.mark.parametrize("backend", BACKENDS)
def test_struct_params_reach_kernel(cubin: bytes, backend: str) -> None:
    from torch_cubridge.ops.launch import CubinKernel

    k = CubinKernel(cubin, "write_vals", threads=128, smem_bytes=0, backend=backend)
    n, vals = 1000, list(range(3, 3 + NVALS))
    out = torch.full((n,), -1.0, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    k.launch(((n + 127) // 128, 1, 1), _pack(out, vals, 0.5, 7, 2.0), stream)
    torch.cuda.synchronize()
    torch.testing.assert_close(out.cpu(), _expected(n, vals, 0.5, 7, 2.0))
    # Reuse with new values: the preallocated buffers must pick them up.
    k.launch(((n + 127) // 128, 1, 1), _pack(out, vals, -1.0, 1, 1.0), stream)
    torch.cuda.synchronize()
    torch.testing.assert_close(out.cpu(), _expected(n, vals, -1.0, 1, 1.0))


def test_side_stream_and_ordering(cubin: bytes) -> None:
    from torch_cubridge.ops.launch import CubinKernel

    k = CubinKernel(cubin, "write_vals", threads=256, smem_bytes=0)
    n, vals = 4096, [1] * NVALS
    out = torch.zeros(n, device="cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        k.launch(((n + 255) // 256, 1, 1), _pack(out, vals, 1.0, 0, 1.0), side.cuda_stream)
        out.mul_(3)  # torch op queued after our kernel on the same stream
    side.synchronize()
    assert torch.all(out == 3).item()


def test_large_dynamic_smem(cubin: bytes) -> None:
    from torch_cubridge.ops.launch import CubinKernel

    smem = 100 * 1024  # above the 48 KB default: needs the opt-in attribute
    n = smem // 4
    k = CubinKernel(cubin, "smem_roundtrip", threads=256, smem_bytes=smem)
    out = torch.zeros(n, device="cuda")
    vals = [n] + [0] * (NVALS - 1)
    k.launch((1, 1, 1), _pack(out, vals, 1.0, 5, 1.0), torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    torch.testing.assert_close(out.cpu(), (torch.arange(n - 1, -1, -1) + 5).float())


def test_launch_from_new_thread(cubin: bytes) -> None:
    from torch_cubridge.ops.launch import CubinKernel

    k = CubinKernel(cubin, "write_vals", threads=64, smem_bytes=0)
    out = torch.zeros(64, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    # Load on this thread; the worker thread has no current context yet, so
    # its launch exercises the make-primary-current retry.
    k.launch((1, 1, 1), _pack(out, [0] * NVALS, 1.0, 0, 1.0), stream)
    assert not _launch_on_a_new_thread(k, (1, 1, 1), _pack(out, [2] * NVALS, 1.0, 0, 1.0), stream)
    torch.cuda.synchronize()
    assert torch.all(out == 2).item()


def test_errors_are_named(cubin: bytes) -> None:
    from torch_cubridge.ops.launch import CubinKernel, CudaDriverError, libcuda

    out = torch.zeros(8, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    with pytest.raises(CudaDriverError, match="CUDA_ERROR_NOT_FOUND"):
        CubinKernel(cubin, "no_such_kernel", threads=32, smem_bytes=0).launch(
            (1, 1, 1), _pack(out, [0] * NVALS, 1.0, 0, 1.0), stream
        )
    with pytest.raises(CudaDriverError, match="threads per block"):
        CubinKernel(cubin, "write_vals", threads=4096, smem_bytes=0).launch(
            (1, 1, 1), _pack(out, [0] * NVALS, 1.0, 0, 1.0), stream
        )
    k = CubinKernel(cubin, "write_vals", threads=32, smem_bytes=0)
    k.launch((1, 1, 1), _pack(out, [0] * NVALS, 1.0, 0, 1.0), stream)
    with pytest.raises(ValueError, match="kernel parameters"):
        k.launch((1, 1, 1), [b"\0" * 184, b"\0" * 8], stream)  # Params is 16 bytes
    torch.cuda.synchronize()
    if libcuda().get_param_info is not None:
        k = CubinKernel(cubin, "write_vals", threads=32, smem_bytes=0)
        with pytest.raises(ValueError, match="kernel parameters"):
            k.launch((1, 1, 1), [b"\0" * 16, b"\0" * 16], stream)


@pytest.mark.skipif("cuda-python" not in BACKENDS, reason="needs cuda-python")
def test_auto_launches_through_ctypes_until_cuda_python_is_imported(cubin: bytes, monkeypatch) -> None:
    """A new process's first launch does not wait for cuda-python's import (~50 ms): auto starts on
    ctypes and moves to cuda-python at the first launch after the import, with the same results."""
    from torch_cubridge.ops import launch as L

    driver = L._cuda_python_driver()
    monkeypatch.setattr(L, "_c_launch", None)  # the host module's launch would take every auto launch
    monkeypatch.setattr(L, "_host_launch", lambda: None)
    monkeypatch.setattr(L, "_driver_mod", None)
    monkeypatch.setattr(L, "_driver_thread", threading.Thread(target=lambda: None))  # "import under way"
    k = L.CubinKernel(cubin, "write_vals", threads=128, smem_bytes=0)
    assert k.backend == "ctypes"
    n, vals = 1000, list(range(NVALS))
    out = torch.zeros(n, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    k.launch(((n + 127) // 128, 1, 1), _pack(out, vals, 1.0, 2, 3.0), stream)
    torch.cuda.synchronize()
    torch.testing.assert_close(out.cpu(), _expected(n, vals, 1.0, 2, 3.0))
    monkeypatch.setattr(L, "_driver_mod", driver)  # the import finished
    k.launch(((n + 127) // 128, 1, 1), _pack(out, vals, -2.0, 1, 1.0), stream)
    torch.cuda.synchronize()
    assert k.backend == "cuda-python"
    torch.testing.assert_close(out.cpu(), _expected(n, vals, -2.0, 1, 1.0))


def test_auto_launches_through_the_host_module(cubin: bytes, monkeypatch) -> None:
    """Once the host fast path's C module is built, "auto" hands the blocks to its launch: the kernel sees
    every field, a block of the wrong size is refused by name, and a thread without a current context is
    made current and launches."""
    from torch_cubridge.ops import hotpath
    from torch_cubridge.ops import launch as L

    mod = hotpath.wait(120)
    if mod is None:
        pytest.skip(f"no host module: {hotpath.failure}")
    calls: list[tuple] = []

    def counted(*a):
        calls.append(a)
        return mod.launch(*a)
    monkeypatch.setattr(L, "_c_launch", counted)
    k = L.CubinKernel(cubin, "write_vals", threads=128, smem_bytes=0)
    n, vals = 1000, list(range(5, 5 + NVALS))
    out = torch.full((n,), -1.0, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    for scale, add, mul in ((0.5, 7, 2.0), (-1.0, 1, 1.0)):
        k.launch(((n + 127) // 128, 1, 1), _pack(out, vals, scale, add, mul), stream)
        torch.cuda.synchronize()
        torch.testing.assert_close(out.cpu(), _expected(n, vals, scale, add, mul))
    assert len(calls) == 2
    if L.libcuda().get_param_info is not None:
        with pytest.raises(ValueError, match="kernel parameters"):
            k.launch((1, 1, 1), [b"\0" * 184, b"\0" * 8], stream)
    assert not _launch_on_a_new_thread(k, ((n + 127) // 128, 1, 1), _pack(out, [3] * NVALS, 1.0, 0, 1.0), stream)
    torch.cuda.synchronize()
    assert torch.all(out == 3).item() and len(calls) >= 3
