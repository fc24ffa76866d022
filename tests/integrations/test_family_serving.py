"""Families whose attention calls the drop-in once left to the spec, each served by a verified program.

transformers' `_supports_attention_backend` is False unless a model sets it, and many models that never set
it still call the attention interface (wav2vec2, hubert, sew, biogpt, qwen3_next, ...). Their modules were
routed whole as own attention: the whole forward's capture met the drop-in with a stand-in module, failed,
and the spec served every call. Here the CPU interpreter stands in for the GPU kernel, so `served` says
whether a verified program or the spec computed each call, and the answer is held against eager in float64
from the same weights.
"""
import collections
import importlib
import warnings

import pytest
import torch

import torch_cubridge.integrations.transformers as tcx
from helpers import rel_err
from torch_cubridge.integrations import own_attention as oa

transformers = pytest.importorskip("transformers")
compile_mod = importlib.import_module("torch_cubridge.compile")  # the package exports compile(), the function

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=128,
            max_position_embeddings=256, pad_token_id=None, bos_token_id=None, eos_token_id=None)


@pytest.fixture
def interpreted(monkeypatch):
    monkeypatch.setattr(compile_mod, "kernel_stage", lambda fn, res, bound: (res.program.run, "interpreted"))


def _pair(family: str, auto: type, **kw) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(eager in float64, ours in float32) with the same weights and separate configs."""
    tcx.register()
    cfg = lambda: transformers.AutoConfig.for_model(family, **TINY, **kw)  # noqa: E731
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = auto.from_config(cfg(), attn_implementation="eager").eval()
        ours = auto.from_config(cfg(), attn_implementation=tcx.NAME).eval()
    ours.load_state_dict(ref.state_dict())
    return ref.double(), ours


def _served(model: torch.nn.Module) -> tuple[collections.Counter, list[str]]:
    """Who computed the calls of every attention module of the model, and the refusals."""
    tables = []
    for m in model.modules():
        tables += tcx.tables(m) + [c for t in (oa._compiled, oa._compiled_cached) if (c := t.get(m)) is not None]
    served = sum((t.served for t in tables), collections.Counter())
    refused = [e.reason for t in tables for e in t.entries() if e.result is None]
    return served, refused


def _assert_programs_serve(ours: torch.nn.Module, calls: int) -> None:
    served, refused = _served(ours)
    assert not refused, refused
    assert served["spec"] == 0 and served["kernel"] == calls, served


def test_a_speech_encoder_calling_the_interface_is_served_by_its_programs(interpreted):
    """wav2vec2: bidirectional attention over the conv features, a padded batch (its own 4-D mask)."""
    ref, ours = _pair("wav2vec2", transformers.AutoModel, num_key_value_heads=4)
    assert not oa.has_own_attention(ours) or oa.calls_interface(type(ours.encoder.layers[0].attention))
    x = torch.randn(2, 4000, generator=torch.Generator().manual_seed(1))
    keep = torch.ones(2, 4000, dtype=torch.long)
    keep[1, 3000:] = 0
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("error", message="torch_cubridge")  # a call left to the spec would warn
        got = ours(x, attention_mask=keep).last_hidden_state
        want = ref(x.double(), attention_mask=keep).last_hidden_state
    _assert_programs_serve(ours, calls=2)
    assert rel_err(got, want) < 1e-5


def test_a_causal_lm_without_the_backend_flag_is_served_left_padded(interpreted):
    """biogpt: a causal LM that calls the interface but declares no backend support; a left-padded batch."""
    ref, ours = _pair("biogpt", transformers.AutoModelForCausalLM)
    assert oa.has_own_attention(ours)  # the flag says "own code", and its attention calls the interface
    ids = torch.randint(1, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    keep = torch.ones_like(ids)
    keep[0, :5] = 0
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("error", message="torch_cubridge")
        got = ours(ids, attention_mask=keep, use_cache=False).logits
        want = ref(ids, attention_mask=keep, use_cache=False).logits
    _assert_programs_serve(ours, calls=2)
    real = keep.bool()
    assert rel_err(got[real], want[real]) < 1e-5


def test_modules_with_attention_code_of_their_own_are_still_routed_whole(interpreted):
    """git's text attention has no interface call: it is routed through its compiled forward, and its
    vision tower's attention (an interface call) is the drop-in's."""
    tcx.register()
    _, ours = _pair("git", transformers.AutoModelForCausalLM)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours(torch.randint(0, 128, (1, 16)), use_cache=False)
    routed = [m for m in oa.attention_modules(ours) if "forward" in vars(m)]
    assert routed and not any(oa.calls_interface(type(m)) for m in routed)
    assert oa.tables() and all(e.result is not None for c in oa.tables() for e in c.entries())


def test_small_config_keeps_layer_types_derived_from_other_fields():
    """jamba's layer types follow from its periods (a property with no setter): the config keeps the first
    layers up to each type's first, so a model of it still has its attention layer."""
    cfg = tcx.small_config(transformers.AutoConfig.for_model("jamba"))
    assert {"full_attention", "linear_attention"} <= set(cfg.layer_types)
    assert cfg.num_hidden_layers == len(cfg.layer_types) <= 8
