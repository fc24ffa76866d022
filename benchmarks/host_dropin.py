"""Host time of one attention call through the transformers drop-in, piece by piece, against SDPA's.

A decode step at batch 1 is bound by the host: this times the attention function alone (a LlamaAttention
module of llama-8B's shape, bf16, Sq 1 against a 4k cache), calls back to back with one sync at the end,
so a call's time is its host time wherever the host is slower than the GPU. Then the pieces of our path:
the dispatch key, the table lookup with its guards, the runner (launch included).

Usage: python benchmarks/host_dropin.py [--out DIR]   (writes host_dropin.json)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch_cubridge.integrations.transformers as tcx  # noqa: E402
from torch_cubridge.capture.signature import call_signature  # noqa: E402


def per_call_us(fn, n: int = 3000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best


def main() -> None:
    from transformers import LlamaConfig
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.llama.modeling_llama import LlamaAttention
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--ctx", type=int, default=4096)
    a = ap.parse_args()
    warnings.filterwarnings("ignore")
    print(torch.cuda.get_device_name(), flush=True)
    tcx.register()
    cfg = LlamaConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128)
    module = LlamaAttention(cfg, layer_idx=0).to("cuda", torch.bfloat16).eval()
    q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 8, a.ctx, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    kw = dict(dropout=0.0, scaling=module.scaling, position_ids=torch.tensor([[a.ctx]], device="cuda"))
    row: dict = {"ctx": a.ctx}
    with torch.no_grad():
        tcx.cubridge_attention_forward(module, q, k, v, None, **kw)  # builds and verifies the kernel
        (c,) = tcx.tables(module)
        assert c.served["kernel"] == 1, [e.reasons for e in c.entries()]
        args = (module, q, k, v, None)
        key = call_signature(args, kw)
        e = c._find(key, args, kw)
        runner = e.runners[e.kernel_for(args, kw)]
        row["sdpa_us"] = per_call_us(lambda: sdpa_attention_forward(module, q, k, v, None, **kw))
        row["dropin_us"] = per_call_us(lambda: tcx.cubridge_attention_forward(module, q, k, v, None, **kw))
        row["compiled_us"] = per_call_us(lambda: c(*args, **kw))
        row["signature_us"] = per_call_us(lambda: call_signature(args, kw))
        row["find_us"] = per_call_us(lambda: c._find(key, args, kw))
        row["runner_us"] = per_call_us(lambda: runner(*args, **kw))
        row["empty_us"] = per_call_us(lambda: q.new_empty((1, 32, 1, 128)))
    print(json.dumps(row), flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "host_dropin.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), **row}, indent=1))
    for k_, v_ in row.items():
        print(f"{k_:>14}: {v_:.1f}" if isinstance(v_, float) else f"{k_:>14}: {v_}")


if __name__ == "__main__":
    main()
