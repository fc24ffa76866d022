"""Training tokens per second of an 8-layer llama through the transformers drop-in, against SDPA's cuDNN and
flash backends on the same weights.

One model (llama-8B-like layers: hidden 4096, 32 query heads, 8 KV heads, head dim 128, random weights,
bf16, dropout 0), one training step = forward over B x S tokens, cross-entropy on the shifted ids, backward
into every parameter (no optimiser: its cost is the same for every attention). The implementation is switched
by model.set_attn_implementation between steps, so every row times the same weights. Per implementation: the
median of --steps timed steps after two warm-up steps, tokens/s = B * S / that, and the step's peak memory
above the weights. Our row also counts who served each attention call (the kernel, or the spec) and each
backward (the kernel, or the reference); the loss of each implementation is recorded to show they agree.

Usage: python benchmarks/bench_train_model.py [--rows 1x4096,2x4096] [--steps 5] [--out DIR]
Writes bench_train_model.json to DIR or $OUT (record.py).
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch_cubridge.integrations.transformers as tcx  # noqa: E402
from record import save  # noqa: E402

IMPLS = ("sdpa_cudnn", "sdpa_flash", tcx.NAME)


def model_8_layers(vocab: int = 32000):
    from transformers import AutoModelForCausalLM, LlamaConfig
    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                      num_hidden_layers=8, vocab_size=vocab, max_position_embeddings=40960, pad_token_id=0,
                      bos_token_id=None, eos_token_id=None, attention_dropout=0.0)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.bfloat16)
    return model.train()


def step(model, ids: torch.Tensor) -> float:
    """One forward and backward of the causal-LM loss; the loss."""
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return float(loss.detach())


def run(model, impl: str, ids: torch.Tensor, steps: int) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = {"sdpa_cudnn": [SDPBackend.CUDNN_ATTENTION], "sdpa_flash": [SDPBackend.FLASH_ATTENTION]}.get(impl)
    model.set_attn_implementation("sdpa" if backend else impl)
    times, losses = [], []
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for i in range(steps + 2):
        t0 = time.perf_counter()
        if backend:
            with sdpa_kernel(backend):
                losses.append(step(model, ids))
        else:
            losses.append(step(model, ids))
        torch.cuda.synchronize()
        if i >= 2:  # the first builds and verifies our kernels, or warms the backends
            times.append(time.perf_counter() - t0)
    ms = 1e3 * statistics.median(times)
    return {"ms": ms, "tokens_per_s": ids.numel() / (ms / 1e3), "loss": losses[-1],
            "peak_gb": (torch.cuda.max_memory_allocated() - base) / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1x4096,2x4096")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    tcx.register()
    model = model_8_layers()
    g = torch.Generator(device="cuda").manual_seed(1)
    rows = []
    for spec in a.rows.split(","):
        B, S = (int(x) for x in spec.split("x"))
        ids = torch.randint(1, 32000, (B, S), device="cuda", generator=g)
        row: dict = {"B": B, "S": S}
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for impl in IMPLS:
                try:
                    row[impl] = run(model, impl, ids, a.steps)
                except Exception as e:  # noqa: BLE001  (a backend that does not take this shape)
                    row[impl] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        from torch_cubridge.ops.backward_runner import _RUNNERS
        row["forward_served"] = dict(sum((t.served for t in tcx.tables()), collections.Counter()))
        row["backward_served"] = dict(sum((r.served for r in _RUNNERS.values()), collections.Counter()))
        row["warnings"] = sorted({str(w.message)[:160] for w in seen if "torch_cubridge" in str(w.message)})[:5]
        ours = row[tcx.NAME].get("tokens_per_s")
        for impl in IMPLS[:2]:
            theirs = row[impl].get("tokens_per_s")
            if ours and theirs:
                row[f"ours_over_{impl}"] = ours / theirs
        rows.append(row)
        print(f"B {B} S {S}: " + "  ".join(f"{i} {row[i].get('tokens_per_s', 0):9.0f} tok/s" for i in IMPLS)
              + f"  fwd {row['forward_served']} bwd {row['backward_served']}", flush=True)
    print(save(a.out, "bench_train_model", {"model": "llama 8 layers, hidden 4096, 32/8 heads, D 128",
                                             "rows": rows}))


if __name__ == "__main__":
    main()
