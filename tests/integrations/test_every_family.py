"""Whole models of every family listed here under attn_implementation="cubridge" against "eager", in float64.

Each family is built tiny (one layer, hidden 32-64) from a config of its own for each implementation, with
the same weights, and run once: token models on a left-padded batch with its attention mask, vision models
on a batch of images. On the CPU the spec computes every call, so this checks what the drop-in hands it: the
function the module calls under "eager" (integrations/eager_lookup.py), the mask and the arguments. Every
family's attention calls must reach the drop-in (a model that bypassed it would compare eager with eager).

The list: the causal-LM families of tiny_models, and a base model for each eager function of another name
than eager_attention_forward and for each kind of mask. Every family of the installed transformers is
benchmarks/survey_families.py's sweep (a process a family: minutes a hundred families, past the CPU suite's
budget); a family it finds wrong belongs here.
"""
import warnings

import pytest
import torch

import torch_cubridge.integrations.transformers as tcx
from torch_cubridge.integrations import own_attention
from tiny_models import FAMILIES, MORE_FAMILIES, config

# causal LMs built through tiny_models, and base models built here (model class, config keywords, input):
# among them each eager function of another name than eager_attention_forward (phi4's and timesfm's
# simple_eager_attention_forward, llama4's vision_eager_..., tipsv2's text_eager_...) and a bidirectional
# encoder's padding mask (bert)
TOKEN_FAMILIES = [*FAMILIES, *MORE_FAMILIES]
_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
               patch_size=14)
_TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=128)
BASE_FAMILIES = {
    "phi4_multimodal_vision": ("transformers.models.phi4_multimodal.modeling_phi4_multimodal."
                               "Phi4MultimodalVisionModel", _VISION, "pixels"),
    "llama4_vision_model": ("transformers.models.llama4.modeling_llama4.Llama4VisionModel",
                            dict(_VISION, intermediate_size=128, vision_output_dim=32, projector_input_dim=32,
                                 projector_output_dim=32, pixel_shuffle_ratio=0.5), "pixels"),
    "siglip_vision_model": ("transformers.SiglipVisionModel", _VISION, "pixels"),
    "clip_vision_model": ("transformers.CLIPVisionModel", _VISION, "pixels"),
    "tipsv2_text_model": ("transformers.models.tipsv2.modeling_tipsv2.Tipsv2TextModel", _TEXT, "tokens"),
    "bert": ("transformers.BertModel", _TEXT, "tokens"),
    # an attention module of its own (no attention interface) that caches its gathered position bias in a
    # dict on its first eval call: a trace over fake tensors filled it with a fake tensor, and the model's
    # next call raised
    "levit": ("transformers.LevitModel", dict(hidden_sizes=[32, 48, 64], num_attention_heads=[2, 2, 2],
                                              depths=[1, 1, 1], key_dim=[8, 8, 8], image_size=64), "pixels"),
}
VISION_FAMILIES = {f for f, (_, _, kind) in BASE_FAMILIES.items() if kind == "pixels"}
# families that cannot run here as this test runs them, with the reason (eager itself fails the same way)
NOT_BUILDABLE: dict[str, str] = {
    "gpt_oss": "its experts' grouped matmul takes no float64 on the CPU (test_transformers_models: float32)",
}
# families with an eager function of another name that this test does not build, and why
NOT_BUILT = {
    "timesfm": "a time-series model (past_values and frequencies, not tokens or images): no generic tiny input",
}


@pytest.fixture(scope="module", autouse=True)
def _registered():
    tcx.register()


def _class(path: str) -> type:
    import importlib
    mod, _, name = path.rpartition(".")
    return getattr(importlib.import_module(mod), name)


def _base_pair(family: str):
    from transformers import AutoConfig
    path, kw, _ = BASE_FAMILIES[family]
    cls = _class(path)
    models = []
    for impl in ("eager", "cubridge"):
        torch.manual_seed(0)  # a config of its own each: a shared config shares its implementation
        cfg = AutoConfig.for_model(family, **kw)
        models.append(cls._from_config(cfg, attn_implementation=impl, dtype=torch.float64).eval())
    models[1].load_state_dict(models[0].state_dict())
    return models


def _token_pair(family: str):
    from transformers import AutoModelForCausalLM
    models = []
    for impl in ("eager", "cubridge"):
        torch.manual_seed(0)
        cfg = config(family, layers=1)
        models.append(AutoModelForCausalLM.from_config(cfg, attn_implementation=impl, dtype=torch.float64).eval())
    models[1].load_state_dict(models[0].state_dict())
    return models


def _run(model, family: str) -> torch.Tensor:
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no CUDA here: the spec computes every call
        if family in VISION_FAMILIES:
            size = model.config.image_size
            x = torch.randn(2, 3, size, size, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
            return model(pixel_values=x).last_hidden_state
        ids = torch.randint(1, 128, (2, 12), generator=torch.Generator().manual_seed(1))
        mask = torch.ones_like(ids)
        mask[0, :4] = 0  # a left-padded batch
        out = model(input_ids=ids, attention_mask=mask)
        out = out.logits if family in TOKEN_FAMILIES else out.last_hidden_state
        return out[mask.bool()]  # padded rows are nobody's answer


def _calls() -> int:
    """Calls the drop-in served: through the attention interface, or as a module's own attention."""
    return sum(sum(c.served.values()) for c in [*tcx.tables(), *own_attention.tables()])


@pytest.mark.parametrize("family", [f for f in [*TOKEN_FAMILIES, *BASE_FAMILIES] if f not in NOT_BUILDABLE])
def test_family_matches_eager_in_float64(family):
    tcx.clear_tables()
    ref, ours = (_base_pair if family in BASE_FAMILIES else _token_pair)(family)
    want = _run(ref, family)
    assert _calls() == 0  # eager is eager
    got = _run(ours, family)
    assert _calls() > 0, f"{family}: no attention call reached the drop-in"
    err = float((got - want).norm() / want.norm())
    assert err < 1e-10, f"{family}: relative error {err:.2e} against eager"


@pytest.mark.parametrize("family", list(NOT_BUILDABLE))
def test_a_family_listed_as_not_buildable_fails_under_eager_too(family):
    """The list says why a family is left out; it stays true only while eager itself fails so."""
    ref, _ = (_base_pair if family in BASE_FAMILIES else _token_pair)(family)
    with pytest.raises(Exception):
        _run(ref, family)
