"""The flash API's block-table decode (integrations/flash_api.py: what transformers' continuous batching calls
per layer and step under "cubridge_flash3") against SDPA (flash, cuDNN) and FlexAttention over the same keys
contiguous, in one run: with the append of the new token, without it (the kernel alone), and replayed from a
CUDA graph as continuous batching replays it. Pages [N, P, Hkv, D] as transformers lays them out; 32:8 heads,
D 128, bf16.
Usage (device): python3 benchmarks/bench_flash_api.py --out $OUT"""
from __future__ import annotations

import argparse
import json
import os
import warnings

import torch

import torch_cubridge.integrations.flash_api as tfa
from record import save
from bench_decode import flex_call, sdpa
from timing import graph_replay, interleaved_ms


def run(B: int, Skv: int, P: int, H: int = 32, Hkv: int = 8, D: int = 128, fill: float = 1.0,
        window: int = 0) -> dict:
    """`fill`: the share of the table's Skv keys each sequence holds (continuous batching's tables are wider than
    its sequences); `window`: each query sees its last `window` keys (0: all). SDPA reads the keys seen only,
    and TB/s counts those."""
    dev, dt = "cuda", torch.bfloat16
    live = max(1, int(Skv * fill))
    per = Skv // P
    N = B * per + 7
    kc, vc = (torch.randn(N, P, Hkv, D, device=dev, dtype=dt) for _ in range(2))
    table = torch.randperm(N, device=dev)[: B * per].view(B, per).int()
    at = torch.full((B,), live - 1, dtype=torch.int32, device=dev)  # the new token is the last live key
    q = torch.randn(B, 1, H, D, device=dev, dtype=dt)
    kn, vn = (torch.randn(B, 1, Hkv, D, device=dev, dtype=dt) for _ in range(2))
    scale = D ** -0.5
    win = (window - 1, 0) if window else (-1, -1)
    seen = min(live, window) if window else live

    def ours():
        return tfa.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=at, block_table=table,
                                           softmax_scale=scale, causal=True, window_size=win)

    def kernel_only():  # the keys already hold the new token
        return tfa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=at + 1, block_table=table,
                                           softmax_scale=scale, causal=True, window_size=win)
    out = ours()
    ref = tfa.paged_decode_attention(q.double(), kc.double(), vc.double(), table, at + 1, scale, win[0], 0.0, None)
    row = {"B": B, "Skv": Skv, "live": live, "window": window, "page": P, "H": H, "Hkv": Hkv, "D": D,
           "rel_err_vs_fp64": float((out.double() - ref).norm() / ref.norm())}
    kernel_only()
    replay = graph_replay(ours)
    qh = q.transpose(1, 2)
    k, v = (c[table.long()].reshape(B, -1, Hkv, D)[:, live - seen:live].transpose(1, 2).contiguous() for c in (kc, vc))
    fns = {"ours": ours, "kernel_only": kernel_only, "ours_graph": replay}
    fns.update({f"sdpa_{be}": (lambda be=be: sdpa(be, qh, k, v)) for be in ("flash", "cudnn")})
    flex = flex_call(qh, k, v)
    if isinstance(flex, str):
        row["flex_error"] = flex
    else:
        fns["flex"] = flex
    times, errors = interleaved_ms(fns)
    row.update({f"{n}_ms": ms for n, ms in times.items()}, errors=errors)
    row["served"] = {n: dict(c.served) for n, c in tfa.compiled().items() if c.served}
    nbytes = 2 * (2 * B * Hkv * seen * D + 2 * B * H * D)
    for n, ms in times.items():
        if ms:
            row[f"{n}_tbs"] = nbytes / (ms * 1e-3) / 1e12
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--rows", default="1x4096,8x4096,1x32768,8x32768")
    ap.add_argument("--pages", default="16,256")
    ap.add_argument("--fill", type=float, default=1.0, help="share of the table's keys each sequence holds")
    ap.add_argument("--window", type=int, default=0, help="sliding window: keys each query sees (0: all)")
    a = ap.parse_args()
    warnings.filterwarnings("ignore")
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    rows = []
    for P in map(int, a.pages.split(",")):
        for spec in a.rows.split(","):
            B, Skv = map(int, spec.split("x"))
            rows.append(run(B, Skv, P, fill=a.fill, window=a.window))
            print(json.dumps(rows[-1]), flush=True)
    save(a.out, "bench_flash_api", {"rows": rows})
    print(f"{'B':>2} {'Skv':>6} {'P':>4} {'ours':>6} {'kernel':>6} {'graph':>6} {'flash':>6} {'cudnn':>6} "
          f"{'flex':>6} {'graph/flash':>11} {'graph/flex':>10}  (TB/s)")
    for r in rows:
        g = lambda k: r.get(k) or float("nan")  # noqa: E731
        print(f"{r['B']:2d} {r['Skv']:6d} {r['page']:4d} {g('ours_tbs'):6.2f} {g('kernel_only_tbs'):6.2f} "
              f"{g('ours_graph_tbs'):6.2f} {g('sdpa_flash_tbs'):6.2f} {g('sdpa_cudnn_tbs'):6.2f} {g('flex_tbs'):6.2f} "
              f"{g('sdpa_flash_ms') / g('ours_graph_ms'):11.2f} {g('flex_ms') / g('ours_graph_ms'):10.2f}")


if __name__ == "__main__":
    main()
