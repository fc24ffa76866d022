"""Whole transformers models under attn_implementation="cubridge" against "eager", on the CPU.

On the CPU every call is computed by the spec (the model's own eager attention), so this tests what
the integration hands it: the mask (causal, sliding windows, padding) and the arguments, in prefill
and in every decode step. tests/pipeline/test_gpu.py repeats it with kernels serving every call.
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
    tcx.clear_tables()
    ref, ours = pair(family)
    ids, mask = inputs()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tokens = greedy_tokens(ref, ids, mask, 4)
        want = forced_step_logits(ref, ids, mask, tokens)
        got = forced_step_logits(ours, ids, mask, tokens)
    calls = sum(sum(c.served.values()) for c in tcx.tables())
    assert calls >= 2 * len(got), f"{family}: {calls} attention calls reached the drop-in"
    for step, (g, w) in enumerate(zip(got, want)):
        assert float((g - w).norm() / w.norm()) < 1e-5, f"{family} step {step}"


@pytest.mark.parametrize("family,extra", [("falcon", {}), ("gptj", {"rotary_dim": 16})])
def test_models_with_their_own_attention_tables_run_eager(family, extra):
    """falcon and gptj pick a class from a table of their own by attn_implementation: they used to raise
    KeyError('cubridge'); they now run their own attention code (eager), logits equal to eager's."""
    from transformers import AutoConfig, AutoModelForCausalLM
    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, pad_token_id=None, bos_token_id=None,
              eos_token_id=None, **extra)
    models = []
    for impl in ("eager", "cubridge"):
        torch.manual_seed(0)  # each from a config of its own (a shared config shares its implementation)
        models.append(AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **kw),
                                                       attn_implementation=impl).eval())
    ref, ours = models
    assert ours.config._attn_implementation == "cubridge" and ref.config._attn_implementation == "eager"
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(ref(ids).logits, ours(ids).logits)


def _inkling2_pair(device: str = "cpu", dtype: torch.dtype = torch.float32, eager_dtype: torch.dtype = torch.float32):
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    if "inkling2_text" not in CONFIG_MAPPING_NAMES:
        pytest.skip("this transformers has no inkling2")
    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, pad_token_id=None,
              bos_token_id=None, eos_token_id=None)
    models = []
    for impl, dt in (("eager", eager_dtype), ("cubridge", dtype)):
        torch.manual_seed(0)  # each from a config of its own (a shared config shares its implementation)
        # dtype at build: its router stays float32 (_keep_in_fp32_modules), which .to(dtype) would not keep
        models.append(AutoModelForCausalLM.from_config(AutoConfig.for_model("inkling2_text", **kw),
                                                       attn_implementation=impl, dtype=dt).to(device).eval())
    return models


def test_a_sink_projected_from_each_token_transfers(tmp_path):
    """inkling2 projects a sink logit from every token (per query row): every call transfers, with the
    sink as a row scale over the kernel's LSE, and the logits equal eager's (a prefill: this tiny config's
    cache does not generate, eager's neither)."""
    tcx.clear_tables()
    ref, ours = _inkling2_pair()
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want, got = ref(ids).logits, ours(ids).logits
    entries = [e for c in tcx.tables() for e in c.entries()]
    assert entries and all(e.result is not None for e in entries), [e.reason for e in entries]
    # the attention layers with a sink (transformers 5.24 adds attention calls without one, block residuals)
    assert any(e.result.program.row_scale is not None for e in entries)
    assert float((got - want).norm() / want.norm()) < 1e-5
