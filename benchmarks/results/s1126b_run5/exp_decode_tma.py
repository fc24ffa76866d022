"""A/B: the decode kernel's copies by the copy engine (CUBRIDGE_DECODE_TMA=1) against its 16-byte copies."""
import json, os, sys, warnings
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch_cubridge as tc
from bench_decode import bench, gqa_decode, paged_gqa_decode, sdpa
warnings.filterwarnings("ignore")
print(torch.cuda.get_device_name(), flush=True)
out = []
dev, dt = "cuda", torch.bfloat16
for B, Skv in (((8, 4096), (8, 32768), (1, 32768)) if 'paged' not in sys.argv else ()):
    q = torch.randn(B, 32, 1, 128, device=dev, dtype=dt)
    k, v = (torch.randn(B, 8, Skv, 128, device=dev, dtype=dt) for _ in range(2))
    nbytes = 2 * (2 * B * 8 * Skv * 128 + 2 * B * 32 * 128)
    ref = gqa_decode(q.double(), k.double(), v.double())
    row = {"B": B, "Skv": Skv, "flash_tbs": nbytes / bench(lambda: sdpa("flash", q, k, v)) / 1e9}
    f = tc.compile(gqa_decode, fallback="raise")
    for rnd in range(2):
        for tma in ("0", "1"):
            os.environ["CUBRIDGE_DECODE_TMA"] = tma
            o = f(q, k, v)
            row[f"err{tma}"] = float((o.double() - ref).norm() / ref.norm())
            row[f"tbs{tma}_{rnd}"] = nbytes / bench(lambda: f(q, k, v)) / 1e9
    out.append(row); print(json.dumps(row), flush=True)
for Skv in (4096, 32768):
    for P in (16, 256):
        B, H, Hkv, D = 8, 32, 8, 128
        per = Skv // P; n = B * per + 7
        q = torch.randn(B, H, 1, D, device=dev, dtype=dt)
        kp, vp = (torch.randn(n, Hkv, P, D, device=dev, dtype=dt) for _ in range(2))
        table = torch.randperm(n, device=dev)[:B * per].reshape(B, per)
        nbytes = 2 * (2 * B * Hkv * Skv * D + 2 * B * H * D)
        ref = paged_gqa_decode(q.double(), kp.double(), vp.double(), table)
        f = tc.compile(paged_gqa_decode, fallback="raise")
        row = {"B": B, "Skv": Skv, "page": P}
        for rnd in range(3):
            for tma in ("0", "1"):
                os.environ["CUBRIDGE_DECODE_TMA"] = tma
                o = f(q, kp, vp, table)
                row[f"err{tma}"] = float((o.double() - ref).norm() / ref.norm())
                row[f"tbs{tma}_{rnd}"] = nbytes / bench(lambda: f(q, kp, vp, table)) / 1e9
        os.environ["CUBRIDGE_DECODE_TMA"] = "0"
        k, v = (t[table].permute(0, 2, 1, 3, 4).flatten(2, 3).contiguous() for t in (kp, vp))
        g = tc.compile(gqa_decode, fallback="raise")
        g(q, k, v)
        row["contiguous_tbs"] = nbytes / bench(lambda: g(q, k, v)) / 1e9
        out.append(row); print(json.dumps(row), flush=True)
Path(os.environ.get("OUT", ".")).joinpath("decode_tma_ab.json").write_text(json.dumps(out, indent=1))
