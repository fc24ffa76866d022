"""Cold first calls of new variants, each process starting with an empty disk cache (issue 8: <= 3 s).

A child process compiles three variants in turn and times each one's first call (capture, transfer,
guards, CPU verification, NVRTC build, GPU verification, the kernel's run): the first of a process also
pays torch's tracing imports, the later ones show what a new variant costs a running process.
With --against DIR the same children run from another checkout, alternating with ours, so both
are timed on one machine in one session.

With --bytecode the children may write Python bytecode (under a cache prefix in /tmp), as any
installed Python does: the device machine sets PYTHONDONTWRITEBYTECODE=1, so each of its processes
compiled ~950 of torch's modules from source (2.4 s of a 5.5 s first call). One
child runs first to write the bytecode and is not counted.

Usage: python benchmarks/cold_start.py [--out DIR] [--against OTHER_CHECKOUT] [--rounds N] [--bytecode]
(writes cold_start.json)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from record import save  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("causal", "softcap_causal", "sliding_1024")
CHILD = r"""
import json, sys, time, torch
sys.path[:0] = [{root!r}, {bench!r}]
torch.zeros(1, device="cuda")
t0 = time.perf_counter()
import torch_cubridge as tc
import_s = time.perf_counter() - t0
from variants import SPECS
q, k, v = (torch.randn(4, 16, 4096, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
rows = []
for name in {variants!r}:
    f = tc.compile(SPECS[name])
    t0 = time.perf_counter()
    f(q, k, v)
    torch.cuda.synchronize()
    rows.append({{"variant": name, "first_call_s": time.perf_counter() - t0, "kernel": f.served["kernel"]}})
print(json.dumps({{"import_s": import_s, "calls": rows}}))
"""


PYCACHE = "/tmp/cubridge-cold-start-pycache"


def child_env(cache: str, bytecode: bool) -> dict:
    """A child's environment: its own disk cache; with bytecode, Python's bytecode under PYCACHE."""
    env = dict(os.environ, CUBRIDGE_CACHE_DIR=cache)
    if bytecode:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = PYCACHE
    return env


def child(root: Path, bytecode: bool = False) -> dict:
    code = CHILD.format(root=str(root), bench=str(ROOT / "benchmarks"), variants=VARIANTS)
    with tempfile.TemporaryDirectory() as cache:
        env = child_env(cache, bytecode)
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=400)
    if r.returncode:
        return {"error": r.stderr[-1500:]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--against", metavar="DIR")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--bytecode", action="store_true", help="children write and read bytecode (see above)")
    a = ap.parse_args()
    import torch
    print(torch.cuda.get_device_name(), flush=True)
    roots = {"ours": ROOT} | ({"other": Path(a.against).resolve()} if a.against else {})
    runs: dict[str, list] = {n: [] for n in roots}
    if a.bytecode:  # writes the bytecode of everything a first call imports; not counted
        for root in roots.values():
            child(root, True)
    for _ in range(a.rounds):
        for name, root in roots.items():
            runs[name].append(child(root, a.bytecode))
            print(name, json.dumps(runs[name][-1]), flush=True)
    save(a.out, "cold_start", {"variants": VARIANTS, "bytecode": a.bytecode, "runs": runs})
    print(f"{'':8}" + "".join(f"{v:>16}" for v in VARIANTS))
    for name, rs in runs.items():
        ok = [r for r in rs if "calls" in r]
        if ok:
            best = [min(r["calls"][i]["first_call_s"] for r in ok) for i in range(len(VARIANTS))]
            print(f"{name:8}" + "".join(f"{b:>15.2f}s" for b in best))


if __name__ == "__main__":
    main()
