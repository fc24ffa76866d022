"""Models whose attention code is their own (transformers' `_supports_attention_backend = False`:
bloom, mpt, falcon, git, the BERT-style decoders, openai-gpt, xglm, ...): no attn_implementation reaches
it, so each attention module's whole forward is the spec. Its projections are the prologue, the
merge of heads, the output projection and any LayerNorm the epilogue (transfer/epilogue.py), and the
attention weights it returns are served as None, as transformers' callers ignore them without
`output_attentions`.

A call is served by the compiled spec only where what it reads is all tensors and plain values: a
cache object passed in is updated by Python side effects (`cache.update`) that a captured graph does
not replay, so such a call runs the module's own forward. So does a call that asks for the weights,
and a module in training mode.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable

import torch

from ..compile import CompiledAttention, compile

_PLAIN = (torch.Tensor, int, float, bool, str, type(None), torch.dtype, torch.device)
_specs: dict[type, Callable] = {}
_compiled: weakref.WeakKeyDictionary[torch.nn.Module, CompiledAttention] = weakref.WeakKeyDictionary()


def has_own_attention(model: torch.nn.Module) -> bool:
    """A transformers model whose attention modules do not call the attention interface."""
    return getattr(type(model), "_supports_attention_backend", True) is False


def module_spec(cls: type) -> Callable:
    """The spec of one attention class: its own forward, with the module as the first argument."""
    fwd = cls.forward

    def own_attention_forward(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        return fwd(module, *args, **joined(kwargs))
    own_attention_forward.__name__ = f"{cls.__name__}_forward"
    return _specs.setdefault(cls, own_attention_forward)


_SEP = "__item"  # position_embeddings=(cos, sin) travels as position_embeddings__item0, ..item1


def split(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Tuples of tensors among the keywords (rotary (cos, sin)) as one keyword per tensor: a tensor
    inside a tuple is no input of the trace (capture refuses it rather than bake it in)."""
    out: dict[str, Any] = {}
    for k, v in kwargs.items():
        if isinstance(v, tuple) and v and all(isinstance(t, torch.Tensor) for t in v):
            out.update({f"{k}{_SEP}{i}": t for i, t in enumerate(v)})
        else:
            out[k] = v
    return out


def joined(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keywords as the module's forward takes them (split's inverse)."""
    out: dict[str, Any] = {}
    parts: dict[str, dict[int, Any]] = {}
    for k, v in kwargs.items():
        base, sep, i = k.rpartition(_SEP)
        if sep and i.isdigit():
            parts.setdefault(base, {})[int(i)] = v
        else:
            out[k] = v
    out.update({b: tuple(d[i] for i in range(len(d))) for b, d in parts.items()})
    return out


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The innermost modules named as attention (transformers' classes end in "Attention") that hold
    parameters: the self-attention of a BERT-style block, not the block around it."""
    found = [m for m in model.modules() if type(m).__name__.endswith("Attention") and any(True for _ in m.parameters())]
    inner = set(found)
    for m in found:
        inner -= {c for c in m.modules() if c is not m}
    return [m for m in found if m in inner]


def _servable(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> bool:
    if module.training or kwargs.get("output_attentions") or kwargs.get("use_cache"):
        return False
    return all(_plain(a) for a in args) and all(_plain(a) for a in kwargs.values())


def _plain(x: Any) -> bool:
    if isinstance(x, (tuple, list)):
        return all(_plain(i) for i in x)
    return isinstance(x, _PLAIN)


def serve_own_attention(model: torch.nn.Module) -> int:
    """Route each attention module of `model` through its compiled forward (see the module docstring);
    the number of modules routed. Calling it again is a no-op for modules already routed."""
    n = 0
    for m in attention_modules(model):
        if "forward" in vars(m):  # routed already, or a forward set by someone else: left alone
            continue
        spec = module_spec(type(m))
        own = type(m).forward

        def forward(*args: Any, _m: Any = weakref.ref(m), _spec: Callable = spec, _own: Callable = own,
                    **kwargs: Any) -> Any:
            mod = _m()
            if not _servable(mod, args, kwargs) or torch.compiler.is_compiling():
                return _own(mod, *args, **kwargs)
            c = _compiled.get(mod)
            if c is None:
                c = _compiled[mod] = compile(_spec)
            return c(mod, *args, **split(kwargs))
        m.forward = forward
        n += 1
    return n


def tables() -> list[CompiledAttention]:
    """The compiled forward of every routed module that has been called."""
    return list(_compiled.values())
