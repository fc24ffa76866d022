"""GPU check of the backward kernels (csrc/cubridge/bwd_kernel*.cuh, lower/backward.py): the arch's own.

For each zoo program (causal, full, softcap, sliding window, GQA, document mask, plus a spec with fully masked
rows), B=2, H=4, S in {128, 257, 1024}, D in {64, 128}, bf16: O and the LSE from the CuIR interpreter in float64,
the backward kernels built and launched through the library (ops/backward_gpu.py), and dQ,
dK, dV compared per row (max abs error of a row / the row's max abs, rows of near-zero reference judged against
the tensor's max) with the float64 backward of the kernel's own inputs (delta from the bf16 O it is handed; the
verdict), and dQ also with float64 autograd of the spec (end to end: rows that keep few keys carry the bf16 O's
error in delta there, in any FlashAttention-style backward; bwd_rows.py says why). A mismatch prints its worst
rows: where they sit in their blocks and how many keys they keep. Then the backward's time against SDPA's flash
and cuDNN backends at B*S = 32k, H = 16, S = 4096, D 128 and 64 (TFLOP/s at 2.5x the forward's FLOPs over live pairs).
Exits 1 on any mismatch or error. Run: python benchmarks/kernel_dev/bwd_check.py [--no-bench | --bench-only]
[--d D] | --sweep (the rate over S) | --sites (a learnable table's cost) | --shares [--s S] (a split call's cost). Under `ncu --profile-from-start off`, `--ncu` runs one backward each of
ours and cuDNN's; with CUBRIDGE_LINEINFO=1 and a fresh CUBRIDGE_CACHE_DIR, ncu's SourceCounters name our lines.
"""
from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "support"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch_cubridge as tc  # noqa: E402
from torch_cubridge.ir.bind import bind_args, extra_tensors  # noqa: E402
from torch_cubridge.ir.interpreter import run_program  # noqa: E402
from torch_cubridge.ops.backward_gpu import GpuBackward  # noqa: E402
from zoo import CASES, EMPTY_ROWS, empty_rows_causal, empty_rows_reference, std  # noqa: E402
from bwd_rows import diagnose, kernel_reference, live_keys, lse_program, row_errors  # noqa: E402

TOL_ROW = 0.05   # a row's max abs error over its max abs (bf16 P and dS on the tensor cores: ~1e-2 typical)
NAMES = ["causal_sdpa", "full_matmul", "softcap_causal", "sliding_window", "gqa_expand", "document_causal"]


def case(name):
    """The spec, its argument maker and its float64 autograd reference."""
    if name == "empty_rows_causal":
        return empty_rows_causal, std, empty_rows_reference
    c = next(c for c in CASES if c.name == name)
    return c.fn, c.make, c.fn


_BUILT: dict = {}


def kernels(p, D, arch, kernel=None, deterministic=False, stages=None, learnable=()):
    """The backward kernels as the library builds them (ops/backward_gpu.py); kernel: "sm90" or "sm80" (None:
    the lowering's choice for the arch); learnable: the extras whose gradients it adds (lower/sites.py)."""
    key = (p.structure().to_json(), D, arch, kernel, deterministic, stages, learnable)
    if key not in _BUILT:
        _BUILT[key] = GpuBackward(p, arch, torch.bfloat16, D, kernel=kernel, deterministic=deterministic,
                                  stages=stages, learnable=learnable)
    return _BUILT[key]


def run_backward(p, bound, q, k, v, o, lse, do, D, arch, kernel=None, deterministic=False, stages=None,
                 learnable=()):
    """dQ, dK, dV (and, with learnable, the float32 gradients of those extras by name) by the three kernels
    (q, k, v, o, do: [B, H, S, D] bf16 on the GPU; lse: [B, H, Sq] fp32)."""
    kern = kernels(p, D, arch, kernel, deterministic, stages, learnable)
    tensors = extra_tensors(p, bound, q.device, {})
    extras = [tensors[x.name] for x in p.extras]
    scalars = [bound[s.arg] for s in p.scalars if s.arg is not None]

    def go():
        got = kern(q, k, v, extras, scalars, o, lse, do)
        return got if learnable else got[:3]
    return go(), go, (tensors,)


def check(name, B, H, Hkv, S, D, arch):
    """(ok, [dQ, dK, dV] errors against the kernel-input reference, dQ's end-to-end error, finite, lines)."""
    fn, make, ref_fn = case(name)
    small = make(2, 4, Hkv, 70, D, torch.float32)
    p = tc.transfer(fn, *small)
    args = make(B, H, Hkv, S, D, torch.float32)
    dev = "cuda"
    q, k, v = (a.to(dev, torch.bfloat16) for a in args[:3])
    extras = [a.to(dev) if isinstance(a, torch.Tensor) else a for a in args[3:]]
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    out = ref_fn(q64, k64, v64, *extras)
    do = torch.randn_like(q, dtype=torch.float32).to(torch.bfloat16)
    out.backward(do.double())
    e2e = (q64.grad, k64.grad, v64.grad)
    o64, lse64 = run_program(lse_program(p), q.double(), k.double(), v.double(), *extras)
    o = o64.to(torch.bfloat16).contiguous()
    lse = lse64.float().contiguous()
    bound = bind_args(p.signature, (q, k, v, *extras), {})
    got, _, _ = run_backward(p, bound, q, k, v, o, lse, do, D, arch)
    torch.cuda.synchronize()
    ref = kernel_reference(p, q, k, v, extras, o, do)
    finite = all(torch.isfinite(g).all().item() for g in got)
    row_errs = [row_errors(g, r) for g, r in zip(got, ref)]
    errs = [e.max().item() for e in row_errs]
    e2e_dq = row_errors(got[0], e2e[0])
    if name == "empty_rows_causal":  # the first rows keep no key: dQ zero there
        finite = finite and got[0][:, :, :EMPTY_ROWS].abs().max().item() == 0.0
    ok = finite and max(errs) < TOL_ROW
    lines = []
    tile = kernels(p, D, arch).low.tile
    live = live_keys(fn, q, k, extras) if not ok or e2e_dq.max().item() >= TOL_ROW else None
    if not ok:
        for label, e, r, blk in zip(("dQ", "dK", "dV"), row_errs, ref, (tile.block_m, tile.block_n, tile.block_n)):
            if e.max().item() >= TOL_ROW:
                lines += diagnose(label, e, r, blk, TOL_ROW, live if label == "dQ" else None)
    if e2e_dq.max().item() >= TOL_ROW:
        lines += diagnose("dQ end to end", e2e_dq, e2e[0], tile.block_m, TOL_ROW, live, worst=2)
    if name == "causal_sdpa":  # the yardstick: torch's flash backward on the same inputs, held to the same rows
        lines.append(f"    SDPA flash's dQ end to end on these inputs: {flash_dq_error(q, k, v, do, e2e[0]):.2e}")
    return ok, errs, e2e_dq.max().item(), finite, lines


def flash_dq_error(q, k, v, do, ref) -> float:
    """dQ's end-to-end row error of SDPA's flash backward (causal) on the same bf16 inputs; nan where absent."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    try:
        qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            out = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True)
        return row_errors(torch.autograd.grad(out, qq, do)[0], ref).max().item()
    except Exception:  # a torch build without the flash backend
        return float("nan")


def timing_inputs(name, causal, B, H, S, D, arch, group=1):
    """One zoo program's backward at [B, H, S, D] in bf16 (K and V with H // group heads), O and the LSE from
    SDPA's flash forward: the program, the spec, its bound call, q, k, v, O, the LSE and dO, our backward
    (run_backward's), and the backward's FLOPs (2.5x the forward's, over live pairs)."""
    fn, make, _ = case(name)
    p = tc.transfer(fn, *(make(2, 4, 4, 70, D, torch.float32) if group == 1 else
                          make(2, H, H // group, 70, D, torch.float32)))
    q = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, H // group, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    do = torch.randn_like(q)
    kk, vv = (t.repeat_interleave(group, 1) for t in (k, v)) if group > 1 else (k, v)  # SDPA's flash: MHA
    res = torch.ops.aten._scaled_dot_product_flash_attention(q, kk, vv, 0.0, causal, False, scale=D ** -0.5)
    o, lse = res[0].contiguous(), res[1].float().contiguous()
    del kk, vv
    more = tuple(a.cuda() if isinstance(a, torch.Tensor) else a
                 for a in make(1, H, H // group, S, 8, torch.float32)[3:])
    bound = bind_args(p.signature, (q, k, v, *more), {})
    _, go, _ = run_backward(p, bound, q, k, v, o, lse, do, D, arch)
    flops = 2.5 * 4 * B * H * S * S * D * (0.5 if causal else 1.0)
    return p, fn, bound, (q, k, v, o, lse, do), go, flops


def sdpa_backward(q, k, v, do, causal, backend):
    """SDPA's backward on `backend` (its forward run once), as a function to time."""
    from torch.nn.attention import sdpa_kernel
    qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
    with sdpa_kernel([backend]):
        out = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)
    return lambda: torch.autograd.grad(out, (qq, kk, vv), do, retain_graph=True)


def bench(arch, dims=(128, 64)):
    print(f"\nbackward timing, bf16, B*S = 32k, H = 16, S = 4096, D = {dims} (TFLOP/s at 2.5x forward FLOPs)")
    from torch.nn.attention import SDPBackend
    B, H, S = 8, 16, 4096
    for D, (name, causal) in ((D, c) for D in dims for c in (("causal_sdpa", True), ("full_matmul", False))):
        p, fn, bound, (q, k, v, o, lse, do), go, flops = timing_inputs(name, causal, B, H, S, D, arch)
        row = [f"D {D} {name:12s}", f"ours {flops / timed(go) / 1e12:6.1f} ({kernels(p, D, arch).low.tile.kernel}"]
        if arch == "sm_90a":  # the FA2-class kernel the Hopper one replaces, and the deterministic mode
            _, go80, _ = run_backward(p, bound, q, k, v, o, lse, do, D, arch, "sm80")
            row.append(f"sm80: {flops / timed(go80) / 1e12:6.1f}")
            _, godet, _ = run_backward(p, bound, q, k, v, o, lse, do, D, arch, None, True)
            row.append(f"deterministic: {flops / timed(godet) / 1e12:6.1f}")
            _, go3, _ = run_backward(p, bound, q, k, v, o, lse, do, D, arch, None, False, 3)
            row.append(f"3 stages: {flops / timed(go3) / 1e12:6.1f}")
        row[-1] += ")"
        for label, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            try:
                row.append(f"{label} {flops / timed(sdpa_backward(q, k, v, do, causal, be)) / 1e12:6.1f}")
            except Exception as e:  # a backend this torch build lacks
                row.append(f"{label} n/a ({type(e).__name__})")
        try:
            f = tc.compile(fn, fallback="raise")
            f(q, k, v)
            t_fwd = timed(lambda: f(q, k, v))
            row.append(f"| ours fwd {flops / 2.5 / t_fwd / 1e12:6.1f}, fwd+bwd {flops * 3.5 / 2.5 / (t_fwd + timed(go)) / 1e12:6.1f}"
                       " (at 3.5x)")
        except Exception as e:
            row.append(f"| ours fwd n/a ({type(e).__name__}: {str(e)[:80]})")
        print("  ".join(row))


def sweep(arch):
    """The backward's rate over S at B*S = 32k (D 128), ours and cuDNN's: with a CTA per key block, the items
    per CTA grow with S, so a fixed cost per CTA shows as a rate that climbs with S."""
    from torch.nn.attention import SDPBackend
    H, D = 16, 128
    print("\nbackward over S, B*S = 32k, H 16, D 128 (TFLOP/s at 2.5x forward FLOPs): ours / cudnn")
    for name, causal in (("causal_sdpa", True), ("full_matmul", False)):
        row = [f"{name:12s}"]
        for S in (1024, 2048, 4096, 8192, 16384):
            _, _, _, (q, k, v, _, _, do), go, flops = timing_inputs(name, causal, 32768 // S, H, S, D, arch)
            t = timed(sdpa_backward(q, k, v, do, causal, SDPBackend.CUDNN_ATTENTION))
            row.append(f"S {S}: {flops / timed(go) / 1e12:5.1f} / {flops / t / 1e12:5.1f}")
        print("  ".join(row), flush=True)


def sites(arch):
    """A learnable relative-position table [H, 2S - 1] (zoo's rel_bias_table, full attention) at the bench's
    shape: the backward with the table fixed and adding its gradient (lower/sites.py), on the Hopper kernel and
    on the FA2-class one: what the sites cost on each."""
    B, H, S, D = 8, 16, 4096, 128
    print("\nlearnable sites, rel_bias_table, B*S = 32k, H 16, S 4096, D 128 (TFLOP/s at 2.5x forward FLOPs)")
    p, _, bound, (q, k, v, o, lse, do), _, flops = timing_inputs("rel_bias_table", False, B, H, S, D, arch)
    row = []
    for label, kernel, learn in (("sm90 fixed", None, ()), ("sm90 learnable", None, ("table",)),
                                 ("sm80 fixed", "sm80", ()), ("sm80 learnable", "sm80", ("table",))):
        _, go, _ = run_backward(p, bound, q, k, v, o, lse, do, D, arch, kernel, learnable=learn)
        row.append(f"{label} {flops / timed(go) / 1e12:6.1f}")
    print("  ".join(row), flush=True)


def shares(arch, S=4096, ds=(128, 64)):
    """The backward split into shares (ops/backward_shares.py) against one launch, at the bench's shapes: the
    rate and the scratch's peak, per split (a share's scratch as a fraction of q's bytes: at 4k 0.3 is one batch
    of 16 heads, 0.15 half its heads, 0.075 a quarter; "default" the library's own split) and streams in flight."""
    print(f"\nshares, B*S = 32k, H 16, S {S} (TFLOP/s at 2.5x forward FLOPs; MB of the backward's peak above its"
          " inputs and outputs)")
    from torch_cubridge.ops import backward_gpu
    B, H = 32768 // S, 16
    for D in ds:
        for name, causal in (("causal_sdpa", True), ("full_matmul", False), ("gqa_expand", True)):
            group = 4 if name == "gqa_expand" else 1  # 4 query heads per KV head
            p, _, _, (q, k, v, o, lse, do), go, flops = timing_inputs(name, causal, B, H, S, D, arch, group)
            kern = kernels(p, D, arch)
            row = [f"D {D} {name:12s}"]
            for label, frac, waves, streams in (
                    ("default", backward_gpu.SCRATCH_OF_Q, backward_gpu.WAVES, backward_gpu.STREAMS),
                    ("whole", 100.0, 0, 1), ("batch/1", 0.3, 0, 1), ("batch/2", 0.3, 0, 2), ("half/2", 0.15, 0, 2),
                    ("quarter/2", 0.075, 0, 2)):
                kern.scratch_of_q, kern.waves, kern.streams = frac, waves, streams
                t = timed(go)
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                go()
                torch.cuda.synchronize()
                mb = (torch.cuda.max_memory_allocated() - base - 2 * (q.numel() + k.numel() + v.numel())) / 1e6
                row.append(f"{label} {flops / t / 1e12:6.1f} {mb:5.0f}")
            print("  ".join(row), flush=True)


def profiled():
    """One backward each of ours and cuDNN's (causal and full, the bench's shapes) inside the profiler's range:
    run under `ncu --profile-from-start off` to read where the gap to cuDNN goes."""
    from torch.nn.attention import SDPBackend
    B, H, S, D = 8, 16, 4096, 128
    for name, causal in (("causal_sdpa", True), ("full_matmul", False)):
        _, _, _, (q, k, v, _, _, do), go, _ = timing_inputs(name, causal, B, H, S, D, "sm_90a")
        cudnn = sdpa_backward(q, k, v, do, causal, SDPBackend.CUDNN_ATTENTION)
        go(), cudnn()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        go(), cudnn()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        print(f"profiled {name}", flush=True)


def timed(f, reps=10):
    f()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        f()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def main() -> int:
    if not torch.cuda.is_available():
        print("bwd_check: no CUDA device")
        return 2
    major, minor = torch.cuda.get_device_capability()
    arch = "sm_90a" if major == 9 else f"sm_{major}{minor}"  # the library's Hopper target
    if "--sweep" in sys.argv:
        sweep("sm_90a")
        return 0
    if "--sites" in sys.argv:
        sites(arch)
        return 0
    if "--shares" in sys.argv:
        shares(arch, int(sys.argv[sys.argv.index("--s") + 1]) if "--s" in sys.argv else 4096,
               (int(sys.argv[sys.argv.index("--d") + 1]),) if "--d" in sys.argv else (128, 64))
        return 0
    if "--ncu" in sys.argv:
        profiled()
        return 0
    print(f"bwd_check on {torch.cuda.get_device_name()} ({arch}), torch {torch.__version__}; row tolerance {TOL_ROW}")
    print("dQ, dK, dV: against the float64 backward of the kernel's inputs (the verdict); dQ e2e: against float64"
          " autograd of the spec")
    print(f"{'program':22s} {'S':>5s} {'D':>4s}  {'dQ':>8s} {'dK':>8s} {'dV':>8s}  {'dQ e2e':>8s}  finite  verdict")
    bad = 0
    t0 = time.time()
    for name in NAMES + ["empty_rows_causal"] if "--bench-only" not in sys.argv else []:
        for D in (64, 128) if "--d" not in sys.argv else (int(sys.argv[sys.argv.index("--d") + 1]),):
            for S in (128, 257, 1024):
                Hkv = 2 if name == "gqa_expand" else 4
                try:
                    ok, errs, e2e, finite, lines = check(name, 2, 4, Hkv, S, D, arch)
                    print(f"{name:22s} {S:5d} {D:4d}  " + " ".join(f"{e:8.2e}" for e in errs) + f"  {e2e:8.2e}"
                          + f"  {str(finite):6s}  {'ok' if ok else 'MISMATCH'}", flush=True)
                    for line in lines:
                        print(line, flush=True)
                    bad += not ok
                except Exception as e:
                    bad += 1
                    print(f"{name:22s} {S:5d} {D:4d}  ERROR {type(e).__name__}: {e}", flush=True)
                    traceback.print_exc(limit=4)
    print(f"checks done in {time.time() - t0:.0f} s: {bad} failing")
    if "--no-bench" not in sys.argv:
        try:
            bench(arch, (int(sys.argv[sys.argv.index("--d") + 1]),) if "--d" in sys.argv else (128, 64))
        except Exception as e:
            print(f"bench ERROR {type(e).__name__}: {e}")
            traceback.print_exc(limit=6)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
