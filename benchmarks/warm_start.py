"""Warm start and per-call host time of compiled functions (issue 8), on the GPU.

warm start: a new process compiles a variant with an empty disk cache (cold), then another new
process with that cache (warm); each prints its first call's seconds (capture, transfer, both
verifications and the build where they run; the kernel load) and whether a kernel served.
host time: microseconds per call of a compiled function, N calls back to back with one clock
around them, against SDPA on the same inputs, at a tiny prefill and at a decode shape.

With --dropin, also the transformers drop-in's first generate in new processes (SDPA's; ours cold and warm).

Usage: python benchmarks/warm_start.py [--out DIR] [--host-only] [--bytecode] [--dropin]; writes warm_start.json
there.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from record import save  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CHILD = r"""
import json, sys, time, torch
sys.path[:0] = [{root!r}, {bench!r}]
torch.zeros(1, device="cuda")
import torch_cubridge as tc
from variants import SPECS
name, S = sys.argv[1], int(sys.argv[2])
q, k, v = (torch.randn(4, 16, S, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
f = tc.compile(SPECS[name])
t0 = time.perf_counter()
f(q, k, v)
torch.cuda.synchronize()
dt = time.perf_counter() - t0
print(json.dumps({{"first_call_s": dt, "kernel": f.served["kernel"], "spec": f.served["spec"]}}))
"""


DROPIN_CHILD = r"""
import collections, json, sys, time, torch
sys.path[:0] = [{root!r}]
torch.zeros(1, device="cuda")
import torch_cubridge.integrations.transformers as tcx
from transformers import AutoModelForCausalLM, LlamaConfig
impl = sys.argv[1]
tcx.register()
cfg = LlamaConfig(hidden_size=1024, intermediate_size=2048, num_attention_heads=8, num_key_value_heads=2,
                  num_hidden_layers=8, vocab_size=1000, pad_token_id=0, bos_token_id=None, eos_token_id=None)
torch.manual_seed(0)
with torch.device("cuda"):
    m = AutoModelForCausalLM.from_config(cfg, attn_implementation=impl, dtype=torch.bfloat16).eval()
ids = torch.randint(1, 1000, (1, 512), generator=torch.Generator().manual_seed(0)).cuda()
t0 = time.perf_counter()
with torch.no_grad():
    out = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, min_new_tokens=4, do_sample=False)
torch.cuda.synchronize()
dt = time.perf_counter() - t0
served = sum((c.served for c in tcx.tables()), start=collections.Counter())
print(json.dumps({{"first_generate_s": dt, "kernel": served["kernel"], "spec": served["spec"],
                  "tokens": out[0, -4:].tolist()}}))
"""


def dropin_first_generate(cache: str, bytecode: bool = False) -> dict:
    """The first generate of a new process through the transformers drop-in (an 8-layer llama, head dim 128,
    bf16, 512 tokens then 4 new): SDPA's, ours with an empty cache (cold), ours with that cache (warm), each
    twice."""
    from cold_start import child_env
    code = DROPIN_CHILD.format(root=str(ROOT))
    env = child_env(cache, bytecode)
    # SDPA's first child pays what any first process does (cold page cache, bytecode): its second is the figure
    return {run: _child(code, [impl], env) for run, impl in (("sdpa", "sdpa"), ("cold", "cubridge"),
                                                             ("warm", "cubridge"), ("sdpa2", "sdpa"),
                                                             ("warm2", "cubridge"))}


def _child(code: str, argv: list[str], env: dict) -> dict:
    """One new process running `code`: the JSON of its last line and its whole time, or its error."""
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", code, *argv], env=env, capture_output=True, text=True, timeout=300)
    if r.returncode:
        return {"error": r.stderr[-400:]}
    return json.loads(r.stdout.strip().splitlines()[-1]) | {"process_s": time.perf_counter() - t0}


def warm_start(name: str, S: int, cache: str, bytecode: bool = False) -> dict:
    from cold_start import child_env
    code = CHILD.format(root=str(ROOT), bench=str(ROOT / "benchmarks"))
    env = child_env(cache, bytecode)
    return {run: _child(code, [name, str(S)], env) for run in ("cold", "warm")}


def host_times() -> list[dict]:
    """Ours with the host fast path (ops/hotpath.py), ours with the Python path only (CUBRIDGE_HOTPATH=0
    while that function serves its calls), SDPA: one process, same inputs."""
    import torch
    import torch.nn.functional as F
    sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
    import torch_cubridge as tc
    from torch_cubridge.ops import hotpath
    from timing import best_host_us as per_call_us
    from variants import SPECS
    rows = []
    for label, (B, H, Hkv, Sq, Skv, D) in (("prefill B1 H1 S16 D64", (1, 1, 1, 16, 16, 64)),
                                            ("decode B1 H32:8 Sq1 Skv4096 D128", (1, 32, 8, 1, 4096, 128))):
        q = torch.randn(B, H, Sq, D, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(B, Hkv, Skv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        name = "causal" if Sq == Skv else "full"
        spec = SPECS[name]
        kk, vv = (x.repeat_interleave(H // Hkv, 1) for x in (k, v))
        f = tc.compile(spec, fallback="raise")
        f(q, kk, vv)
        hotpath.wait(120)
        ours = per_call_us(lambda: f(q, kk, vv))
        # pieces of the fast path: the C module's serve alone, and the output allocation inside it
        serve, recs, args = f._serve, f._hot, (q, kk, vv)
        pieces = {"serve_us": per_call_us(lambda: serve(recs, args)) if serve else None,
                  "new_empty_us": per_call_us(lambda: q.new_empty(q.shape)),
                  "is_compiling_us": per_call_us(torch.compiler.is_compiling),
                  "stream_us": per_call_us(lambda: torch._C._cuda_getCurrentRawStream(0))}
        os.environ["CUBRIDGE_HOTPATH"] = "0"
        try:
            g = tc.compile(spec, fallback="raise")
            g(q, kk, vv)
            python_path = per_call_us(lambda: g(q, kk, vv))
        finally:
            del os.environ["CUBRIDGE_HOTPATH"]
        sdpa = per_call_us(lambda: F.scaled_dot_product_attention(q, kk, vv, is_causal=Sq == Skv))
        ok = float((f(q, kk, vv).double() - spec(q.double(), kk.double(), vv.double())).norm()
                   / spec(q.double(), kk.double(), vv.double()).norm())
        rows.append({"shape": label, "ours_us": ours, "python_path_us": python_path, "sdpa_us": sdpa,
                     "served_kernel": f.served["kernel"] > 0 and f.served["spec"] == 0,
                     "replayed": sum(r.hits for r in f._hot), "rel_err_fp64": ok,
                     "hotpath_failure": hotpath.failure} | pieces)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--host-only", action="store_true", help="per-call host time only, no warm-start processes")
    ap.add_argument("--bytecode", action="store_true",
                    help="children write and read Python bytecode, as an installed Python does (cold_start.py); "
                         "a first, uncounted pair of children writes it")
    ap.add_argument("--dropin", action="store_true", help="also the drop-in's first generate in new processes")
    a = ap.parse_args()
    out_dir = Path(a.out)
    import torch
    print(torch.cuda.get_device_name(), flush=True)
    res = {"device": torch.cuda.get_device_name(), "warm_start": {}, "host": []}
    res["bytecode"] = a.bytecode
    if a.bytecode and not a.host_only:
        with tempfile.TemporaryDirectory() as cache:
            warm_start("causal", 4096, cache, True)
    with tempfile.TemporaryDirectory() as cache:
        for name in () if a.host_only else ("causal", "softcap_causal"):
            res["warm_start"][name] = warm_start(name, 4096, cache, a.bytecode)
        if a.dropin and not a.host_only:
            with tempfile.TemporaryDirectory() as dcache:
                res["dropin_first_generate"] = dropin_first_generate(dcache, a.bytecode)
    res["host"] = host_times()
    save(out_dir, "warm_start", res)
    print(f"{'variant':16s} {'cold s':>8s} {'warm s':>8s} {'warm process s':>15s}")
    for name, r in res["warm_start"].items():
        c, w = r.get("cold", {}), r.get("warm", {})
        print(f"{name:16s} {c.get('first_call_s', float('nan')):8.3f} {w.get('first_call_s', float('nan')):8.3f} "
              f"{w.get('process_s', float('nan')):15.2f}  kernel={w.get('kernel')}")
    for run, r in res.get("dropin_first_generate", {}).items():
        print(f"drop-in first generate, {run:5s}: {r.get('first_generate_s', float('nan')):6.3f} s "
              f"(process {r.get('process_s', float('nan')):5.1f} s) kernel={r.get('kernel')} spec={r.get('spec')} "
              f"tokens={r.get('tokens')}")
    for r in res["host"]:
        print(f"{r['shape']:34s} ours {r['ours_us']:7.1f} us (Python path {r['python_path_us']:6.1f})  "
              f"SDPA {r['sdpa_us']:7.1f} us  kernel={r['served_kernel']} replayed={r['replayed']} "
              f"rel={r['rel_err_fp64']:.1e}")
        print("   pieces (us): " + ", ".join(f"{k[:-3]} {r[k]:.2f}" for k in r if k.endswith("_us") and r[k] is not None
                                            and k not in ("ours_us", "python_path_us", "sdpa_us")))


if __name__ == "__main__":
    main()
