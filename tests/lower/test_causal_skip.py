"""The drop-in skips transformers' 4-D mask where SDPA's path does, and serves a causal program.

Without padding, transformers' SDPA mask is None and SDPA is told is_causal. The drop-in's mask function
now returns None in the same cases, and the drop-in reads None as SDPA does: causal (torch's top-left
pattern) for a prefill of a causal module, nothing for one query. The spec it compiles then builds that
mask from positions, so the program reads no mask tensor. Here the CPU interpreter stands in for the
kernel (as in test_served_deep_models), so the programs' own answers are compared with eager's.
"""
import importlib
import warnings

import pytest
import torch

import torch_cubridge.integrations.transformers as tcx
from tiny_models import FAMILIES, forced_step_logits, greedy_tokens, inputs, pair

pytest.importorskip("transformers")
compile_mod = importlib.import_module("torch_cubridge.compile")


@pytest.fixture
def interpreted(monkeypatch):
    monkeypatch.setattr(compile_mod, "kernel_stage", lambda fn, res, bound: (res.program.run, "interpreted"))
    tcx.register()
    tcx.clear_tables()
    yield
    tcx.clear_tables()


def _run(family: str, padded: bool, steps: int = 3):
    ref, ours = pair(family)
    ids, mask = inputs()
    mask = mask if padded else torch.ones_like(mask)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tokens = greedy_tokens(ref, ids, mask, steps)
        want = forced_step_logits(ref, ids, mask, tokens)
        got = forced_step_logits(ours, ids, mask, tokens)
    for step, (g, w) in enumerate(zip(got, want)):
        assert float((g - w).norm() / w.norm()) < 1e-4, f"{family} step {step}"
    return ours


@pytest.mark.parametrize("family", list(FAMILIES))
def test_unpadded_calls_serve_programs_that_read_no_mask(interpreted, family):
    ours = _run(family, padded=False)
    causal = [t for m in ours.modules() for t in tcx.tables(m) if t in tcx._compiled_causal.values()]
    windowed = getattr(ours.config, "sliding_window", None)
    # every layer's prefill went through the causal spec unless its window bites at this length
    assert causal or windowed
    for t in causal:
        assert t.served["spec"] == 0 and t.served["kernel"] >= 1
        for e in t.entries():
            p = e.result.program
            assert p.mask is not None  # the causal pattern, from positions
            assert not p.prologue and all(x.rank < 2 for x in p.extras), p.extras  # no mask tensor (sinks may be)
    for t in tcx.tables():
        assert t.served["spec"] == 0, t.served


def test_padded_calls_keep_the_mask(interpreted):
    ours = _run("llama", padded=True)
    assert not any(t in tcx._compiled_causal.values() for m in ours.modules() for t in tcx.tables(m))


def test_a_none_mask_is_causal_only_where_sdpa_reads_it_so():
    class M(torch.nn.Module):
        is_causal = True
    q1, q4 = torch.zeros(1, 1, 1, 8), torch.zeros(1, 1, 4, 8)
    m = M()
    assert tcx._is_causal_call(m, q4, None, {})
    assert not tcx._is_causal_call(m, q1, None, {})  # one query: every key
    assert not tcx._is_causal_call(m, q4, torch.zeros(1, 1, 4, 4), {})
    assert not tcx._is_causal_call(m, q4, None, {"is_causal": False})
    m.is_causal = False  # an encoder's attention
    assert not tcx._is_causal_call(m, q4, None, {})
    assert tcx._is_causal_call(m, q4, None, {"is_causal": True})


def test_the_causal_spec_is_eager_with_the_top_left_mask():
    from transformers.models.llama.modeling_llama import eager_attention_forward

    class M(torch.nn.Module):
        num_key_value_groups, training, is_causal = 1, False, True
    q, k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 8)
    keep = torch.ones(5, 7, dtype=torch.bool).tril()  # torch's is_causal: key j for query i iff j <= i
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    got, _ = tcx.causal_spec(eager_attention_forward)(M(), q, k, v, None, scaling=8 ** -0.5)
    assert torch.allclose(got.transpose(1, 2), want, atol=1e-6)
