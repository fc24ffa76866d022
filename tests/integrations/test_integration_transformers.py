"""The drop-in AttentionInterface implementation gives the model's own numbers, through programs.

Eager and cubridge models come from tiny_models.pair: separate configs. Models built from one config
share its attention implementation, so such a test compared ours with ours and could not fail.
tests/integrations/test_transformers_models.py compares every family in prefill and decode; this file checks
what it does not: each attention module's calls go through a table of its own whose programs
transferred to CuIR, and the model still traces under torch.compile(fullgraph=True).
"""
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import torch_cubridge.integrations.transformers as tcx  # noqa: E402
from tiny_models import inputs, pair  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _registered():
    tcx.register()


def _logits(model, ids, mask):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no CUDA here: the spec computes every call
        return model(ids, attention_mask=mask).logits


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_model_with_cubridge_attention_matches_eager(family):
    ref, ours = pair(family)
    ids, mask = inputs()
    want, got = _logits(ref, ids, mask), _logits(ours, ids, mask)
    assert float((got - want).norm() / want.norm()) < 1e-5
    tables = [t for layer in ours.model.layers for t in tcx.tables(layer.self_attn)]
    assert len(tables) == len(ours.model.layers) and len({id(t) for t in tables}) == len(tables)
    for t in tables:
        assert sum(t.served.values()) == 1  # this module's one call went through its table
        for entry in t.entries():
            assert entry.result is not None, entry.reason  # the model's attention transferred to CuIR
    assert not any(tcx.tables(layer.self_attn) for layer in ref.model.layers)  # eager is eager


def test_model_traces_under_torch_compile_fullgraph():
    ref, ours = pair("llama")
    ids, mask = inputs()
    want = _logits(ref, ids, mask)
    _logits(ours, ids, mask)  # the eager call fills the tables the traced call looks up
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = torch.compile(ours, fullgraph=True)(ids, attention_mask=mask).logits
    assert float((got - want).norm() / want.norm()) < 1e-5
