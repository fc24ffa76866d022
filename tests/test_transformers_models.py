"""Whole transformers models under attn_implementation="cubridge" against "eager", on the CPU.

On the CPU every call is computed by the spec (the model's own eager attention), so this tests what
the integration hands it: the mask (causal, sliding windows, padding) and the arguments, in prefill
and in every decode step. tests/test_gpu.py repeats it with kernels serving every call.
"""
import warnings

import pytest
import torch

import torch_cubridge.integrations.transformers as tcx
from tiny_models import FAMILIES, MORE_FAMILIES, forced_step_logits, greedy_tokens, inputs, pair, step_logits


@pytest.fixture(scope="module", autouse=True)
def _registered():
    tcx.register()


@pytest.mark.parametrize("padded", [False, True], ids=["full", "left_padded"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_model_matches_eager_in_prefill_and_every_decode_step(family, padded):
    ref, ours = pair(family)
    ids, mask = inputs()
    mask = mask if padded else torch.ones_like(mask)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = step_logits(ref, ids, mask)
        got = step_logits(ours, ids, mask)
        tokens = greedy_tokens(ref, ids, mask, 4)
        forced = zip(forced_step_logits(ours, ids, mask, tokens), forced_step_logits(ref, ids, mask, tokens))
    assert len(got) == len(want) == 4
    for g, w in forced:  # the GPU test's teacher-forced comparison, checked here where the spec serves
        assert float((g - w).norm() / w.norm()) < 1e-5
    for step, (g, w) in enumerate(zip(got, want)):
        err = float((g - w).norm() / w.norm())
        assert err < 1e-5, f"{family} step {step}: rel err {err:.2e}"


@pytest.mark.parametrize("family", list(MORE_FAMILIES))
def test_more_families_match_eager_teacher_forced(family):
    """Other attention code (parallel blocks, partial rotary, learned positions, q/k/v biases), left
    padded: every call reaches the drop-in, and prefill and each decode step match eager."""
    tcx._compiled.clear()
    ref, ours = pair(family)
    ids, mask = inputs()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tokens = greedy_tokens(ref, ids, mask, 4)
        want = forced_step_logits(ref, ids, mask, tokens)
        got = forced_step_logits(ours, ids, mask, tokens)
    calls = sum(sum(c.served.values()) for c in tcx._compiled.values())
    assert calls >= 2 * len(got), f"{family}: {calls} attention calls reached the drop-in"
    for step, (g, w) in enumerate(zip(got, want)):
        assert float((g - w).norm() / w.norm()) < 1e-5, f"{family} step {step}"
