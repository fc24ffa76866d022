"""benchmarks/survey_families.py builds every family tiny, towers included: a multimodal family whose vision
and text towers kept their default sizes spent past a minute in random init alone, and its survey timed out."""
import importlib.util
from pathlib import Path

import pytest
import torch

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "survey_families.py"
_spec = importlib.util.spec_from_file_location("survey_families", _PATH)
survey = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(survey)


@pytest.mark.parametrize("family", ["llava", "gemma3"])
def test_a_multimodal_familys_first_config_is_tiny_in_every_tower(family):
    cfg = next(survey.configs(family))
    for name in cfg.sub_configs:
        sub = getattr(cfg, name)
        assert sub.hidden_size == survey.TINY["hidden_size"], (name, sub.hidden_size)
        layers = getattr(sub, "num_hidden_layers", None)
        assert layers is None or layers <= 2, (name, layers)
        types = getattr(sub, "layer_types", None)
        assert types is None or len(types) == layers  # the config's own check holds after the cut
    cls = survey.model_class(family, cfg)
    with torch.device("meta"):
        size = sum(p.numel() for p in cls._from_config(cfg, attn_implementation="eager").parameters())
    assert size < 5e6, size
