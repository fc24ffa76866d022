"""Where the drop-in's host time goes in decode (--first: in the first generate of a process): cProfile over generate's decode steps of a 2-layer
llama (llama-8B-like layers) with every call served by the kernel; prints the top entries."""
import collections
import cProfile
import pstats
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_generate as bg  # noqa: E402
import torch_cubridge.integrations.transformers as tcx  # noqa: E402


def _profiled(what: str, run) -> pstats.Stats:
    pr = cProfile.Profile()
    t0 = time.perf_counter()
    pr.enable()
    run()
    pr.disable()
    print(what, time.perf_counter() - t0)
    return pstats.Stats(pr)


def main() -> None:
    warnings.filterwarnings("ignore")
    tcx.register()
    model = bg.model_8_layers()
    ids = torch.randint(1, 32000, (1, 4096)).cuda()
    if "--first" in sys.argv:  # the first generate of a process: capture, transfer, verification, builds
        model.set_attn_implementation(tcx.NAME)
        st = _profiled("first generate", lambda: bg._generate(model, ids, 2))
        st.sort_stats("cumulative").print_stats("torch_cubridge", 45)
        st.sort_stats("tottime").print_stats(15)
        return
    for impl in ("sdpa", tcx.NAME):
        model.set_attn_implementation(impl)
        bg._generate(model, ids, 3)
        t = [min(bg._timed(model, ids, n) for _ in range(3)) for n in (1, 33)]
        print(impl, f"per decode step {(t[1] - t[0]) / 32 * 1e3:.2f} ms", flush=True)
    # every synchronising CUDA call of a decode step, by where in the drop-in it is made
    seen: collections.Counter = collections.Counter()

    def show(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "torch_cubridge" in f.filename or "transformers" in f.filename]
        seen[" <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in frames[-4:])] += 1
    old = warnings.showwarning
    warnings.showwarning = show
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")
    bg._generate(model, ids, 5)
    torch.cuda.set_sync_debug_mode(0)
    warnings.showwarning = old
    warnings.filterwarnings("ignore")
    for where, n in seen.most_common(12):
        print(f"sync x{n}: {where}")
    st = _profiled("profiled", lambda: bg._generate(model, ids, 33))
    st.sort_stats("tottime").print_stats(25)
    st.sort_stats("cumulative").print_stats("torch_cubridge", 30)


if __name__ == "__main__":
    main()
