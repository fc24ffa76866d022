"""A deep model keeps every kernel: each attention module has a dispatch table of its own.

One table per model file, shared by every layer, needs two programs per layer (prefill, decode):
past 16 layers MAX_PROGRAMS refused the rest, and the spec served them without a warning. Here the
CPU interpreter stands in for the GPU kernel, so `served` says whether a program or the spec
computed each call.
"""
import importlib
import warnings

import pytest
import torch

import torch_cubridge.integrations.transformers as tcx
from tiny_models import forced_step_logits, greedy_tokens, inputs, pair

pytest.importorskip("transformers")
compile_mod = importlib.import_module("torch_cubridge.compile")  # the package exports compile(), the function
LAYERS = 17  # two programs each: more than MAX_PROGRAMS in one shared table


@pytest.fixture
def interpreted(monkeypatch):
    monkeypatch.setattr(compile_mod, "kernel_stage", lambda fn, res, bound: (res.program.run, "interpreted"))


def test_every_layer_of_a_deep_model_is_served_by_a_program(interpreted):
    tcx.register()
    ref, ours = pair("llama", layers=LAYERS)
    ids, mask = inputs()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tokens = greedy_tokens(ref, ids, mask, 3)
        want = forced_step_logits(ref, ids, mask, tokens)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("error", message="torch_cubridge")  # a program refused by the cap would warn
        got = forced_step_logits(ours, ids, mask, tokens)  # prefill, then decode steps (Sq = 1)
    tables = [t for layer in ours.model.layers for t in tcx.tables(layer.self_attn)]
    assert len({id(t) for t in tables}) == LAYERS  # a table per attention module
    for i, t in enumerate(tables):
        entries = t.entries()
        assert 2 <= len(entries) <= compile_mod.MAX_PROGRAMS, (i, len(entries))
        assert all(e.result is not None for e in entries), (i, [e.reason for e in entries])
        assert t.served["spec"] == 0 and t.served["kernel"] == len(got), (i, t.served)
    for g, w in zip(got, want):
        assert float((g - w).norm() / w.norm()) < 1e-4
