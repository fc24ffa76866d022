"""A/B of FA2-class prefill kernel builds that differ by preprocessor defines, in one process, against SDPA-flash
(CUBRIDGE_KERNEL=sm80 keeps a Hopper GPU on the FA2-class kernel). Causal GQA, B 4, 32:8 heads, bf16, head dims 64
and 128, 4k queries and keys; TFLOP/s over the unmasked pairs, do_bench medians in interleaved rounds, the best.

Usage: python benchmarks/ab_prefill_defines.py OUT.json "a:" "b:SOME_DEFINE=0" [--softcap]
(--softcap: the spec also soft-caps the scores at 30, a hook on every score). Run 4 of s1127j A/B'd the swizzled
K/V ring at 3529077 this way ("swz:" "padded:CUBRIDGE_FWD_SWZ=0"): padded was faster, NOTES v37."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

os.environ["CUBRIDGE_KERNEL"] = "sm80"
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from ab_decode_defines import build  # noqa: E402
from timing import interleaved_ms  # noqa: E402


def flash(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        return causal_gqa(q, k, v)


def causal_gqa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def softcap_causal_gqa(q, k, v):
    k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    s = 30 * torch.tanh(s / 30)
    n = q.shape[2]
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return s.softmax(-1) @ v


def main() -> None:
    out_path, labels = sys.argv[1], [x for x in sys.argv[2:] if not x.startswith("--")]
    specs = {"causal": causal_gqa} | ({"softcap": softcap_causal_gqa} if "--softcap" in sys.argv else {})
    print(torch.cuda.get_device_name(), flush=True)
    B, Hq, Hkv, S = 4, 32, 8, 4096
    rows = []
    for D in (64, 128):
        q = torch.randn(B, Hq, S, D, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(B, Hkv, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        flops = 4 * B * Hq * (S * (S + 1) // 2) * D  # the causal mask's unmasked pairs
        fns = {"flash": lambda: flash(q, k, v)}
        for sname, spec in specs.items():
            for lab in labels:
                name, _, dspec = lab.partition(":")
                defines = dict(d.split("=") for d in dspec.split(",") if d)
                try:
                    fns[f"{sname}_{name}"], err = build(defines, spec, q, k, v)
                except Exception as e:  # (a spec this kernel refuses: recorded, the others still run)
                    rows.append({"D": D, "impl": f"{sname}_{name}", "error": str(e)[:300]})
                    continue
                rows.append({"D": D, "impl": f"{sname}_{name}", "defines": defines, "rel_err_vs_fp64": err})
        ms, errors = interleaved_ms(fns, rounds=3)
        for name, t in ms.items():
            rows.append({"D": D, "impl": name, "ms": t, "tflops": flops / (t * 1e-3) / 1e12 if t else None,
                         "error": errors.get(name)})
    for r in rows:
        print(json.dumps(r), flush=True)
    Path(out_path).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
