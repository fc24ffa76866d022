"""Plot a bench.json: TFLOP/s per variant for ours, FlexAttention and SDPA.

Usage: python benchmarks/plot.py benchmarks/results/h200_bench_<commit>.json [out.png]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    src = Path(sys.argv[1])
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else src.with_suffix(".png")
    rep = json.loads(src.read_text())
    rows = rep["results"]
    groups = sorted({(r["S"], r["D"]) for r in rows}, key=lambda x: (x[1], x[0]))
    fig, axes = plt.subplots(len(groups), 1, figsize=(11, 3.2 * len(groups)), squeeze=False)
    for ax, (S, D) in zip(axes[:, 0], groups):
        rs = [r for r in rows if r["S"] == S and r["D"] == D]
        names = [r["variant"] for r in rs]
        x = range(len(rs))
        for i, (key, label) in enumerate((("ours_tflops", "torch_cubridge"), ("flex_tflops", "FlexAttention"),
                                          ("sdpa_flash_tflops", "SDPA flash"), ("sdpa_cudnn_tflops", "SDPA cuDNN"))):
            ax.bar([j + i * 0.2 for j in x], [r.get(key) or 0 for r in rs], width=0.2, label=label)
        ax.set_xticks([j + 0.3 for j in x])
        ax.set_xticklabels(names, rotation=20, fontsize=8)
        ax.set_ylabel("TFLOP/s (unmasked pairs)")
        ax.set_title(f"{rep['device']}, bf16, S={S}, D={D}, H=16, B*S=32k")
        ax.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    print(out)


if __name__ == "__main__":
    main()
