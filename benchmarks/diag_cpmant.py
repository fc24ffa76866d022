"""cpmant's attention on the GPU: who served each module's calls and why (the GPU verification report)."""
import sys
import warnings
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "tests")]
from test_own_attention import tiny  # noqa: E402
from torch_cubridge.integrations import own_attention as oa  # noqa: E402

model = tiny("cpmant").to("cuda", torch.bfloat16)
oa.serve_own_attention(model)
ids = torch.randint(0, 128, (1, 200), generator=torch.Generator().manual_seed(1))
with torch.no_grad(), warnings.catch_warnings():
    warnings.simplefilter("ignore")
    model(ids.cuda(), use_cache=False)
for c in oa.tables():
    print(dict(c.served))
    for e in c.entries():
        print(e.reason)
        for d, why in e.reasons.items():
            print(d, why[:3000])
