"""A training step through the drop-in: with attn_implementation="cubridge", each attention call of a model in
training mode goes through the custom op and its autograd (on the CPU the op's forward is the interpreter, as a
GPU kernel would be: interpreted_op.py; the backward is the backward runner's), and the loss and every
parameter's gradient match eager's, on a left-padded batch. In float32: eager itself is NaN in float64 there
(a padded query row's fills add to -inf, and its NaN values reach the loss), while float32 has room for them.
Families with a softcap and a sliding window (gemma2), learnable sinks (gpt_oss), q/k norms (qwen3)."""
from __future__ import annotations

import warnings

import pytest
import torch

import torch_cubridge.integrations.transformers as tcx
from interpreted_op import serve_by_op
from tiny_models import pair

FAMILIES = ["llama", "gemma2", "gpt_oss", "qwen3"]
PAD = 5  # left padding: padded query rows are filled whole (finfo.min); the shifted loss reads the last one
TOL = 1e-4  # float32 against float32 eager: a gradient's relative error (float32 rounding, summed otherwise)


@pytest.fixture(scope="module", autouse=True)
def _registered():
    tcx.register()


def _step(model, ids, mask):
    model.train()
    model.zero_grad()
    out = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    out.loss.backward()
    return out.loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_training_step_matches_eager(monkeypatch, family):
    made = serve_by_op(monkeypatch)
    tcx.clear_tables()
    ref, ours = pair(family, dtype=torch.float32, attention_dropout=0.0)
    ids = torch.randint(1, 128, (2, 14), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :PAD] = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want_loss, want = _step(ref, ids, mask)
        got_loss, got = _step(ours, ids, mask)
    assert sum(r.forward_calls for r in made) > 0, "no attention call went through the custom op"
    assert abs(float(got_loss - want_loss)) <= 1e-5 * abs(float(want_loss))
    assert got.keys() == want.keys()
    for name, g in got.items():
        w = want[name]
        err = float((g.double() - w.double()).norm() / w.double().norm().clamp_min(1e-30))
        assert err < TOL, f"{family}: {name} gradient off by {err:.2e}"
