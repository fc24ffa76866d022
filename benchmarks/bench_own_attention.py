"""Models whose attention code is their own, with each attention module routed through its compiled
forward (integrations/own_attention.py), against the same model running its own code: a forward of
the whole model (use_cache=False), bf16, on the GPU. Also the first call (capture, transfer, fp64
verification, build, GPU verification) per model.

Usage: python benchmarks/bench_own_attention.py [--out DIR] [--families git,xglm,...] [--seq 2048]
       PROFILE=1 ...: also a cProfile of one routed call (Python time the CUDA profiler does not show)
       --generate N: instead, greedy generate of N tokens after a --seq prompt through a DynamicCache
       (the cached route), ours against the model's own code: decode tokens/s from the time of N tokens
       less the time of one (the prefill), the median of three rounds alternating the two
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import time
import warnings
from typing import Iterator

import torch

from record import save


def build(family: str, hidden: int, heads: int, layers: int) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM
    kw = dict(vocab_size=1024, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
              num_attention_heads=heads, max_position_embeddings=8192, pad_token_id=None, bos_token_id=None,
              eos_token_id=None)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **kw), attn_implementation="eager").eval()


def models(a: argparse.Namespace) -> Iterator[tuple[str, torch.nn.Module, torch.nn.Module, torch.Tensor]]:
    """Per family: (name, the model running its own code, a copy routed through its compiled forwards, prompt
    ids), bf16 on the GPU; emptied from the allocator before the next family (the caller drops its references
    first). A family this config does not fit is skipped."""
    from torch_cubridge.integrations import own_attention as oa
    for fam in a.families.split(","):
        try:
            eager = build(fam, a.hidden, a.heads, a.layers).to("cuda", torch.bfloat16)
        except Exception as e:  # noqa: BLE001  (a family this config does not fit)
            print(f"{fam}: does not build ({type(e).__name__}: {str(e)[:80]})", flush=True)
            continue
        ours = copy.deepcopy(eager)
        oa.serve_own_attention(ours)
        oa._compiled.clear()
        oa._compiled_cached.clear()
        ids = torch.randint(0, 1024, (a.batch, a.seq), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
        yield fam, eager, ours, ids
        eager = ours = None  # freed before the next family
        torch.cuda.empty_cache()


def write_rows(rows: list[dict], out: str | None, name: str) -> None:
    if out:
        save(out, name, {"rows": rows})


def generate_rates(model: torch.nn.Module, ids: torch.Tensor, n: int) -> tuple[float, float]:
    """(prefill seconds, decode tokens/s) of greedy generate: n tokens against one."""
    def run(k: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=k, min_new_tokens=k, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t0
    one, many = run(1), run(n)
    return one, ids.shape[0] * (n - 1) / (many - one)


def generate_main(a: argparse.Namespace) -> None:
    from torch_cubridge.integrations import own_attention as oa
    rows = []
    for fam, eager, ours, ids in models(a):
        with torch.no_grad():
            t0 = time.perf_counter()
            ours.generate(ids, max_new_tokens=a.generate, do_sample=False, pad_token_id=0)  # first: compiles
            first = time.perf_counter() - t0
            eager.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
            res = {"ours": [], "eager": []}
            for _ in range(3):
                res["ours"].append(generate_rates(ours, ids, a.generate))
                res["eager"].append(generate_rates(eager, ids, a.generate))
        med = {k: sorted(v, key=lambda r: r[1])[1] for k, v in res.items()}
        served = {k: sum(c.served[k] for c in oa._compiled_cached.values()) for k in ("kernel", "spec")}
        row = dict(family=fam, B=a.batch, prompt=a.seq, new_tokens=a.generate, hidden=a.hidden, heads=a.heads,
                   layers=a.layers, first_generate_s=first, ours_prefill_s=med["ours"][0],
                   eager_prefill_s=med["eager"][0], ours_decode_tok_s=med["ours"][1],
                   eager_decode_tok_s=med["eager"][1], decode_ratio=med["ours"][1] / med["eager"][1],
                   cached_calls_served=served, rounds=res)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "rounds"}), flush=True)
        eager = ours = None  # the loop's references too, before models() builds the next family
    write_rows(rows, a.out, "bench_own_attention_generate")
    print(f"{'family':18s} {'B':>3s} {'ours tok/s':>10s} {'own tok/s':>10s} {'x':>6s} {'prefill s ours/own':>20s} served")
    for r in rows:
        print(f"{r['family']:18s} {r['B']:3d} {r['ours_decode_tok_s']:10.1f} {r['eager_decode_tok_s']:10.1f} "
              f"{r['decode_ratio']:6.2f} {r['ours_prefill_s']:9.3f}/{r['eager_prefill_s']:.3f} {r['cached_calls_served']}")


def main() -> None:
    from torch_cubridge.benchmark import median_ms
    from torch_cubridge.integrations import own_attention as oa
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--families", default="git,megatron-bert,openai-gpt,xglm,falcon,mpt,trocr,roformer,big_bird,rembert,bloom,cpmant,"
                                             "gpt_neox_japanese")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--generate", type=int, default=0)
    a = ap.parse_args()
    warnings.simplefilter("ignore")
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    if a.generate:
        generate_main(a)
        return
    rows = []
    for fam, eager, ours, ids in models(a):
        with torch.no_grad():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            got = ours(ids, use_cache=False).logits
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
            ref = eager(ids, use_cache=False).logits
            served = {k: sum(c.served[k] for c in oa.tables()) for k in ("kernel", "spec")}
            t_ours = median_ms(lambda: ours(ids, use_cache=False), 10)
            t_eager = median_ms(lambda: eager(ids, use_cache=False), 10)
            # every timed call too: a call that re-captured (a guard failing each call) shows here
            served_all = {k: sum(c.served[k] for c in oa.tables()) for k in ("kernel", "spec")}
            if os.environ.get("PROFILE"):
                import cProfile
                import pstats
                pr = cProfile.Profile()
                pr.enable()
                ours(ids, use_cache=False)
                torch.cuda.synchronize()
                pr.disable()
                pstats.Stats(pr).sort_stats("tottime").print_stats(12)
            entries = sum(len(c.entries()) for c in oa.tables())
        rel = float((got.float() - ref.float()).norm() / ref.float().norm())
        row = dict(family=fam, B=a.batch, S=a.seq, hidden=a.hidden, heads=a.heads, layers=a.layers, first_call_s=first,
                   ours_ms=t_ours, eager_ms=t_eager, speedup=t_eager / t_ours, rel_vs_eager_bf16=rel, served=served,
                   served_incl_timed=served_all, entries=entries)
        rows.append(row)
        print(json.dumps(row), flush=True)
        eager = ours = None  # the loop's references too, before models() builds the next family
    write_rows(rows, a.out, "bench_own_attention")
    print(f"{'family':14s} {'ours ms':>8s} {'eager ms':>8s} {'x':>6s} {'first s':>7s} served")
    for r in rows:
        print(f"{r['family']:14s} {r['ours_ms']:8.2f} {r['eager_ms']:8.2f} {r['speedup']:6.2f} {r['first_call_s']:7.1f} "
              f"{r['served']}")


if __name__ == "__main__":
    main()
