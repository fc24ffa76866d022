"""On a CUDA device: models whose attention code is their own, each attention module's forward served by
the kernel (its projections in the prologue, the merge, projection and LayerNorm in the epilogue).
The reference is a separate copy of the model in float32 on the CPU, running its own attention code,
so "ours" is never compared with itself (float32: xglm's own code cannot run in float64)."""
import copy
import warnings

import pytest
import torch

from test_own_attention import FAMILIES, tiny
from torch_cubridge.integrations import own_attention as oa

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("B", [1, 2])
@pytest.mark.parametrize("family", FAMILIES)
def test_own_attention_served_by_kernel(family, B):
    """cpmant's tiny model (initial std 1.0) is ill-conditioned in bf16: its own eager code in bf16 misses
    float32 by more than 3e-2, so ours is held to the bf16 eager model's own distance from float32
    (a separate copy, run with its own attention code)."""
    model = tiny(family)
    ref_model = copy.deepcopy(model).float()
    eager16 = copy.deepcopy(model).to("cuda", torch.bfloat16)
    model = model.to("cuda", torch.bfloat16)
    assert oa.serve_own_attention(model) > 0
    oa._compiled.clear()
    ids = torch.randint(0, 128, (B, 200), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = model(ids.cuda(), use_cache=False).logits.double().cpu()
        ref = ref_model(ids, use_cache=False).logits
        own = eager16(ids.cuda(), use_cache=False).logits.double().cpu()
    served = [c.served for c in oa.tables()]
    assert served and all(s["spec"] == 0 and s["kernel"] >= 1 for s in served), \
        (served, [e.reasons or e.reason for c in oa.tables() for e in c.entries()])
    # bf16 weights and activations through two layers: the logits agree to bf16's precision
    err, err_own = float((got - ref).norm() / ref.norm()), float((own - ref).norm() / ref.norm())
    assert err < max(3e-2, 1.5 * err_own), (err, err_own)
