"""Diagnosis (GPU): the falcon own-attention call that faulted in device run 8, with launches blocking,
printing the program's operands and the call's shapes and strides before the kernel runs."""
import sys
import warnings

import torch

sys.path.insert(0, "tests")
from test_own_attention import tiny  # noqa: E402
import torch_cubridge.ops.runner as runner  # noqa: E402
from torch_cubridge.integrations import own_attention as oa  # noqa: E402

_execute = runner.KernelRunner._execute


def loud(self, q, k, v, *a, **kw):
    p = self.p
    print("q", p.q.dims, tuple(q.shape), q.stride(), "k", p.k.dims, tuple(k.shape), k.stride(),
          "v", p.v.dims, tuple(v.shape), v.stride(), "head_map", p.head_map, "requires", p.requires, flush=True)
    return _execute(self, q, k, v, *a, **kw)


runner.KernelRunner._execute = loud
warnings.simplefilter("ignore")
B = int(sys.argv[1]) if len(sys.argv) > 1 else 2
model = tiny("falcon").to("cuda", torch.bfloat16)
oa.serve_own_attention(model)
with torch.no_grad():
    out = model(torch.randint(0, 128, (B, 200), device="cuda"), use_cache=False).logits
    torch.cuda.synchronize()
print("ok", [dict(c.served) for c in oa.tables()], [e.reasons for c in oa.tables() for e in c.entries()])
