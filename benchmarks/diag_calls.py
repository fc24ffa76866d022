"""Diagnostic: every attention call of a tiny model, the kernel's answer against the fp64 spec on the same inputs.

Usage (device): python benchmarks/diag_calls.py
"""
import sys
import warnings

import torch

sys.path.insert(0, "tests")
import torch_cubridge as tc  # noqa: E402
import torch_cubridge.integrations.transformers as tcx  # noqa: E402
from helpers import rel_err  # noqa: E402
from tiny_models import inputs, pair, step_logits  # noqa: E402
from test_numerics import additive_mask_attention, window_mask  # noqa: E402
from torch_cubridge.verify.inputs import structured_mask  # noqa: E402

warnings.simplefilter("ignore")
print(torch.cuda.get_device_name())
tcx.register()
calls = []
real_call = tc.compile.__globals__["CompiledAttention"].__call__


def spy(self, *args, **kwargs):
    before = self.served["kernel"]
    out = real_call(self, *args, **kwargs)
    if self.served["kernel"] > before:
      try:
        ref = self.fn(*[a.double().cpu() if isinstance(a, torch.Tensor) else (__import__("copy").deepcopy(a).double().cpu() if isinstance(a, torch.nn.Module) else a) for a in args],
                      **{k: (v.double().cpu() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()})
        o, r = (out[0] if isinstance(out, tuple) else out), (ref[0] if isinstance(ref, tuple) else ref)
        q, k, m = args[1], args[2], args[4]
        err = rel_err(o.float().cpu(), r)
        rows = (o.float().cpu() - r).abs().amax(dim=(-1, -2))  # by (b, s) for [b, s, h, d]
        print(f"call q{tuple(q.shape)} k{tuple(k.shape)} kstride{k.stride()} mask{tuple(m.shape) if m is not None else None} "
              f"mstride{m.stride() if m is not None else None} err {err:.3e} worst(b,s) {divmod(int(rows.argmax()), rows.shape[1])}")
      except Exception as e:
        import traceback; traceback.print_exc()
    return out


tc.compile.__globals__["CompiledAttention"].__call__ = spy
ref, ours = pair("llama", torch.bfloat16, "cuda", head_dim=64, hidden_size=256, intermediate_size=256)
ids, mask = inputs(B=2, S=150, pad=37, device="cuda")
with torch.no_grad():
    w = step_logits(ref, ids, torch.ones_like(mask), steps=6)
    g = step_logits(ours, ids, torch.ones_like(mask), steps=6)
print("steps", [f"{float((a - b).norm() / b.norm()):.2e}" for a, b in zip(g, w)])

# mask case 4: -1e9 with whole rows masked
tc.compile.__globals__["CompiledAttention"].__call__ = real_call
from torch_cubridge.ops.runner import KernelRunner  # noqa: E402
f = tc.compile(additive_mask_attention, fallback="silent")
S = 512
args = tuple(torch.randn(1, 2, S, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
mk = structured_mask(torch.zeros(1, 1, S, S, dtype=torch.bfloat16), 2, 3, 4).cuda()
f(*args, window_mask(S, 40, -1e9).to("cuda", torch.bfloat16))
for r in f.kernels():
    out = r(*args, mk)
    refo = additive_mask_attention(*[a.double().cpu() for a in args], mk.double().cpu())
    bad = ~torch.isfinite(out.float().cpu())
    print("case4 kernel nonfinite", int(bad.sum()), "rows", bad.any(-1).nonzero()[:5].tolist(), "ref nonfinite", int((~torch.isfinite(refo)).sum()))
    print("row0 out", out[0, 0, 0, :4].tolist(), "ref", refo[0, 0, 0, :4].tolist())
