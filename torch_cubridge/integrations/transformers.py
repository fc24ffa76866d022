"""A drop-in attention implementation for Hugging Face transformers.

    import torch_cubridge.integrations.transformers as tcx
    tcx.register()                                   # adds "cubridge" to AttentionInterface
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="cubridge")

Each attention module is served by its own model file's `eager_attention_forward`
(so softcaps, sinks and scalings are exactly the model's), compiled with
@torch_cubridge.compile into a table of its own: a table shared by every layer
needs two programs (prefill, decode) per layer and runs out of room at 16
layers. What cannot be compiled runs eager.
"""
from __future__ import annotations

import sys
import weakref
from typing import Any, Callable

import torch

from ..compile import CompiledAttention, compile

NAME = "cubridge"
# weak keys: a table dies with its module (the table holds its module only weakly)
_compiled: weakref.WeakKeyDictionary[torch.nn.Module, CompiledAttention] = weakref.WeakKeyDictionary()


def _eager_for(module: torch.nn.Module) -> Callable:
    return eager_function(type(module))


def eager_function(cls: type) -> Callable:
    """The eager attention function the class's own forward falls back to: the `*attention_forward`
    global its code names (llama4's vision attention uses `vision_eager_attention_forward`, tipsv2's
    text attention `text_eager_attention_forward`), resolved where forward is defined (an inherited
    forward reads its own file); else the file's `eager_attention_forward`, else llama's."""
    import inspect
    fwd = inspect.unwrap(getattr(cls, "forward", None) or (lambda: None))
    g = getattr(fwd, "__globals__", {})
    code = getattr(fwd, "__code__", None)
    names = [n for n in (code.co_names if code else ()) if n.endswith("attention_forward") and callable(g.get(n))]
    if names:
        return g[sorted(names, key=lambda n: "eager" not in n)[0]]
    fn = getattr(sys.modules.get(cls.__module__), "eager_attention_forward", None)
    if fn is None:
        from transformers.models.llama.modeling_llama import eager_attention_forward as fn
    return fn


def cubridge_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                               value: torch.Tensor, attention_mask: torch.Tensor | None, **kwargs: Any):
    c = _compiled.get(module)
    if c is None:
        c = _compiled[module] = compile(_eager_for(module))
    out, _ = c(module, query, key, value, attention_mask, **kwargs)
    return out, None


def register(name: str = NAME) -> str:
    """Register the implementation under `name` in transformers' AttentionInterface, and its mask.

    The model's eager function adds the mask to the scores, so it needs the additive float mask
    transformers builds for "eager" (causal, sliding windows, padding). Without a mask function
    registered under the same name, transformers passes None (no causal mask at all) or a bool mask.
    """
    from transformers import AttentionInterface
    AttentionInterface.register(name, cubridge_attention_forward)
    try:
        from transformers import AttentionMaskInterface
        from transformers.masking_utils import eager_mask
    except ImportError:  # transformers before masking_utils builds eager's 4-D mask for any name
        return name
    AttentionMaskInterface.register(name, eager_mask)
    return name
