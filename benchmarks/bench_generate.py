"""Tokens per second of an 8-layer llama's `generate` through the transformers drop-in, against SDPA.

One model (llama-8B-like layers: hidden 4096, 32 query heads, 8 KV heads, head dim 128, random weights,
bf16), switched between attn_implementation "sdpa" and "cubridge" (one set of weights). Per row: decode
tokens/s = B * N / (the time from the first token's logits to the last's), read by a logits processor that
stamps the clock after the prefill's logits and after the last step's, synchronising at both, so the N decode
steps are timed apart from the prefill (the rate of v28 and before, B * N / (time of 1 + N tokens - time of
1 token), took the difference of two generate calls, each with a 0.1-0.5 s prefill, and its rounds moved by
up to 40%). Best and median of --rounds rounds, the two implementations interleaved; the prefill's time is
the first stamp's. Each round also gives its median step time (every step is stamped; a hiccup of the host
moves a round's total and not its median step), and rounds i of the two ran back to back, so the ratio of
their median steps (SDPA's over ours: above 1, ours is faster) cancels some of the drift between rounds. The
figure that ranks the two is --alt-rounds': generates that alternate SDPA and ours every step over one cache
(`alternating`), where rounds of whole generates drift by 20-50% on a host-bound step. Every
attention call of the timed cubridge runs is counted: the kernel must serve them all. The prefill's logits of
the two are compared.

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
from record import save  # noqa: E402

IMPLS = ("sdpa", tcx.NAME)  # the two a generate compares, SDPA's first


def model_8_layers(vocab: int = 32000):
    from transformers import AutoModelForCausalLM, LlamaConfig
    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                      num_hidden_layers=8, vocab_size=vocab, max_position_embeddings=40960, pad_token_id=0,
                      bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.bfloat16)
    return model.eval()


class _Stamps:
    """A logits processor (it returns the scores as they are) that stamps the clock at every call: after the
    GPU has finished the logits at the first and n-th (synchronised there), and at the steps between without
    a sync of its own (generate synchronises once a step, on whether every sequence has finished, so the
    stamps are a step apart in wall time)."""

    def __init__(self, n: int):
        self.n, self.calls, self.t = n, 0, []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls in (1, self.n):
            torch.cuda.synchronize()
        self.t.append(time.perf_counter())
        return scores


def _generate(model, ids: torch.Tensor, n: int, stamps: _Stamps | None = None):
    from transformers import LogitsProcessorList
    return _generate_with(model, ids, n, LogitsProcessorList([stamps] if stamps is not None else []))


def _generate_with(model, ids: torch.Tensor, n: int, processors):
    from transformers import GenerationConfig
    gc = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc, output_logits=True,
                             return_dict_in_generate=True, logits_processor=processors)
    torch.cuda.synchronize()
    return out


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
    """One timing round of `row`'s implementation: its prefill's time and decode rate, best and median so far."""
    model.set_attn_implementation(row["impl"])
    stamps = _Stamps(row["new"] + 1)
    t0 = time.perf_counter()
    _generate(model, ids, row["new"] + 1, stamps)
    first, last = stamps.t[0], stamps.t[-1]
    steps = [b - a for a, b in zip(stamps.t, stamps.t[1:])]
    row.setdefault("prefill_s_rounds", []).append(first - t0)
    row.setdefault("decode_tokens_per_s_rounds", []).append(row["B"] * row["new"] / (last - first))
    # a step's median time: a hiccup of the host (a collection, another process) moves the round's total, not this
    row.setdefault("median_step_ms_rounds", []).append(1e3 * _median(steps))
    row["prefill_s"] = min(row["prefill_s_rounds"])
    row["decode_tokens_per_s"] = max(row["decode_tokens_per_s_rounds"])
    row["decode_tokens_per_s_median"] = _median(row["decode_tokens_per_s_rounds"])


class _Alternate:
    """A logits processor that switches the model between two attention implementations every step, and
    times each step under the one it ran: synchronised at every call, the switch made between two stamps,
    so a step's interval (the next token's sampling, the forward, its logits) holds no switch. Both read
    the one cache, so a host-bound step's drift, which moves whole rounds by 20-50%, moves both alike."""

    def __init__(self, model, impls: tuple[str, str], parity: int):
        self.model, self.impls, self.parity = model, impls, parity
        self.calls, self.cur, self.t0 = 0, None, 0.0
        self.steps: list[tuple[str, float]] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        torch.cuda.synchronize()
        now = time.perf_counter()
        if self.cur is not None:
            self.steps.append((self.cur, now - self.t0))
        self.calls += 1
        self.cur = self.impls[(self.calls + self.parity) % 2]
        self.model.set_attn_implementation(self.cur)
        self.t0 = time.perf_counter()
        return scores


def alternating_steps(model, ids: torch.Tensor, new: int, rounds: int, impls: tuple[str, str]
                      ) -> list[tuple[str, float]]:
    """(implementation, seconds) of every step of `rounds` generates alternating `impls`, the parity flipped
    each round (the prefill runs under the first step's other one)."""
    from transformers import LogitsProcessorList
    steps: list[tuple[str, float]] = []
    for r in range(rounds):
        alt = _Alternate(model, impls, r % 2)
        model.set_attn_implementation(impls[r % 2])
        _generate_with(model, ids, new + 1, LogitsProcessorList([alt]))
        steps += alt.steps
    return steps


def alternating(model, ids: torch.Tensor, new: int, rounds: int) -> dict:
    """Steps of one generate alternating between SDPA and ours, `rounds` generates (the parity flipped each
    round, so each implementation runs every cache length): each one's median step, and the median over
    neighbouring steps of SDPA's step time over ours (above 1: ours is faster)."""
    before = _served()
    steps = alternating_steps(model, ids, new, rounds, IMPLS)
    served = _served() - before
    pairs = [a[1] / b[1] if a[0] == "sdpa" else b[1] / a[1] for a, b in zip(steps, steps[1:]) if a[0] != b[0]]
    med = {i: _median([t for j, t in steps if j == i]) * 1e3 for i in IMPLS}
    return {"B": ids.shape[0], "ctx": ids.shape[1], "new": new, "rounds": rounds,
            "sdpa_median_step_ms": med["sdpa"], "ours_median_step_ms": med[tcx.NAME],
            "ours_over_sdpa_tokens_per_s": med["sdpa"] / med[tcx.NAME],
            "neighbour_ratio_median": _median(pairs), "neighbour_pairs": len(pairs),
            "ours_steps": sum(1 for j, _ in steps if j == tcx.NAME), "served": dict(served),
            # every attention call of ours: each of its decode steps, and the prefills of the odd rounds
            "ours_attention_calls": model.config.num_hidden_layers * (sum(1 for j, _ in steps if j == tcx.NAME)
                                                                      + rounds // 2)}


def _median(xs: list) -> float:
    return sorted(xs)[len(xs) // 2]


def _served() -> collections.Counter:
    return sum((c.served for c in tcx.tables()), start=collections.Counter())


def start():
    """Warnings off, the device printed, the drop-in registered; the 8-layer model (this and the diag_* scripts)."""
    warnings.filterwarnings("ignore")
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    tcx.register()
    return model_8_layers()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1x4096,8x4096,1x32768,8x32768")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5, help="timing rounds per row, the implementations interleaved")
    ap.add_argument("--alt-rounds", type=int, default=4, help="generates alternating the two every step, per row")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    model = start()
    rows, alts = [], []
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
        if all("median_step_ms_rounds" in r for r in pair):
            # round i of each ran back to back (interleaved): their ratio cancels the drift between rounds
            paired = sorted(a / b for a, b in zip(pair[0]["median_step_ms_rounds"], pair[1]["median_step_ms_rounds"]))
            pair[1]["paired_step_ratio_rounds"] = paired
            pair[1]["paired_step_ratio_median"] = _median(paired)
        if a.alt_rounds and all("ids" in r for r in pair):
            alts.append(alternating(model, pair[0]["ids"], a.new, a.alt_rounds))
            print(json.dumps(alts[-1]), flush=True)
        if all("prefill_logits" in r for r in pair):
            ref, ours = (r["prefill_logits"] for r in pair)
            pair[1]["prefill_logits_rel_err"] = float((ours - ref).norm() / ref.norm())
        for r in pair:
            r.pop("prefill_logits", None)
            r.pop("ids", None)
            print(json.dumps(r), flush=True)
        rows += pair
        save(a.out, "bench_generate", {"rows": rows, "alternating": alts})  # after every row: a call cut short keeps the rest
    print(f"{'B':>2} {'ctx':>6} {'impl':>8} {'prefill s':>9} {'best tok/s':>10} {'median':>8} {'ours/sdpa best':>14} "
          f"{'median':>6} {'step ms':>7} {'paired':>6}")
    by = {(r["B"], r["ctx"], r["impl"]): r for r in rows}
    for r in rows:
        base = by.get((r["B"], r["ctx"], "sdpa"), {})
        ratio = [r.get(k, 0) / base[k] if base.get(k) else 0 for k in ("decode_tokens_per_s", "decode_tokens_per_s_median")]
        print(f"{r['B']:2d} {r['ctx']:6d} {r['impl']:>8} {r.get('prefill_s', 0):9.3f} "
              f"{r.get('decode_tokens_per_s', 0):10.1f} {r.get('decode_tokens_per_s_median', 0):8.1f} {ratio[0]:14.3f} "
              f"{ratio[1]:6.3f} {_median(r.get('median_step_ms_rounds', [0])):7.3f} "
              f"{r.get('paired_step_ratio_median', 0):6.3f}")
    if alts:
        print("steps alternating in one generate (ours/sdpa: SDPA's median step over ours; neighbours: the median of "
              "neighbouring steps' ratios)")
        print(f"{'B':>2} {'ctx':>6} {'sdpa ms':>7} {'ours ms':>7} {'ours/sdpa':>9} {'neighbours':>10} {'served':>14}")
        for x in alts:
            print(f"{x['B']:2d} {x['ctx']:6d} {x['sdpa_median_step_ms']:7.3f} {x['ours_median_step_ms']:7.3f} "
                  f"{x['ours_over_sdpa_tokens_per_s']:9.3f} {x['neighbour_ratio_median']:10.3f} "
                  f"{x['served'].get('kernel', 0):>6}/{x['ours_attention_calls']:<7}")


if __name__ == "__main__":
    main()
