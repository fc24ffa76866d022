"""The drop-in AttentionInterface implementation gives the model's own numbers."""
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import torch_cubridge.integrations.transformers as tcx  # noqa: E402


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_model_with_cubridge_attention_matches_eager(family):
    from transformers import AutoConfig, AutoModelForCausalLM
    tcx.register()
    kw = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
    if family == "gemma2":
        kw.update(attn_logit_softcapping=30.0, query_pre_attn_scalar=16, sliding_window=8)
    cfg = AutoConfig.for_model(family, **kw)
    torch.manual_seed(0)
    ref_model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=tcx.NAME).eval()
    model.load_state_dict(ref_model.state_dict())
    ids = torch.randint(0, 97, (2, 23))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = ref_model(ids).logits
        out = model(ids).logits
    assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4)
    assert tcx._compiled  # calls went through compiled attention
    for c in tcx._compiled.values():
        for entry in c.entries():
            assert entry.result is not None, entry.reason  # the model's attention transferred to CuIR
