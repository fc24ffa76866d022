"""GPU: a bf16 training step through the drop-in (attn_implementation="cubridge"), the attention's forward and
backward on the kernels, against the same step of eager in float32 from the same weights. Ours must be as
close to it as eager in bf16 is (x1.5, plus a small floor): the loss, all gradients together, and each
parameter's gradient (x3 there, a single parameter's bf16 error being noisier). Every backward of a family
with no learnable score term is the backward kernel's, left-padded too (its padded query rows hold finfo.min
on every key: a uniform softmax whose LSE is the fill)."""
from __future__ import annotations

import collections
import warnings

import pytest
import torch

import torch_cubridge.integrations.transformers as tcx
from torch_cubridge.ops import backward_runner
from tiny_models import build

pytestmark = pytest.mark.gpu
FAMILIES = ["llama", "gemma2", "gpt_oss", "qwen3"]
LEARNABLE_SCORE: set[str] = set()  # families whose score reads a learnable tensor (the reference's backward)
SIZE = dict(hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            attention_dropout=0.0)
# gpt_oss routes each token to both of its two experts: with top-1 routing a near tie sends a token to another
# expert in bf16 than in float32, a jump in its gradient that eager in bf16 makes at other tokens
OVERRIDES = {"gpt_oss": dict(num_experts_per_tok=2)}
B, S, PAD = 2, 160, 37


@pytest.fixture(scope="module", autouse=True)
def _registered():
    tcx.register()


def _batch(padded: bool) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, 128, (B, S), generator=torch.Generator().manual_seed(4)).cuda()
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :PAD] = 0
    return ids, mask


def _step(model, ids, mask) -> tuple[float, dict[str, torch.Tensor]]:
    model.train()
    model.zero_grad()
    out = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    out.loss.backward()
    return float(out.loss), {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _backward_served() -> collections.Counter:
    return sum((r.served for r in backward_runner._RUNNERS.values()), start=collections.Counter())


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left-padded"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_bf16_training_step_on_the_kernels_is_as_close_to_float32_as_eager(family, padded):
    tcx.clear_tables()
    kw = {**SIZE, **OVERRIDES.get(family, {})}
    ref = build(family, "eager", torch.float32, "cuda", **kw)
    base = build(family, "eager", torch.bfloat16, "cuda", **kw)
    ours = build(family, "cubridge", torch.bfloat16, "cuda", **kw)
    base.load_state_dict(ref.state_dict())
    ours.load_state_dict(ref.state_dict())
    ids, mask = _batch(padded)
    before = _backward_served()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want, eager16, got = (_step(m, ids, mask) for m in (ref, base, ours))
    served = _backward_served() - before
    fwd = sum((c.served for m, c in tcx.table_items() if any(m is x for x in ours.modules())),
              start=collections.Counter())
    assert fwd["kernel"] > 0 and fwd["spec"] == 0, fwd
    assert sum(served.values()) == fwd["kernel"], (served, fwd)  # every kernel forward had its backward
    if family not in LEARNABLE_SCORE:
        assert served == {"kernel": fwd["kernel"]}, served

    (loss, grads), (loss16, grads16), (loss32, grads32) = got, eager16, want
    assert abs(loss - loss32) <= 1.5 * abs(loss16 - loss32) + 2e-3 * abs(loss32), (loss, loss16, loss32)
    assert grads.keys() == grads32.keys()
    flat = [torch.cat([g[n].flatten() for n in grads32]) for g in (grads, grads16, grads32)]
    assert _rel(flat[0], flat[2]) <= 1.5 * _rel(flat[1], flat[2]) + 1e-3, (_rel(flat[0], flat[2]),
                                                                           _rel(flat[1], flat[2]))
    top = max(float(g.norm()) for g in grads32.values())
    for n, w in grads32.items():
        floor = 1e-2 * max(float(w.norm()), 1e-2 * top)
        err, err16 = float((grads[n] - w).norm()), float((grads16[n] - w).norm())
        assert err <= 3 * err16 + floor, f"{family}: {n} off by {err:.3e} (eager bf16 {err16:.3e})"
