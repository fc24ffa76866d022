"""The README's performance table, rendered from the latest results (benchmarks/results/bench_attention.json,
bench_train.json and bench_decode.json), so the front page shows what the last device run measured and nothing else.

Usage: python benchmarks/readme_table.py            print the table
       python benchmarks/readme_table.py --write    replace the table between the README's markers
tests/pipeline/test_readme.py holds the README to this rendering.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
BEGIN, END = "<!-- performance table: benchmarks/readme_table.py -->", "<!-- end of performance table -->"
NAMES = {"full": "full", "causal": "causal", "sliding_1024": "sliding window 1024", "softcap_causal": "softcap 50, causal",
         "softcap_full": "softcap 50, full", "alibi_causal": "ALiBi, causal", "prefix_1024": "prefix-LM 1024",
         "document": "document ids", "gqa_causal": "GQA 4:1, causal",
         "relbias_causal": "learnable relative bias, causal"}


def _ratio(ours: float | None, other: float | None) -> str:
    return f"{ours / other:.2f}×" if ours and other else "–"


def _origin(res: dict) -> str:
    return f"{res['gpu']}, commit {res['commit']}, torch {res['torch']}"


def tflops_rows(res: dict, check: str, check_header: str, shape: tuple[int, int] | None = None) -> list[str]:
    """A TFLOP/s table (the forward's, or forward plus backward's): a row a variant, ratios against each peer,
    and the float64 verdict the result names `check`; with `shape` (S, D), that shape's rows only."""
    rows = ["| variant | S | D | ours TFLOP/s | vs cuDNN | vs SDPA-flash | vs FlexAttention | " + check_header + " |",
            "|---|---|---|---|---|---|---|---|"]
    for r in res["results"]:
        if shape is not None and (r["S"], r["D"]) != shape:
            continue
        ok = {True: "pass", False: "FAIL"}.get(r.get(check), "–")
        rows.append(f"| {NAMES.get(r['variant'], r['variant'])} | {r['S']} | {r['D']} | {r['ours_tflops']:.0f} | "
                    f"{_ratio(r['ours_tflops'], r.get('sdpa_cudnn_tflops'))} | "
                    f"{_ratio(r['ours_tflops'], r.get('sdpa_flash_tflops'))} | "
                    f"{_ratio(r['ours_tflops'], r.get('flex_tflops'))} | {ok} |")
    return rows


def decode_rows(res: dict) -> list[str]:
    rows = ["| batch | queries | KV length | ours TB/s | vs cuDNN | vs SDPA-flash | vs FlexAttention | error vs float64 |",
            "|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        rows.append(f"| {r['B']} | {r['Sq']} | {r['Skv']} | {r['ours_tbs']:.2f} | "
                    f"{_ratio(r['ours_tbs'], r.get('sdpa_cudnn_tbs'))} | {_ratio(r['ours_tbs'], r.get('sdpa_flash_tbs'))} | "
                    f"{_ratio(r['ours_tbs'], r.get('flex_tbs'))} | {r['rel_err_vs_fp64']:.1e} |")
    return rows


def render() -> str:
    fwd = json.loads((RESULTS / "bench_attention.json").read_text())
    dec = json.loads((RESULTS / "bench_decode.json").read_text())
    train = json.loads((RESULTS / "bench_train.json").read_text())
    lines = [BEGIN,
             "Forward, bf16, 16 heads, batch × length = 32k tokens; TFLOP/s over unmasked pairs, median of do_bench",
             f"({_origin(fwd)}, {fwd['date']}; `benchmarks/bench_attention.py`). A ratio above 1: ours is faster.",
             "", *tflops_rows(fwd, "matches_fp64", "float64 check"), "",
             "Forward plus backward, S 4096, D 128, TFLOP/s at 3.5× the forward's FLOPs",
             f"({_origin(train)}, {train['date']}; `benchmarks/bench_train.py`).",
             "", *tflops_rows(train, "grads_match_fp64", "gradients vs float64", (4096, 128)), "",
             "Decode, bf16, 32 query and 8 KV heads, D 128; bandwidth is K and V bytes read over time",
             f"({_origin(dec)}, {dec['date']}; `benchmarks/bench_decode.py`).",
             "", *decode_rows(dec), END]
    return "\n".join(lines)


def replace_in(text: str) -> str:
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return head + render() + tail


if __name__ == "__main__":
    if "--write" in sys.argv:
        readme = ROOT / "README.md"
        readme.write_text(replace_in(readme.read_text()))
    else:
        print(render())
