"""A/B of decode kernel builds that differ by preprocessor defines, in one process, against SDPA-flash and cuDNN
(B 8, 32:8 heads, D 128 or --dim, bf16, 4k and 32k keys; do_bench and a read flush, interleaved rounds).

Usage: python benchmarks/ab_decode_defines.py OUT.json "swz:" "padded:CUBRIDGE_DECODE_SWZ=0" [--pages=16,256] [--dim=256]
(--pages: the same keys also in pages of those sizes, in random order, through the paged decode kernel)
A label's defines go ahead of the kernel source (the kernel cache keys by source, so each is its own build)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from bench_decode import bench, gqa_decode, paged_gqa_decode, sdpa, source_defines, tc  # noqa: E402
from timing import clean_flush_ms  # noqa: E402


def build(defines: dict[str, str], spec, *args):
    with source_defines(defines):
        f = tc.compile(spec, fallback="raise")
        o = f(*args)
    # against float64 on sequence 0 (every argument with the batch's leading size cut to one: the pages are not;
    # the whole batch's float64 reference ran out of the H100's memory at D 256, 32k keys)
    cut = [x[:1] if x.shape[0] == args[0].shape[0] else x for x in args]
    ref = spec(*(x.double() if x.is_floating_point() else x for x in cut))
    return (lambda: f(*args)), float((o[:1].double() - ref).norm() / ref.norm())


def main() -> None:
    out_path, labels = sys.argv[1], [x for x in sys.argv[2:] if not x.startswith("--")]
    pages = [int(x) for a in sys.argv[2:] if a.startswith("--pages=") for x in a[8:].split(",") if x]
    D = next((int(a[6:]) for a in sys.argv[2:] if a.startswith("--dim=")), 128)
    print(torch.cuda.get_device_name(), flush=True)
    rows = []
    for Skv in (4096, 32768):
        q = torch.randn(8, 32, 1, D, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(8, 8, Skv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        nb = 2 * 2 * 8 * 8 * Skv * D
        fns = {}
        for backend in ("flash", "cudnn"):  # (one may not take the head dim)
            try:
                sdpa(backend, q, k, v)
                fns[backend] = lambda backend=backend: sdpa(backend, q, k, v)
            except RuntimeError as e:
                rows.append({"Skv": Skv, "impl": backend, "skipped": str(e)[:200]})
        for lab in labels:
            name, _, spec = lab.partition(":")
            defines = dict(d.split("=") for d in spec.split(",") if d)
            fns[name], err = build(defines, gqa_decode, q, k, v)
            rows.append({"Skv": Skv, "impl": name, "defines": defines, "rel_err_vs_fp64": err})
            for P in pages:  # the same keys in pages of P, in random order
                per = Skv // P
                kp, vp = (x.reshape(8, 8, per, P, D).permute(0, 2, 1, 3, 4).reshape(8 * per, 8, P, D) for x in (k, v))
                perm = torch.randperm(8 * per, device="cuda")
                kp, vp = kp[perm].contiguous(), vp[perm].contiguous()
                table = torch.argsort(perm).reshape(8, per)
                fns[f"{name}_p{P}"], err = build(defines, paged_gqa_decode, q, kp, vp, table)
                rows.append({"Skv": Skv, "impl": f"{name}_p{P}", "defines": defines, "rel_err_vs_fp64": err})
        for _ in range(2):  # interleaved: the first measured is not the only one warmed
            for name, fn in fns.items():
                rows.append({"Skv": Skv, "impl": name, "do_bench_tbs": nb / (bench(fn) * 1e-3) / 1e12})
        for name, ms in clean_flush_ms(fns, rounds=3).items():
            rows.append({"Skv": Skv, "impl": name, "clean_tbs": nb / (ms * 1e-3) / 1e12})
    for r in rows:
        print(json.dumps(r), flush=True)
    Path(out_path).write_text(json.dumps({"device": torch.cuda.get_device_name(), "head_dim": D, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
