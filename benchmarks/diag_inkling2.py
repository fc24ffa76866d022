"""inkling2 through the drop-in on the GPU: each attention module's output against an eager model's, in
bf16, both from configs of their own (a diagnosis of test_a_sink_projected_from_each_token_served_by_kernel).
Usage: python benchmarks/diag_inkling2.py [--spec-only] [--bf16-ref] [--cpu]"""
from __future__ import annotations

import collections
import sys
import warnings
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "tests")]
import torch  # noqa: E402

import torch_cubridge.integrations.transformers as tcx  # noqa: E402
from torch_cubridge import pipeline  # noqa: E402


def main() -> None:
    from test_transformers_models import _inkling2_pair
    if "--spec-only" in sys.argv:
        pipeline._build_and_verify = lambda fn, res, bound: (None, "diagnosis: the spec serves")
    tcx.register()
    tcx.clear_tables()
    dev = "cpu" if "--cpu" in sys.argv else "cuda"
    models = _inkling2_pair(dev, torch.bfloat16)
    ours = models[1]
    if "--bf16-ref" in sys.argv:  # eager in bf16 (built as ours is)
        from transformers import AutoConfig, AutoModelForCausalLM
        torch.manual_seed(0)
        ref = AutoModelForCausalLM.from_config(type(ours.config).from_dict(ours.config.to_diff_dict()),
                                               attn_implementation="eager", dtype=torch.bfloat16).to(dev).eval()
    else:
        ref = models[0]
    outs: dict[str, list] = collections.defaultdict(list)
    for tag, m in (("ref", ref), ("ours", ours)):
        for name, mod in m.named_modules():
            if type(mod).__name__.endswith("Attention"):
                mod.register_forward_hook(lambda mod, a, out, name=name, tag=tag: outs[name].append(
                    (tag, (out[0] if isinstance(out, tuple) else out).detach().float().cpu())))
    ids = torch.randint(0, 128, (2, 200), generator=torch.Generator().manual_seed(0)).to(dev)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want, got = ref(ids).logits.float(), ours(ids).logits.float()
    print("logits rel", float((got - want).norm() / want.norm()))
    for name, pair in outs.items():
        if len(pair) == 2:
            (_, a), (_, b) = pair
            print(f"{name:45} rel {float((b - a).norm() / a.norm().clamp_min(1e-30)):.3e}")
    for c in tcx.tables():
        for e in c.entries():
            print("entry", dict(c.served), "row_scale", e.result is not None and e.result.program.row_scale is not None,
                  {k: (r or "")[:90] for k, r in e.reasons.items()})


if __name__ == "__main__":
    main()
