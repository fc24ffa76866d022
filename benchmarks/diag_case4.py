"""Diagnostic: a data-mask kernel (built without verification) on structured mask case 4 (-1e9, whole rows)."""
import sys

import torch

sys.path.insert(0, "tests")
import torch_cubridge as tc  # noqa: E402
from torch_cubridge.lower import lower  # noqa: E402
from torch_cubridge.ops.kernel import load_kernel  # noqa: E402
from torch_cubridge.ops.runner import KernelRunner  # noqa: E402
from torch_cubridge.verify.inputs import structured_mask  # noqa: E402
from test_numerics import additive_mask_attention, window_mask  # noqa: E402

S = 512
args = tuple(torch.randn(1, 2, S, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
p = tc.transfer(additive_mask_attention, *[a.float().cpu() for a in args], window_mask(S, 40, -1e9).to(torch.bfloat16))
low = lower(p, "sm_90", "bfloat16", 64)
kern, info, pre = load_kernel(low, "sm_90")
r = KernelRunner(p, low, kern, 64, info, pre)
for pat in range(6):
    mk = structured_mask(torch.zeros(1, 1, S, S, dtype=torch.bfloat16), 2, 3, pat).cuda()
    with torch.no_grad():
        out = r(*args, mk).float().cpu()
    ref = additive_mask_attention(*[a.double().cpu() for a in args], mk.double().cpu())
    bad = ~torch.isfinite(out)
    rows = bad.any(-1)[0, 0].nonzero().flatten().tolist()
    err = float(((out - ref).nan_to_num() ).norm() / ref.norm())
    print(f"pattern {pat}: nonfinite {int(bad.sum())} rows {rows[:6]} err(finite part) {err:.2e}"
          f" row0 out {out[0, 0, 0, :3].tolist()} ref {ref[0, 0, 0, :3].tolist()}")
