"""Tokens per second of an 8-layer llama's `generate` through the transformers drop-in, against SDPA.

One model (llama-8B-like layers: hidden 4096, 32 query heads, 8 KV heads, head dim 128, random weights,
bf16), switched between attn_implementation "sdpa" and "cubridge" (one set of weights). Per row: the
prefill's time (generate of one token) and decode tokens/s = B * N / (time of 1 + N tokens - time of
1 token), the default dynamic cache, best of --rounds rounds with the two implementations interleaved. Every attention call of the timed cubridge runs is counted: the
kernel must serve them all. The prefill's logits of the two are compared.

Usage: python benchmarks/bench_generate.py [--rows 1x4096,8x4096,1x32768,8x32768] [--new 64] [--out DIR]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch_cubridge.integrations.transformers as tcx  # noqa: E402


def model_8_layers(vocab: int = 32000):
    from transformers import AutoModelForCausalLM, LlamaConfig
    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                      num_hidden_layers=8, vocab_size=vocab, max_position_embeddings=40960, pad_token_id=0,
                      bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.bfloat16)
    return model.eval()


def _generate(model, ids: torch.Tensor, n: int):
    from transformers import GenerationConfig
    gc = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc, output_logits=True,
                             return_dict_in_generate=True)
    torch.cuda.synchronize()
    return out


def _timed(model, ids: torch.Tensor, n: int) -> float:
    t0 = time.perf_counter()
    _generate(model, ids, n)
    return time.perf_counter() - t0


def run(model, impl: str, B: int, ctx: int, new: int) -> dict:
    model.set_attn_implementation(impl)
    ids = torch.randint(1, model.config.vocab_size, (B, ctx), generator=torch.Generator().manual_seed(B + ctx)).cuda()
    t0 = time.perf_counter()
    first = _generate(model, ids, 2)  # ours: captures, verifies and builds the prefill and decode kernels
    row = {"impl": impl, "B": B, "ctx": ctx, "new": new, "first_generate_s": time.perf_counter() - t0}
    before = _served()
    _time_round(model, row, ids)
    row["served"] = dict(_served() - before)
    row["prefill_logits"] = first.logits[0].float()
    row["ids"] = ids
    return row


def _time_round(model, row: dict, ids: torch.Tensor) -> None:
    """One timing round of `row`'s implementation: its best prefill and decode rate so far."""
    model.set_attn_implementation(row["impl"])
    t1 = min(_timed(model, ids, 1) for _ in range(2))
    tn = min(_timed(model, ids, row["new"] + 1) for _ in range(2))
    row["prefill_s"] = min(row.get("prefill_s", t1), t1)
    rate = row["B"] * row["new"] / (tn - t1)
    row["decode_tokens_per_s"] = max(row.get("decode_tokens_per_s", rate), rate)
    row.setdefault("decode_tokens_per_s_rounds", []).append(rate)


def _served() -> collections.Counter:
    return sum((c.served for c in tcx.tables()), start=collections.Counter())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1x4096,8x4096,1x32768,8x32768")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="timing rounds per row, the implementations interleaved")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    warnings.filterwarnings("ignore")
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    tcx.register()
    model = model_8_layers()
    rows = []
    for spec in a.rows.split(","):
        B, ctx = (int(x) for x in spec.split("x"))
        pair = []
        for impl in ("sdpa", tcx.NAME):
            try:
                pair.append(run(model, impl, B, ctx, a.new))
            except torch.OutOfMemoryError as e:
                pair.append({"impl": impl, "B": B, "ctx": ctx, "error": f"out of memory: {str(e)[:120]}"})
            torch.cuda.empty_cache()
        for _ in range(a.rounds - 1):  # interleaved: a host-bound step drifts by more than the difference
            for r in pair:
                if "ids" in r:
                    _time_round(model, r, r["ids"])
        if all("prefill_logits" in r for r in pair):
            ref, ours = (r["prefill_logits"] for r in pair)
            pair[1]["prefill_logits_rel_err"] = float((ours - ref).norm() / ref.norm())
        for r in pair:
            r.pop("prefill_logits", None)
            r.pop("ids", None)
            print(json.dumps(r), flush=True)
        rows += pair
        Path(a.out).mkdir(parents=True, exist_ok=True)  # after every row: a call cut short keeps the rest
        (Path(a.out) / "generate.json").write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                                               "torch": torch.__version__, "rows": rows}, indent=1))
    print(f"{'B':>2} {'ctx':>6} {'impl':>8} {'prefill s':>9} {'decode tok/s':>12} {'ours/sdpa':>9}")
    by = {(r["B"], r["ctx"], r["impl"]): r for r in rows}
    for r in rows:
        base = by.get((r["B"], r["ctx"], "sdpa"), {})
        ratio = r.get("decode_tokens_per_s", 0) / base["decode_tokens_per_s"] if "decode_tokens_per_s" in base else 0
        print(f"{r['B']:2d} {r['ctx']:6d} {r['impl']:>8} {r.get('prefill_s', 0):9.3f} "
              f"{r.get('decode_tokens_per_s', 0):12.1f} {ratio:9.3f}")


if __name__ == "__main__":
    main()
