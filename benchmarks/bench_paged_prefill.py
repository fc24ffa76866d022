"""Chunked prefill over a paged KV cache: a chunk of Sq new queries a sequence against its Skv cached keys
(the chunk's own among them, causal aligned bottom-right), K/V in pages [N, Hkv, P, D] read through a
block table, GQA, bf16. In one process:
  - ours, the pages read in place by the Hopper kernel (TMA boxes per page);
  - ours, the same program with the pages gathered by the prologue first (what served before);
  - ours on the same keys stored contiguously (a separate spec; the kernel's ceiling);
  - SDPA (flash, cuDNN) and FlexAttention on the contiguous keys, the gather not counted.
TFLOP/s count the unmasked (query, key) pairs only.

Usage: python benchmarks/bench_paged_prefill.py [--out DIR] [--rows 4x512x8192,...] [--pages 16,256]
Writes bench_paged_prefill.json to DIR or $OUT.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch_cubridge as tc  # noqa: E402
import torch_cubridge.ir.paged as paged_ir  # noqa: E402
from record import save  # noqa: E402
from bench_decode import bench, first_call  # noqa: E402
from timing import add_tflops, backend_times  # noqa: E402


def _chunk_mask(Sq: int, S: int, device) -> torch.Tensor:
    return torch.ones(Sq, S, dtype=torch.bool, device=device).tril(S - Sq)


def paged_chunk(q, k_pages, v_pages, block_table):
    """The spec: gather the sequence's pages, then causal attention of the chunk's queries (the last Sq
    positions) over every key."""
    B, H, Sq, D = q.shape
    k = k_pages[block_table].permute(0, 2, 1, 3, 4).flatten(2, 3)
    v = v_pages[block_table].permute(0, 2, 1, 3, 4).flatten(2, 3)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_chunk_mask(Sq, k.shape[2], q.device), enable_gqa=True)


def contiguous_chunk(q, k, v):
    Sq, S = q.shape[2], k.shape[2]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_chunk_mask(Sq, S, q.device), enable_gqa=True)


def _sdpa(backend: str, q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right
    b = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    with sdpa_kernel([b]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[2], k.shape[2]))


def run(B: int, Sq: int, Skv: int, P: int, H: int = 32, Hkv: int = 8, D: int = 128) -> dict:
    dev, dt = "cuda", torch.bfloat16
    per = Skv // P
    n = B * per + 7
    q = torch.randn(B, H, Sq, D, device=dev, dtype=dt)
    kp, vp = (torch.randn(n, Hkv, P, D, device=dev, dtype=dt) for _ in range(2))
    table = torch.randperm(n, device=dev)[:B * per].reshape(B, per)
    pairs = B * H * sum(Skv - Sq + i + 1 for i in range(Sq))
    flops = 4 * pairs * D
    row = {"B": B, "H": H, "Hkv": Hkv, "Sq": Sq, "Skv": Skv, "D": D, "page": P, "flops": flops}
    f, out, first = first_call(paged_chunk, q, kp, vp, table)
    row.update(first)
    ref = paged_chunk(q.float(), kp.float(), vp.float(), table)  # fp64 on the CPU takes minutes here (tests do it)
    row["rel_err_vs_fp32"] = float((out.float() - ref).norm() / ref.norm())
    del ref
    row["ours_ms"] = bench(lambda: f(q, kp, vp, table))
    # the same spec with the pages gathered by the prologue: paged reads turned off for this build
    keep = paged_ir.paged_operands
    paged_ir.paged_operands = lambda *a, **k: None
    try:
        g = tc.compile(paged_chunk, fallback="raise")
        g(q, kp, vp, table)
        assert not g.kernels()[-1].low.paged
        row["gathered_ms"] = bench(lambda: g(q, kp, vp, table))
    finally:
        paged_ir.paged_operands = keep
    k, v = (x[table].permute(0, 2, 1, 3, 4).flatten(2, 3).contiguous() for x in (kp, vp))
    c = tc.compile(contiguous_chunk, fallback="raise")
    c(q, k, v)
    row["contiguous_ms"] = bench(lambda: c(q, k, v))
    row["spec_ms"] = bench(lambda: paged_chunk(q, kp, vp, table))
    kr, vr = (x.repeat_interleave(H // Hkv, dim=1) for x in (k, v))  # SDPA's lower-right bias takes no GQA
    backend_times(row, ("flash", "cudnn"), lambda be: bench(lambda: _sdpa(be, q, kr, vr)))
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        off = Skv - Sq
        bm = create_block_mask(lambda b, h, i, j: i + off >= j, None, None, Sq, Skv, device=dev)
        flex = torch.compile(flex_attention)
        flex(q, k, v, block_mask=bm, enable_gqa=True)
        row["flex_ms"] = bench(lambda: flex(q, k, v, block_mask=bm, enable_gqa=True))
    except Exception as e:
        row["flex_ms"] = None
        row["flex_error"] = str(e)[:200]
    add_tflops(row, flops)
    row["paged_over_contiguous"] = row["contiguous_ms"] / row["ours_ms"]
    row["paged_over_gathered"] = row["gathered_ms"] / row["ours_ms"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="4x512x8192,4x512x32768,1x2048x32768", help="BxSqxSkv,...")
    ap.add_argument("--pages", default="16,256")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    warnings.filterwarnings("ignore")
    print(torch.cuda.get_device_name(), flush=True)
    rows = []
    for spec in a.rows.split(","):
        B, Sq, Skv = map(int, spec.split("x"))
        for P in map(int, a.pages.split(",")):
            rows.append(run(B, Sq, Skv, P))
            print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in rows[-1].items()
                              if not k.endswith("_error")}), flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    save(a.out, "bench_paged_prefill", {"rows": rows})
    print("\nB  Sq    Skv    page kernel      ours TF/s  /contig  /gathered  /flash  /cudnn  /flex  fp32")
    for r in rows:
        ratio = lambda k: f"{r[k] / r['ours_ms']:6.2f}" if r.get(k) else "   n/a"  # noqa: E731
        print(f"{r['B']:<2d} {r['Sq']:<5d} {r['Skv']:<6d} {r['page']:<4d} {r['kernel']:11s} {r['ours_tflops']:9.1f}  "
              f"{r['paged_over_contiguous']:7.3f}  {r['paged_over_gathered']:9.2f}  {ratio('sdpa_flash_ms')}  "
              f"{ratio('sdpa_cudnn_ms')}  {ratio('flex_ms')}  {r['rel_err_vs_fp32']:.1e}")


if __name__ == "__main__":
    main()
