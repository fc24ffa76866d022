"""transformers' own eager_attention_forward, called with a module object and a 4-D additive mask."""
import importlib

import pytest
import torch
from torch import nn

import torch_cubridge as tc
from helpers import rel_err, to64


class FakeAttention(nn.Module):
    def __init__(self, groups: int, head_dim: int, heads: int, sinks: bool) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.head_dim = head_dim
        if sinks:
            self.sinks = nn.Parameter(torch.randn(heads))
        self.eval()


def causal_mask(B, S, dtype=torch.float32):
    m = torch.full((S, S), torch.finfo(dtype).min).triu(1)
    return m[None, None].expand(B, 1, S, S).clone()


@pytest.mark.parametrize("model", ["llama", "mistral", "gemma2", "gpt_oss"])
def test_eager_attention_forward(model):
    fn = importlib.import_module(f"transformers.models.{model}.modeling_{model}").eager_attention_forward
    B, H, Hkv, S, D = 2, 8, 2, 40, 64
    mod = FakeAttention(H // Hkv, D, H, sinks=model == "gpt_oss")
    kw = {"scaling": D ** -0.5}
    if model == "gemma2":
        kw["softcap"] = 30.0
    mk = lambda S: (torch.randn(B, H, S, D), torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D), causal_mask(B, S))
    prog = tc.transfer(fn, mod, *mk(S), **kw)
    assert prog.out.tuple_len == 2 and prog.out.dims == ("b", "s", "h", "d")
    if model == "gpt_oss":
        assert prog.sink is not None and prog.extras and any(x.arg == "module.sinks" for x in prog.extras)
    if model == "gemma2":
        assert "tanh" in str(prog.score)
    args = mk(29)
    got, weights = prog.run(mod, *args, **kw)
    assert weights is None  # the fused kernel never materialises attention weights
    ref = fn(mod.double(), *to64(args), **kw)[0]
    assert rel_err(got, ref) < 1e-6


@pytest.mark.parametrize("family, cls, fn", [
    ("llama", "LlamaAttention", "eager_attention_forward"),
    ("llama4", "Llama4VisionAttention", "vision_eager_attention_forward"),
    ("llama4", "Llama4TextAttention", "eager_attention_forward"),
    ("tipsv2", "Tipsv2TextAttention", "text_eager_attention_forward"),
])
def test_each_attention_class_is_served_by_its_own_eager_function(family, cls, fn):
    """The spec of a module is the eager function its own forward falls back to, not the file's
    `eager_attention_forward` (llama4's vision attention does not cast the softmax to float32)."""
    import importlib
    from torch_cubridge.integrations.transformers import eager_function
    try:
        mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    except ImportError:
        pytest.skip(f"transformers has no {family}")
    if not hasattr(mod, cls):
        pytest.skip(f"transformers has no {cls}")
    assert eager_function(getattr(mod, cls)) is getattr(mod, fn)
