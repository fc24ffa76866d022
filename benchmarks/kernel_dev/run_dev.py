"""Dev harness for csrc/cubridge/fwd_kernel.cuh (runs on the GPU machine).

Loads a cubin built from dev_kernels.cu (build.sh; or builds it here with
--build), launches the kernels through the CUDA driver API (cuda-python) with
FwdArgs packed as raw bytes, checks them against a float64 reference, and
times them against torch SDPA (flash backend).

  PYTHONUNBUFFERED=1 python benchmarks/kernel_dev/run_dev.py [--cubin F] [--check] [--bench] [--tune]
"""
import argparse
import ctypes
import math
import os
import struct
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

try:
    from cuda.bindings import driver as cu
except ImportError:  # older cuda-python
    from cuda import cuda as cu

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))


def chk(res):
    err = res[0]
    if int(err) != 0:
        raise RuntimeError(f"CUDA driver error {err}")
    return res[1] if len(res) == 2 else res[1:]


class Module:
    def __init__(self, path):
        torch.cuda.init()
        torch.zeros(1, device="cuda")  # make the primary context current
        chk(cu.cuInit(0))
        data = open(path, "rb").read()
        self._buf = ctypes.create_string_buffer(data)
        self.mod = chk(cu.cuModuleLoadData(ctypes.addressof(self._buf)))
        self.funcs = {}

    def cfg(self, name):
        ptr, size = chk(cu.cuModuleGetGlobal(self.mod, (name + "_cfg").encode()))
        out = (ctypes.c_int * 4)()
        chk(cu.cuMemcpyDtoH(ctypes.addressof(out), ptr, 16))
        return dict(threads=out[0], smem=out[1], bm=out[2], d=out[3])

    def func(self, name):
        if name not in self.funcs:
            f = chk(cu.cuModuleGetFunction(self.mod, name.encode()))
            c = self.cfg(name)
            chk(cu.cuFuncSetAttribute(
                f, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, c["smem"]))
            self.funcs[name] = (f, c)
        return self.funcs[name]


def pack_args(q, k, v, o, lse, scale):
    """FwdArgs: every field 8 bytes, declaration order (variant.cuh)."""
    B, Hq, Sq, D = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    for t in (q, k, v, o):
        assert t.stride(-1) == 1 and t.data_ptr() % 16 == 0
    f = [q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse.data_ptr() if lse is not None else 0]
    s = []
    for t in (q, k, v, o):
        s += [t.stride(0), t.stride(1), t.stride(2)]
    return struct.pack("<5Q12q5qd", *f, *s, B, Hq, Hkv, Sq, Skv, scale)


class Launcher:
    """Prepared launch: argument buffers stay alive as long as this object."""

    def __init__(self, mod, name, q, k, v, o, lse, scale, params=b"\0" * 8):
        self.f, c = mod.func(name)
        B, Hq, Sq, _ = q.shape
        self.grid = ((Sq + c["bm"] - 1) // c["bm"], Hq, B)
        self.block = c["threads"]
        self.smem = c["smem"]
        self.a = ctypes.create_string_buffer(pack_args(q, k, v, o, lse, scale))
        self.p = ctypes.create_string_buffer(params)
        self.ptrs = (ctypes.c_void_p * 2)(ctypes.addressof(self.a), ctypes.addressof(self.p))

    def __call__(self):
        stream = torch.cuda.current_stream().cuda_stream
        chk(cu.cuLaunchKernel(self.f, *self.grid, self.block, 1, 1, self.smem, stream,
                              ctypes.addressof(self.ptrs), 0))


def reference(q, k, v, scale, causal=False, cap=None, sinks=None, meanv=False):
    B, Hq, Sq, D = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    g = Hq // Hkv
    qd = q.double()
    kd = k.double().repeat_interleave(g, dim=1)
    vd = v.double().repeat_interleave(g, dim=1)
    s = qd @ kd.transpose(-1, -2) * scale
    if cap is not None:
        s = cap * torch.tanh(s / cap)
    qi = torch.arange(Sq, device=q.device)[:, None]
    ki = torch.arange(Skv, device=q.device)[None, :]
    keep = torch.ones(Sq, Skv, dtype=torch.bool, device=q.device)
    if causal:
        keep = ki <= qi + (Skv - Sq)
    s = s.masked_fill(~keep, float("-inf"))
    if sinks is not None:
        sk = sinks.double().view(1, Hq, 1, 1).expand(B, Hq, Sq, 1)
        lse = torch.logsumexp(torch.cat([s, sk], -1), -1)
    else:
        lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None])
    p = torch.nan_to_num(p, nan=0.0)
    o = p @ vd
    empty = ~keep.any(-1)  # [Sq]
    if empty.any():
        o[:, :, empty] = vd.mean(2, keepdim=True).expand_as(o)[:, :, empty] if meanv else 0.0
        if sinks is None:
            lse[:, :, empty] = float("-inf")
    return o, lse


def rel_l2(a, b):
    d = (a.double() - b).norm().item()
    n = b.norm().item()
    return d / max(n, 1e-30)


def make_qkv(B, Hq, Hkv, Sq, Skv, D, dtype, layout="bhsd"):
    def mk(H, S):
        if layout == "bshd":  # strided: heads interleaved within a token
            return torch.randn(B, S, H, D, device="cuda", dtype=dtype).permute(0, 2, 1, 3)
        return torch.randn(B, H, S, D, device="cuda", dtype=dtype)
    return mk(Hq, Sq), mk(Hkv, Skv), mk(Hkv, Skv)


def run_checks(mod):
    dims = [64, 96, 128, 256]
    cases = []  # (variant, dtype-tag, B, Hq, Hkv, Sq, Skv, layout)
    for D in dims:
        for tt in ("bf16", "f16"):
            cases += [
                ("full", tt, D, 2, 8, 2, 77, 1000, "bhsd"),
                ("full", tt, D, 1, 4, 4, 1, 1, "bhsd"),
                ("full", tt, D, 2, 4, 1, 1000, 77, "bshd"),
                ("causal", tt, D, 2, 8, 2, 1000, 1000, "bshd"),
                ("causal", tt, D, 1, 4, 1, 77, 1000, "bhsd"),
                ("causal", tt, D, 1, 4, 4, 1000, 77, "bhsd"),
                ("causal", tt, D, 1, 2, 2, 1, 1000, "bhsd"),
            ]
        cases += [
            ("meanv", "bf16", D, 1, 4, 2, 1000, 77, "bhsd"),
            ("softcap", "bf16", D, 2, 8, 2, 300, 513, "bshd"),
            ("sink", "f16", D, 2, 8, 2, 333, 333, "bhsd"),
            ("sink", "f16", D, 1, 4, 4, 200, 50, "bhsd"),
        ]
    fails = 0
    torch.manual_seed(0)
    for (var, tt, D, B, Hq, Hkv, Sq, Skv, layout) in cases:
        dtype = torch.bfloat16 if tt == "bf16" else torch.float16
        name = f"fwd_{var}_{D}_{tt}"
        q, k, v = make_qkv(B, Hq, Hkv, Sq, Skv, D, dtype, layout)
        o = torch.full((B, Hq, Sq, D), float("nan"), device="cuda", dtype=dtype)
        lse = torch.full((B, Hq, Sq), float("nan"), device="cuda", dtype=torch.float32)
        scale = 1.0 / math.sqrt(D)
        params = b"\0" * 8
        cap = sinks = None
        if var == "softcap":
            cap = 1.5
            params = struct.pack("<d", cap)
        if var == "sink":
            sinks = torch.randn(Hq, device="cuda", dtype=torch.float32) * 2
            params = struct.pack("<Q", sinks.data_ptr())
        L = Launcher(mod, name, q, k, v, o, lse, scale, params)
        L()
        torch.cuda.synchronize()
        ro, rl = reference(q, k, v, scale, causal=var in ("causal", "meanv", "sink"), cap=cap,
                           sinks=sinks, meanv=var == "meanv")
        err = rel_l2(o, ro)
        fin = torch.isfinite(rl)
        lerr = (lse[fin].double() - rl[fin]).abs().max().item() if fin.any() else 0.0
        inf_ok = bool((lse[~fin] == float("-inf")).all().item())
        nan = torch.isnan(o).any().item()
        ok = err < 1e-2 and lerr < 1e-2 and inf_ok and not nan
        fails += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name:22s} B{B} H{Hq}/{Hkv} Sq{Sq:5d} Skv{Skv:5d} {layout} "
              f"relL2={err:.2e} lse_maxerr={lerr:.1e} lse_inf_ok={inf_ok} nan={nan}")
    print(f"correctness: {len(cases) - fails}/{len(cases)} passed")
    return fails


args_modes = ("full", "causal")


def bench(mod, names, dims=(128, 64), seqs=(1024, 4096, 16384), H=16, tokens=32768):
    torch.manual_seed(0)
    import triton.testing as tt
    from torch.nn.attention import SDPBackend, sdpa_kernel

    print(f"\n{'D':>4} {'S':>6} {'B':>3} {'mode':6s} {'kernel':18s} {'ms':>8} {'TFLOP/s':>8} {'sdpa':>8} {'ratio':>6}")
    for D in dims:
        for S in seqs:
            B = tokens // S
            q, k, v = make_qkv(B, H, H, S, S, D, torch.bfloat16)
            o = torch.empty_like(q)
            for mode in args_modes:
                dens = 0.5 if mode == "causal" else 1.0
                flops = 4 * B * H * S * S * D * dens
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    ms_ref = tt.do_bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=mode == "causal"))
                ref_tf = flops / ms_ref / 1e9
                for nm in names(D, mode):
                    L = Launcher(mod, nm, q, k, v, o, None, 1.0 / math.sqrt(D))
                    ms = tt.do_bench(L)
                    tf = flops / ms / 1e9
                    print(f"{D:4d} {S:6d} {B:3d} {mode:6s} {nm:18s} {ms:8.3f} {tf:8.1f} {ref_tf:8.1f} {tf / ref_tf:6.3f}")


NVRTC_TU = r"""
#include "cubridge/fwd_kernel.cuh"
struct Variant : cubridge::DefaultVariant {
  static constexpr bool kHasMask = true;
  __device__ __forceinline__ static bool mask(const cubridge::FwdArgs& a, const Params&, int, int,
                                              int q, int kv) { return kv <= q; }
};
extern "C" __global__ void __launch_bounds__(256, 1) cubridge_fwd(cubridge::FwdArgs a, Variant::Params p) {
  cubridge::attention_fwd<cubridge::FwdConfig<128, __nv_bfloat16>, Variant, __nv_bfloat16>(a, p);
}
"""


def nvrtc_check():
    """The headers must compile under NVRTC (no std headers)."""
    try:
        from cuda.bindings import nvrtc
    except ImportError:
        from cuda import nvrtc
    err, prog = nvrtc.nvrtcCreateProgram(NVRTC_TU.encode(), b"tu.cu", 0, [], [])
    opts = [b"--gpu-architecture=sm_90", b"-std=c++17", ("-I" + os.path.join(ROOT, "csrc")).encode(),
            b"-I/usr/local/cuda/include"]
    t0 = time.time()
    (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    _, n = nvrtc.nvrtcGetProgramLogSize(prog)
    log = b" " * n
    nvrtc.nvrtcGetProgramLog(prog, log)
    print(f"NVRTC compile: {err} in {time.time() - t0:.1f}s", log.decode(errors="replace")[:2000])
    return int(err) == 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cubin", default=os.path.join(HERE, "dev_kernels.cubin"))
    ap.add_argument("--build", action="store_true")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--tune", default="", help="comma list of tuning tags present in the cubin")
    ap.add_argument("--seqs", default="1024,4096,16384")
    ap.add_argument("--dims", default="128,64")
    args = ap.parse_args()
    print("GPU:", torch.cuda.get_device_name(), "| torch", torch.__version__)
    if args.build:
        t0 = time.time()
        subprocess.check_call(["bash", os.path.join(HERE, "build.sh"), args.cubin])
        print(f"built {args.cubin} in {time.time() - t0:.1f}s")
    mod = Module(args.cubin)
    fails = run_checks(mod) if args.check else 0
    if args.check:
        try:
            fails += not nvrtc_check()
        except Exception as e:  # report, do not hide the other results
            print("NVRTC check error:", repr(e))
    if args.bench:
        tags = [t for t in args.tune.split(",") if t]
        seqs = tuple(int(s) for s in args.seqs.split(","))

        def names(D, mode):
            out = [f"fwd_{mode}_{D}_bf16"]
            out += [f"fwd_{t}_{mode}" for t in tags if t.startswith(f"t{D}")]
            return out
        bench(mod, names, dims=tuple(int(d) for d in args.dims.split(",")), seqs=seqs)
    sys.exit(1 if fails else 0)


if __name__ == "__main__":
    main()
