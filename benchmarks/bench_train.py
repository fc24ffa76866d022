"""Training throughput of attention: forward plus backward, torch_cubridge vs FlexAttention (torch.compile),
SDPA (flash, cuDNN) where they take the variant, in one run. bf16, B*S = 32k, H = 16. TFLOP/s count the
forward's 4*D FLOPs a pair and the backward's 10*D (the forward's 3.5x in all) over unmasked pairs only.

Each row also records: the peak memory of one step above its inputs, who computed our backward (the fused
kernel or the reference), and our dQ, dK, dV on the benchmark's own inputs (first batch entry) against float64
autograd of the spec (past 8k keys, the program's own float64 backward: SPEC_AUTOGRAD_MAX_S), judged row by
row as the backward's own first-call check judges them (verify/judge.py: a row may be off by ROW_TOL of its own
largest element, floored at 1/32 of the median non-zero row's), dQ's and dK's rows also by the rounding of
delta from our bf16 O (judge.delta_rounding_allowance, key_delta_rounding_allowance), as in every flash-style
backward (the first-call check hands the float64 backward our O instead).

Usage: python benchmarks/bench_train.py [--plan S:D,...] [--variants a,b] [--out DIR]
Writes bench_train.json to DIR or $OUT (record.py). A plan too long for one device call runs in parts, each
writing its own file; `--merge A.json B.json ... --out DIR` joins parts measured at one commit (a later part's
row replaces an earlier one's of the same variant, S and D).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch_cubridge as tc  # noqa: E402
from record import save  # noqa: E402
from timing import add_tflops, parse_plan  # noqa: E402
from variants import SPECS, document_ids, flex_mods, pair_count, relative_table  # noqa: E402
from torch_cubridge.ops.backward_runner import ROW_TOL  # noqa: E402  (the backward's own first-call check's)
from torch_cubridge.verify.judge import (delta_rounding, delta_rounding_allowance, judge_rows,  # noqa: E402
                                         key_delta_rounding_allowance)
VARIANTS = ("causal", "full", "sliding_1024", "softcap_causal", "alibi_causal", "prefix_1024", "document",
            "gqa_causal", "relbias_causal")


def bench(fn) -> float:
    from triton.testing import do_bench
    return do_bench(fn, warmup=10, rep=100, return_mode="median")  # milliseconds


def peak_gb(fn) -> float:
    """Memory one step allocates at its peak, above what was allocated before it, in GB."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 1e9


def step_of(attn, q, k, v, do, learn=()):
    """One forward and backward: the gradients of q, k, v and the learnable tensors (none accumulated, so steps
    compare)."""
    def step():
        return torch.autograd.grad(attn(q, k, v), (q, k, v, *learn), do)
    return step


# Past this many keys the spec's float64 autograd of one batch entry holds [H, S, S] float64 matrices several
# times over (32 GB each at 16k): the reference is then the program's own backward in float64 (ir/backward.py,
# query tile by tile), which the CPU tests hold to the spec's autograd
SPEC_AUTOGRAD_MAX_S = 8192


def fp64_backward(spec, runner, one: list, ex: tuple, dout: torch.Tensor, v_alone: bool = False) -> tuple:
    """(dQ, dK, dV, the learnable extras' gradients) of one batch entry in float64: autograd of the spec, or
    past SPEC_AUTOGRAD_MAX_S the program's own float64 backward on the operands the runner gives the op (its
    prologue's constants included, such as ALiBi's slopes). v_alone: dV is all the caller reads (P^T dO), so
    the spec's autograd leaves the softmax's backward out (dQ and dK are then None)."""
    learn = [t for t in ex if t.requires_grad]
    if one[0].shape[2] <= SPEC_AUTOGRAD_MAX_S:
        if v_alone:
            return None, None, torch.autograd.grad(spec(*one, *ex), one[2], dout)[0]
        return torch.autograd.grad(spec(*one, *ex), one + learn, dout)
    from torch_cubridge.ir.bind import bind_args
    from torch_cubridge.ops.backward_reference import reference_backward
    q, k, v, extras, scal = runner.op_operands(bind_args(runner.p.signature, (*one, *ex), {}))
    with torch.no_grad():
        dq, dk, dv, tables = reference_backward(runner.p, q, k, v, extras, scal, dout, None,
                                                [i for i, t in enumerate(extras) if t.requires_grad],
                                                fdt=torch.float64)
    return (dq, dk, dv, *tables)


def grads_vs_fp64(spec, runner, grads, q, k, v, do, extra, o) -> dict:
    """Our dQ, dK, dV of the first batch entry against the float64 backward (fp64_backward) on the same inputs;
    dQ's and dK's rows with the rounding of delta = rowsum(dO * O) from our bf16 O allowed (every variant here
    has dscore/ds at most D^-0.5: a softcap's derivative is at most the scale)."""
    one = [t[:1].detach().double().requires_grad_() for t in (q, k, v)]
    ex = tuple(t.detach().double().requires_grad_() if t.is_floating_point() else t[:1] for t in extra)
    ref = fp64_backward(spec, runner, one, ex, do[:1].double())
    g = q.shape[-1] ** -0.5
    rounding = delta_rounding(o[:1], do[:1])
    # P^T delta_rounding per key: the dV of the same backward handed delta_rounding as every column of dO
    p_t = fp64_backward(spec, runner, [t.detach().requires_grad_() for t in one], ex,
                        rounding.unsqueeze(-1).expand(do[:1].shape).contiguous(), v_alone=True)[2][..., 0]
    allow = {"dq": delta_rounding_allowance(o[:1], do[:1], k[:1], g), "dk": key_delta_rounding_allowance(p_t, q[:1], g)}
    out = {}
    for name, gr, r in zip(("dq", "dk", "dv"), grads, ref):
        verdict = judge_rows(gr[:1], r, ROW_TOL, allowance=allow.get(name))
        out[f"{name}_worst_over_bound"] = verdict.worst
        out[f"{name}_rel_l2"] = float((gr[:1].double() - r).norm() / r.norm().clamp_min(1e-30))
        out[f"{name}_ok"] = verdict.ok
    names = ["dq", "dk", "dv"]
    # a learnable table's gradient (one row: every batch entry adds into it) is the first entry's alone here
    for i, r in enumerate(ref[3:]):
        gr = grads[3 + i]
        verdict = judge_rows(gr.reshape(1, -1), r.reshape(1, -1), ROW_TOL)
        out[f"table{i}_worst_over_bound"], out[f"table{i}_ok"] = verdict.worst, verdict.ok
        names.append(f"table{i}")
    out["grads_match_fp64"] = all(out[f"{n}_ok"] for n in names)
    return out


def run_case(name: str, S: int, D: int, H: int, total: int) -> dict:
    from torch_cubridge.ops.backward_runner import backward_for
    dev, B = "cuda", max(1, total // S)
    g = torch.Generator(device=dev).manual_seed(S + D)
    Hkv = H // 4 if name == "gqa_causal" else H
    q, do = (torch.randn(B, H, S, D, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(2))
    k, v = (torch.randn(B, Hkv, S, D, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(2))
    for t in (q, k, v):
        t.requires_grad_()
    extra, doc, rel = (), None, None
    if name == "document":
        doc = document_ids(B, S, dev)
        extra = (doc,)
    if name == "relbias_causal":
        rel = relative_table(H, S, dev)
        extra = (rel,)
    learn = (rel,) if rel is not None else ()
    pairs = pair_count(name, B, S, dev, doc) * H
    flops = 3.5 * 4 * pairs * D
    row: dict = {"variant": name, "S": S, "D": D, "B": B, "H": H, "Hkv": Hkv, "density": pairs / (B * H * S * S)}
    spec = SPECS[name]
    f = tc.compile(spec, fallback="raise")
    ours = step_of(lambda a, b, c: f(a, b, c, *extra), q, k, v, do, learn)
    t0 = time.perf_counter()
    grads = ours()
    if learn:  # the table's gradient sums over the batch: the check's reference takes the first entry alone
        one = step_of(lambda a, b, c: f(a, b, c, *extra), q[:1], k[:1], v[:1], do[:1], learn)()
        grads = grads[:3] + one[3:]
    torch.cuda.synchronize()
    row["first_step_s"] = time.perf_counter() - t0
    row["forward_served"] = dict(f.served)
    row["backward_served"] = dict(backward_for(f.kernels()[-1].kernel_id).served)
    with torch.no_grad():
        o = f(q, k, v, *extra)
    row.update(grads_vs_fp64(spec, f.kernels()[-1], grads, q, k, v, do, extra, o))
    del o
    del grads
    row["ours_ms"] = bench(ours)
    row["ours_peak_gb"] = peak_gb(ours)
    causal = name not in ("full", "softcap_full")
    if name in ("full", "causal", "gqa_causal"):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        for be, kind in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            def sdpa(a, b, c, kind=kind):
                with sdpa_kernel([kind]):
                    return F.scaled_dot_product_attention(a, b, c, is_causal=causal, enable_gqa=Hkv != H)
            try:
                row[f"sdpa_{be}_ms"] = bench(step_of(sdpa, q, k, v, do))
            except Exception as e:  # noqa: BLE001  (this backend does not take the shape)
                row[f"sdpa_{be}_ms"], row[f"sdpa_{be}_error"] = None, str(e)[:200]
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        score, mask = flex_mods(name, H, S, dev, doc, rel)
        bm = create_block_mask(mask, B if name == "document" else None, None, S, S, device=dev) if mask else None
        torch._dynamo.reset()
        flex = torch.compile(flex_attention)
        fstep = step_of(lambda a, b, c: flex(a, b, c, score_mod=score, block_mask=bm, enable_gqa=Hkv != H), q, k, v, do,
                        learn)
        t0 = time.perf_counter()
        fstep()
        torch.cuda.synchronize()
        row["flex_compile_s"] = time.perf_counter() - t0
        row["flex_ms"] = bench(fstep)
        row["flex_peak_gb"] = peak_gb(fstep)
    except Exception as e:  # noqa: BLE001
        row["flex_ms"], row["flex_error"] = None, str(e)[:300]
    add_tflops(row, flops)
    del q, k, v, do
    torch.cuda.empty_cache()
    return row


def merge(paths: list[str], out: str) -> Path:
    """One bench_train.json from parts measured at one commit; parts of different commits are refused (the
    result, and the README table from it, names one commit)."""
    import json
    parts = [json.loads(Path(p).read_text()) for p in paths]
    commits = sorted({p["commit"] for p in parts})
    if len(commits) != 1:
        raise SystemExit(f"bench_train --merge: the parts ran at commits {', '.join(commits)}; merge parts of one "
                         "commit (run the others again)")
    rows: dict[tuple, dict] = {}
    for part in parts:
        for r in part["results"]:
            rows[(r["variant"], r["S"], r["D"])] = r
    path = Path(out) / "bench_train.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    head = {k: v for k, v in parts[-1].items() if k != "results"}
    path.write_text(json.dumps({**head, "results": list(rows.values())}, indent=1))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--merge", nargs="+", default=None, help="parts' bench_train.json files to join into --out")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--plan", default="4096:128,4096:64", help="S:D,S:D,...")
    a = ap.parse_args()
    if a.merge:
        print(merge(a.merge, a.out))
        return
    warnings.filterwarnings("ignore")
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    rows = []
    for S, D in parse_plan(a.plan):
        for name in a.variants.split(","):
            try:
                r = run_case(name, S, D, 16, 32768)
            except Exception as e:  # noqa: BLE001  (a row that fails is reported, the rest still run)
                r = {"variant": name, "S": S, "D": D, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            rows.append(r)
            if "error" in r:
                print(f"{name:15s} S={S:5d} D={D:3d} ERROR {r['error']}", flush=True)
                continue
            print(f"{name:15s} S={S:5d} D={D:3d} grads {'ok' if r['grads_match_fp64'] else 'WRONG':5s} "
                  f"bwd {r['backward_served']}  ours {r.get('ours_tflops', 0):6.1f} TF/s {r['ours_peak_gb']:5.2f} GB"
                  f"  flex {r.get('flex_tflops') or 0:6.1f} {r.get('flex_peak_gb') or 0:5.2f} GB"
                  f"  flash {r.get('sdpa_flash_tflops') or 0:6.1f}  cudnn {r.get('sdpa_cudnn_tflops') or 0:6.1f}",
                  flush=True)
    print(save(Path(a.out), "bench_train", {"results": rows}))


if __name__ == "__main__":
    main()
