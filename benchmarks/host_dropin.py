"""Host time of one attention call through the transformers drop-in, piece by piece, against SDPA's.

A decode step at batch 1 is bound by the host: this times the attention function alone (a LlamaAttention
module of llama-8B's shape, bf16, Sq 1 against a 4k cache), calls back to back timed on the host without
a sync (per_call_us), so a call's time is its host time even where the GPU takes longer. Then the pieces
of our path: the dispatch key, the table lookup with its guards, the runner (launch included: the Python
runner, and its serve, which launches decode calls through the C Decoder); with
--profile, the runner's steps one at a time and a cProfile of the drop-in.

Usage: python benchmarks/host_dropin.py [--out DIR] [--profile] [--against OTHER_CHECKOUT]
(writes host_dropin.json)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch_cubridge.integrations.transformers as tcx  # noqa: E402
from torch_cubridge.capture.signature import call_signature  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import best_host_us  # noqa: E402


per_call_us = best_host_us  # host time per call, the best of rounds (timing.py)


def runner_steps(runner, q, k, v, runner_args: tuple) -> dict:
    """The runner's per-call steps one at a time (the launch with blocks packed once)."""
    from torch_cubridge.ops.fastpath import canon
    from torch_cubridge.ops.pack import pack_fwd_raw
    perms = runner.plan.perms
    (B, H, Sq, D), qs = canon(q, perms[0])
    steps = {
        "step_canon3": lambda: (canon(q, perms[0]), canon(k, perms[1]), canon(v, perms[2])),
        "step_get_device": lambda: (q.get_device(), k.get_device(), v.get_device()),
        "step_stream": lambda: torch._C._cuda_getCurrentRawStream(0),
        "step_capturing": lambda: torch.cuda.is_current_stream_capturing(),
        "step_grad_enabled": lambda: torch.is_grad_enabled(),
        "step_data_ptr4": lambda: (q.data_ptr(), k.data_ptr(), v.data_ptr(), q.data_ptr()),
        "step_pack_fwd": lambda: pack_fwd_raw((1, 2, 3, 4, 0), qs[:3], qs[:3], qs[:3], qs[:3], (1, 2, 3, 4, 5), 0.5),
    }
    seen = []
    real = runner.kernel.launch
    runner.kernel.launch = lambda grid, blocks, stream: seen.append((grid, blocks, stream)) or real(grid, blocks, stream)
    try:
        runner(runner_args[0], q, k, v, None, **runner_args[1])
    finally:
        del runner.kernel.launch  # the instance attribute shadowed the method
    grid, blocks, stream = seen[-1]
    steps["step_launch"] = lambda: real(grid, blocks, stream)  # rewrites the same output: harmless
    return {name: per_call_us(fn) for name, fn in steps.items()}


def profile(fn, n: int = 3000) -> None:
    import cProfile
    import pstats
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    pstats.Stats(pr).sort_stats("tottime").print_stats(28)


def load_other(root: str):
    """The drop-in module of another copy of the package (root/torch_cubridge), imported under another
    name so that both run in this process: host timings move between processes and machines by 30%."""
    import importlib
    import importlib.util
    pkg = Path(root).resolve() / "torch_cubridge"
    spec = importlib.util.spec_from_file_location("cubridge_other", pkg / "__init__.py",
                                                  submodule_search_locations=[str(pkg)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["cubridge_other"] = mod
    spec.loader.exec_module(mod)
    return importlib.import_module("cubridge_other.integrations.transformers")


def interleaved(fns: dict, rounds: int = 7) -> dict:
    """Each function's best per_call_us over rounds that take the functions in turn."""
    best = {name: float("inf") for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            best[name] = min(best[name], per_call_us(fn, rounds=5))
    return best


def main() -> None:
    from transformers import LlamaConfig
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.llama.modeling_llama import LlamaAttention
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--profile", action="store_true", help="also cProfile the drop-in and time the runner's steps")
    ap.add_argument("--against", metavar="DIR", help="also time DIR/torch_cubridge's drop-in, in turns with ours")
    a = ap.parse_args()
    warnings.filterwarnings("ignore")
    print(torch.cuda.get_device_name(), flush=True)
    tcx.register()
    cfg = LlamaConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128)
    module = LlamaAttention(cfg, layer_idx=0).to("cuda", torch.bfloat16).eval()
    q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 8, a.ctx, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    kw = dict(dropout=0.0, scaling=module.scaling, position_ids=torch.tensor([[a.ctx]], device="cuda"))
    row: dict = {"ctx": a.ctx}
    with torch.no_grad():
        tcx.cubridge_attention_forward(module, q, k, v, None, **kw)  # builds and verifies the kernel
        from torch_cubridge.ops import hotpath
        row["host_module"] = hotpath.wait(120) is not None  # built on a helper thread: its launch serves
        (c,) = tcx.tables(module)
        assert c.served["kernel"] == 1, [e.reasons for e in c.entries()]
        args = (module, q, k, v, None)
        key = call_signature(args, kw)
        e = c._find(key, args, kw)
        runner = e.runners[e.kernel_for(args, kw)]
        row["sdpa_us"] = per_call_us(lambda: sdpa_attention_forward(module, q, k, v, None, **kw))
        row["dropin_us"] = per_call_us(lambda: tcx.cubridge_attention_forward(module, q, k, v, None, **kw))
        row["compiled_us"] = per_call_us(lambda: c(*args, **kw))
        row["signature_us"] = per_call_us(lambda: call_signature(args, kw))
        row["find_us"] = per_call_us(lambda: c._find(key, args, kw))
        row["runner_us"] = per_call_us(lambda: runner(*args, **kw))  # the Python runner
        row["runner_serve_us"] = per_call_us(lambda: runner.serve(args, kw))  # the C Decoder where it takes the call
        row["decoder_hits"] = getattr(runner, "decoder_hits", 0)
        row["empty_us"] = per_call_us(lambda: q.new_empty((1, 32, 1, 128)))
        # the same calls launching through ctypes/cuda-python instead of the host module's launch
        import torch_cubridge.ops.launch as L
        c_launch, host_launch = L._c_launch, L._host_launch
        L._c_launch, L._host_launch = None, lambda: None
        try:
            row["dropin_us_python_launch"] = per_call_us(lambda: tcx.cubridge_attention_forward(module, q, k, v, None, **kw))
            row["runner_us_python_launch"] = per_call_us(lambda: runner(*args, **kw))
        finally:
            L._c_launch, L._host_launch = c_launch, host_launch
        row["dropin_us_again"] = per_call_us(lambda: tcx.cubridge_attention_forward(module, q, k, v, None, **kw))
        if a.against:
            other = load_other(a.against)
            other.cubridge_attention_forward(module, q, k, v, None, **kw)
            (oc,) = other.tables(module)
            assert oc.served["kernel"] == 1, [e.reasons for e in oc.entries()]
            ab = interleaved({"sdpa": lambda: sdpa_attention_forward(module, q, k, v, None, **kw),
                              "ours": lambda: tcx.cubridge_attention_forward(module, q, k, v, None, **kw),
                              "other": lambda: other.cubridge_attention_forward(module, q, k, v, None, **kw)})
            row.update({f"ab_{n}_us": t for n, t in ab.items()})
        if a.profile:
            row.update(runner_steps(runner, q, k, v, (module, kw)))
            profile(lambda: tcx.cubridge_attention_forward(module, q, k, v, None, **kw))
    print(json.dumps(row), flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "host_dropin.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), **row}, indent=1))
    for k_, v_ in row.items():
        print(f"{k_:>14}: {v_:.1f}" if isinstance(v_, float) else f"{k_:>14}: {v_}")


if __name__ == "__main__":
    main()
