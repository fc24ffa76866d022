"""Quick device check of the kernel a Hopper GPU gets: a few variants against float64, then
full/causal throughput against SDPA (flash, cuDNN). Usage: python benchmarks/sm90_smoke.py [--no-bench]"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]
import torch_cubridge as tc  # noqa: E402
from helpers import first, rel_err, to64  # noqa: E402
from zoo import CASES  # noqa: E402

print(torch.cuda.get_device_name(), torch.__version__, flush=True)
# --tile D:BN:STAGES (repeatable) tries another Hopper tile for a head dim
for i, a in enumerate(sys.argv):
    if a == "--tile":
        from torch_cubridge.lower import tiles
        d, bn, st = map(int, sys.argv[i + 1].split(":"))
        tiles.TILES_SM90[d] = tiles.Tile(d, 128, bn, 12, st, "sm90")
        print("tile", tiles.TILES_SM90[d], flush=True)
QUICK = "--quick" in sys.argv
NAMES = ["full_matmul", "causal_sdpa", "causal_where_finfo", "sliding_window", "softcap_causal", "alibi_tensor",
         "gqa_expand", "gqa_tile_repeat", "document_causal", "sinks_column", "causal_bottom_right",
         "empty_rows_finite_fill", "prefix_lm_tensor", "full_bshd"]
rows = []
for D in (64, 128, 256):
    for name in (NAMES[:6] if QUICK else NAMES):
        c = next(c for c in CASES if c.name == name)
        # (4, 16, 700): 384 tiles, several per CTA of the persistent grid
        for (B, H, S) in (((2, 4, 333), (4, 16, 700)) if QUICK else ((2, 4, 333), (1, 4, 77), (1, 4, 1100), (4, 16, 700))):
            f = tc.compile(c.fn, fallback="raise")
            args = c.make(B, H, 2 if H == 4 else 4, S, D, torch.bfloat16)
            cu = tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)
            t0 = time.perf_counter()
            try:
                out = first(f(*cu))
                torch.cuda.synchronize()
                err = rel_err(out.float().cpu(), first(c.fn(*to64(args))))
                kind = f.kernels()[-1].low.tile.kernel
            except Exception as e:  # report and go on
                err, kind = float("nan"), f"ERROR {type(e).__name__}: {str(e)[:200]}"
            rows.append((name, D, B, S, kind, err, time.perf_counter() - t0))
            print(f"{name:24s} D={D:3d} B={B} S={S:5d} {kind:6s} err={err:.2e} {rows[-1][-1]:.2f}s", flush=True)

if "--no-bench" not in sys.argv:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench
    from variants import SPECS
    for D in (128, 64):
        for name, causal in (("full", False), ("causal", True)):
            S, H = 4096, 16
            B = 32768 // S
            q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            f = tc.compile(SPECS[name], fallback="raise")
            f(q, k, v)
            flops = 4 * B * H * S * S * D * (0.5 if causal else 1.0)
            res = {}
            res["ours"] = do_bench(lambda: f(q, k, v), warmup=25, rep=100, return_mode="median")
            for be, tag in ((SDPBackend.FLASH_ATTENTION, "flash"), (SDPBackend.CUDNN_ATTENTION, "cudnn")):
                with sdpa_kernel([be]):
                    res[tag] = do_bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                                        warmup=25, rep=100, return_mode="median")
            print(f"{name:7s} D={D:3d} " + "  ".join(f"{t}={flops / ms / 1e9:6.1f}TF/s" for t, ms in res.items()),
                  flush=True)
bad = [r for r in rows if not (r[5] < 1e-2)]
print(f"SUMMARY {len(rows) - len(bad)}/{len(rows)} within 1e-2; kernels: "
      f"{sorted(set(r[4] for r in rows if not r[4].startswith('ERROR')))}")
for r in bad:
    print("BAD", r)
