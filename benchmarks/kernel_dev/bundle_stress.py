"""GPU dev script: the flash-API bundle served read-only in fresh processes (tests/cache/test_bundle_gpu.py),
many times and several at once, each run's tokens against a plain eager model's, to catch a mismatch that shows
under load only (once seen: the last prompt of a continuous batch wrong from its first token, the other three
right). One bundle is built; then ROUNDS rounds of PARALLEL serving processes, with BUSY processes spinning on
the CPU beside them. Prints every mismatch with the run's served counts and reasons; exits 1 on any.

Run on the device machine, repo root: python benchmarks/kernel_dev/bundle_stress.py [ROUNDS PARALLEL BUSY]
"""
from __future__ import annotations

import json
import multiprocessing as mp
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "support"))
from paths import SEARCH  # noqa: E402

sys.path[:0] = [str(p) for p in SEARCH]
import torch  # noqa: E402

import test_bundle_gpu as tb  # noqa: E402
from test_continuous_batching_gpu import KW, _clear_steps, prompts  # noqa: E402
from tiny_models import build  # noqa: E402


def _spin(stop_at: float) -> None:
    while time.time() < stop_at:
        sum(i * i for i in range(10000))


def main() -> int:
    rounds, parallel, busy = (int(x) for x in (sys.argv[1:4] if len(sys.argv) >= 4 else (5, 4, 8)))
    tmp = Path(tempfile.mkdtemp(prefix="bundle-stress-"))
    with torch.no_grad():
        ref = build("llama", "eager", torch.bfloat16, "cuda", **KW)
        bundle = tb._build_bundle(tmp)
        want = {}
        for p in prompts():
            toks = ref.generate(torch.tensor([p], device="cuda"), max_new_tokens=12, do_sample=False,
                                pad_token_id=0)[0, len(p):].tolist()
            want[json.dumps(p)] = (toks, _clear_steps(ref, p, toks))
    spinners = [mp.Process(target=_spin, args=(time.time() + 3600,), daemon=True) for _ in range(busy)]
    for s in spinners:
        s.start()
    bad = 0
    try:
        for r in range(rounds):
            dirs = [tmp / f"r{r}-{i}" for i in range(parallel)]
            for d in dirs:
                d.mkdir()
            with ThreadPoolExecutor(parallel) as ex:
                runs = list(ex.map(lambda d: tb._serve(bundle, d, ref), dirs))
            for i, got in enumerate(runs):
                for key, (toks, n) in want.items():
                    if got["batched"][key][:n] != toks[:n]:
                        bad += 1
                        print(f"round {r} run {i}: prompt of {len(json.loads(key))} tokens: "
                              f"{got['batched'][key]} against {toks} ({n} clear)\n  served {got['served']}\n"
                              f"  reasons {got['reasons'][:5]}", flush=True)
            print(f"round {r}: {parallel} runs, {bad} mismatches so far", flush=True)
    finally:
        for s in spinners:
            s.terminate()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
