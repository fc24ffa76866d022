"""Models whose attention code is their own (transformers' `_supports_attention_backend = False`:
bloom, mpt, falcon, git, the BERT-style decoders, openai-gpt, xglm, ...): no attn_implementation reaches
it, so each attention module's whole forward is the spec. Its projections are the prologue, the
merge of heads, the output projection and any LayerNorm the epilogue (transfer/epilogue.py), and the
attention weights it returns are served as None, as transformers' callers ignore them without
`output_attentions`.

A call is served by the compiled spec only where what it reads is all tensors and plain values. A cache
object is updated by Python side effects (`cache.update`) that a captured graph does not replay, so a call
that passes one (`generate`'s prefill; its decode steps too with CACHED_DECODE) is served through a
stand-in: where the cache is transformers' DynamicCache and this module's layer a plain DynamicLayer, the
spec is called with that layer's keys and values as tensors and a stand-in cache whose `update` joins them
with the new ones as DynamicLayer does (a `torch.cat` the decode kernel reads in place, as its pieces); the
spec also returns the new keys and values, and the real cache is then updated with them by its own code.
An EncoderDecoderCache of two such DynamicCaches (xlm, fsmt, led) is stood in for the same way: its
self-attention cache joins the layer's past, and its cross-attention cache, not yet filled for this layer
(the prefill), keeps the keys a cross-attention call makes; the real caches are then updated by their own
code, and the layer marked filled, as the module's own forward does. Any other cache (static, sliding,
offloaded) runs the module's own forward, as does a call that asks for the weights, and a module in
training mode.
"""
from __future__ import annotations

import collections
import weakref
from typing import Any, Callable

import torch

from ..compile import CompiledAttention, compile
from .module_table import ModuleTable

_PLAIN = (torch.Tensor, int, float, bool, str, type(None), torch.dtype, torch.device)
_specs: dict[type, Callable] = {}
_compiled: ModuleTable[CompiledAttention] = ModuleTable("own")
# the compiled forward of calls that pass a DynamicCache (_serve_cached)
_compiled_cached: ModuleTable[CompiledAttention] = ModuleTable("own_cached")


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


_CACHE_KW, _PAST_K, _PAST_V = "cubridge_cache_keyword", "cubridge_past_keys", "cubridge_past_values"
_JOINT = "cubridge_encoder_decoder"  # the cache is an EncoderDecoderCache: a stand-in of both its caches
# Decode steps (a few new tokens against a past) through the cached spec too. Off: measured at 0.62-0.72x the
# model's own code in decode tokens/s (H100, 2-layer models of hidden 2048, a 2k prompt, B 1 and 8: the step
# is bound by the host, and the compiled call's host path is longer than the module's own), while the prefill
# through it is up to 1.8x faster. Tests turn it on to check that path.
CACHED_DECODE = False


class _JoiningCache:
    """The cache a spec called with its layer's past keys and values sees: `update` returns them joined with
    the new ones along the sequence, as transformers' DynamicLayer does, and keeps the new ones."""

    def __init__(self, keys: torch.Tensor | None, values: torch.Tensor | None) -> None:
        self.keys, self.values = keys, values
        self.new_keys: torch.Tensor | None = None
        self.new_values: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        self.new_keys, self.new_values = key_states, value_states
        if self.keys is None:
            return key_states, value_states
        return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]


def _encoder_decoder(self_cache: _JoiningCache, cross_cache: _JoiningCache) -> Any:
    """An EncoderDecoderCache (isinstance holds, as the module's code asks) over two stand-ins, no layer of
    its cross-attention cache filled yet."""
    from transformers.cache_utils import EncoderDecoderCache
    made = EncoderDecoderCache.__new__(EncoderDecoderCache)
    made.self_attention_cache, made.cross_attention_cache, made.is_updated = self_cache, cross_cache, {}
    return made


def cached_module_spec(cls: type) -> Callable:
    """The spec of one attention class called with a cache: its own forward over a _JoiningCache made from
    the past keys and values it is given; returns the forward's result items (after a None where it returned a
    tuple), then the new keys and values (for an EncoderDecoderCache, the self-attention cache's, then the
    cross-attention cache's; None where the call did not update that one)."""
    fwd = cls.forward

    def own_attention_forward_cached(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        kw = joined(kwargs)
        stand = _JoiningCache(kw.pop(_PAST_K, None), kw.pop(_PAST_V, None))
        cross = _JoiningCache(None, None) if kw.pop(_JOINT, False) else None
        given = stand if cross is None else _encoder_decoder(stand, cross)
        where = kw.pop(_CACHE_KW)  # the cache's keyword, or its position among the arguments
        if isinstance(where, int):
            args = (*args[:where], given, *args[where:])
        else:
            kw[where] = given
        out = fwd(module, *args, **kw)
        new = (stand.new_keys, stand.new_values) + (() if cross is None else (cross.new_keys, cross.new_values))
        # a leading None says the forward returned a tuple: a 1-tuple (xlm's) must not come back as its item
        return (None, *out, *new) if isinstance(out, tuple) else (out, *new)
    own_attention_forward_cached.__name__ = f"{cls.__name__}_forward_cached"
    return _cached_specs.setdefault(cls, own_attention_forward_cached)


_cached_specs: dict[type, Callable] = {}


def _dynamic_layer(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]
                   ) -> tuple[str | int, Any, Any] | None:
    """(keyword or position, cache, layer or None) where the call passes one transformers DynamicCache (not
    offloaded) and this module's layer in it is a plain DynamicLayer or not made yet, or an EncoderDecoderCache
    of two such caches whose cross-attention layer is not filled yet (the layer is the self-attention one's);
    else None."""
    given = [*enumerate(args), *kwargs.items()]
    caches = [(k, v) for k, v in given if type(v).__name__.endswith("Cache")]
    idx = layer_index(module)
    if len(caches) != 1 or idx is None:
        return None
    name, cache = caches[0]
    if type(cache).__name__ == "EncoderDecoderCache":
        self_cache, cross_cache = (getattr(cache, n, None) for n in ("self_attention_cache", "cross_attention_cache"))
        found = _plain_layer(self_cache, idx), _plain_layer(cross_cache, idx)
        if None in found or cache.is_updated.get(idx) or _has_past(found[1][0]):
            return None
        return name, cache, found[0][0]
    found = _plain_layer(cache, idx)
    return None if found is None else (name, cache, found[0])


def _plain_layer(cache: Any, idx: int) -> tuple[Any] | None:
    """(layer or None,) where `cache` is a DynamicCache, not offloaded, whose layer `idx` is a plain
    DynamicLayer or not made yet; else None."""
    if type(cache).__name__ != "DynamicCache" or getattr(cache, "offloading", False):
        return None
    layers = getattr(cache, "layers", None)
    if layers is None:
        return None
    if idx < len(layers):
        return (layers[idx],) if type(layers[idx]).__name__ == "DynamicLayer" else None
    made = getattr(cache, "layer_class_to_replicate", None)
    return (None,) if made is not None and made.__name__ == "DynamicLayer" else None


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


def calls_interface(cls: type) -> bool:
    """Whether the class's forward picks its attention function from the attention interface (its eager
    function can be told): the drop-in serves that call where it is made, with the module's own mask and
    scaling. Routing such a module's whole forward as well would capture the drop-in inside the forward's
    trace, where the module is a stand-in: the capture failed, and the whole forward ran as the spec.
    transformers' model-level flag (`_supports_attention_backend`) is False by default, so it does not
    tell these modules apart: many models that never set it call the interface (wav2vec2, hubert, sew,
    biogpt, jamba, qwen3_next, ...)."""
    from .eager_lookup import from_class
    return from_class(cls).fn is not None


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The innermost modules named as attention (transformers' classes end in "Attention") that hold
    parameters: the self-attention of a BERT-style block, not the block around it."""
    found = [m for m in model.modules() if type(m).__name__.endswith("Attention") and any(True for _ in m.parameters())]
    inner = set(found)
    for m in found:
        inner -= {c for c in m.modules() if c is not m}
    return [m for m in found if m in inner]


def unservable(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> str | None:
    """Why a routed module's call must run its own forward (the first rule it breaks); None where the compiled
    spec may serve it."""
    if module.training:
        return "the module is in training mode"
    if kwargs.get("output_attentions"):
        return "the call asks for the attention weights"
    odd = sorted({type(a).__name__ for a in (*args, *kwargs.values()) if not _plain(a)})
    if odd:
        layers = sorted({type(x).__name__ for a in (*args, *kwargs.values()) for x in getattr(a, "layers", ())})
        return f"the call passes a {', '.join(odd)}" + (f" of {', '.join(layers)}" if layers else "") + \
            " (only a DynamicCache of DynamicLayers is joined; other objects are not captured)"
    if kwargs.get("use_cache"):
        return "use_cache with no DynamicCache to join"
    return None


def layer_index(module: torch.nn.Module) -> int | None:
    """The cache layer a module updates: its own layer index, or that of the self-attention inside it (git);
    transformers names it layer_idx, and layer_id in GPT-Neo."""
    for m in module.modules():
        for name in ("layer_idx", "layer_id"):
            idx = getattr(m, name, None)
            if isinstance(idx, int) and not isinstance(idx, bool):
                return idx
    return None


def _has_past(layer: Any) -> bool:
    """The layer (a DynamicLayer, or None when not made yet) holds past keys and values of some length."""
    return layer is not None and getattr(layer, "is_initialized", False) and getattr(layer, "keys", None) is not None \
        and layer.keys.dim() == 4 and layer.keys.shape[-2] > 0


# the modules each EncoderDecoderCache has served (its prefill): a later call of one is a decode step
_served_on: "weakref.WeakKeyDictionary[Any, weakref.WeakSet]" = weakref.WeakKeyDictionary()


def _decode_step(mod: torch.nn.Module, route: tuple[str | int, Any, Any], args: tuple, kwargs: dict[str, Any]
                 ) -> bool:
    """A few new tokens (the decode kernel's range) against a layer that holds past keys already. With an
    EncoderDecoderCache, a module's second call on it: the layer a cross-attention call sees filled is the
    self-attention's of the same pass, and the query count read below is the batch on sequence-first inputs
    (fsmt)."""
    from ..lower.tiles import DECODE_MAX_QUERIES
    if type(route[1]).__name__ == "EncoderDecoderCache":
        return mod in _served_on.get(route[1], ())
    if not _has_past(route[2]):
        return False
    first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.dim() >= 2), None)
    return first is not None and first.shape[-2] <= DECODE_MAX_QUERIES


def _without(route: tuple[str | int, Any, Any], args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict]:
    """The call's arguments without its cache."""
    where = route[0]
    if isinstance(where, int):
        return args[:where] + args[where + 1:], kwargs
    return args, {k: v for k, v in kwargs.items() if k != where}


def _serve_cached(mod: torch.nn.Module, spec: Callable, args: tuple, kwargs: dict[str, Any],
                  route: tuple[str | int, Any, Any]) -> Any:
    """A call with a DynamicCache or an EncoderDecoderCache (`args` and `kwargs` without it: _without): the
    compiled cached spec on the layer's past keys and values, then the real caches updated with the new ones by
    their own code."""
    name, cache, layer = route
    joint = type(cache).__name__ == "EncoderDecoderCache"
    kw = dict(kwargs)
    if _has_past(layer):
        kw[_PAST_K], kw[_PAST_V] = layer.keys, layer.values
    kw[_CACHE_KW] = name
    if joint:
        kw[_JOINT] = True
    c = _compiled_cached.get(mod)
    if c is None:
        c = _compiled_cached[mod] = compile(spec)
    got = c(mod, *args, **split(kw))
    tupled = got[0] is None  # the forward returned a tuple (cached_module_spec)
    *out, new_k, new_v = got[1:] if tupled else got
    idx = layer_index(mod)
    if not joint:
        cache.update(new_k, new_v, idx)
    else:
        _served_on.setdefault(cache, weakref.WeakSet()).add(mod)
        (*out, self_k, self_v), cross_k, cross_v = out, new_k, new_v
        if self_k is not None:
            cache.self_attention_cache.update(self_k, self_v, idx)
        if cross_k is not None:  # as the module's own forward does after filling it
            cache.cross_attention_cache.update(cross_k, cross_v, idx)
            cache.is_updated[idx] = True
    # a module that returns its cache (led) hands back the real one, never the spec's stand-in
    out = [cache if _stand_in(x) else x for x in out]
    return tuple(out) if tupled else out[0]


def _stand_in(x: Any) -> bool:
    """A cache cached_module_spec made for the spec to see."""
    return isinstance(x, _JoiningCache) or (type(x).__name__ == "EncoderDecoderCache"
                                           and isinstance(getattr(x, "self_attention_cache", None), _JoiningCache))


# why routed modules ran their own forward: {class name: Counter(reason)}, for explain and the survey
own_forward_calls: dict[str, "collections.Counter[str]"] = {}


def _own_call(mod: torch.nn.Module, own: Callable, args: tuple, kwargs: dict[str, Any], reason: str) -> Any:
    own_forward_calls.setdefault(type(mod).__name__, collections.Counter())[reason] += 1
    return own(mod, *args, **kwargs)


def _plain(x: Any) -> bool:
    if isinstance(x, (tuple, list)):
        return all(_plain(i) for i in x)
    return isinstance(x, _PLAIN)


def serve_own_attention(model: torch.nn.Module, interface_served: bool = False) -> int:
    """Route each attention module of `model` through its compiled forward (see the module docstring);
    the number of modules routed. Calling it again is a no-op for modules already routed. With
    `interface_served` (the model's attention interface is the drop-in), a module whose forward calls the
    interface is left alone: the drop-in serves that call (calls_interface)."""
    n = 0
    for m in attention_modules(model):
        if "forward" in vars(m):  # routed already, or a forward set by someone else: left alone
            continue
        if interface_served and calls_interface(type(m)):
            continue
        spec = module_spec(type(m))
        own = type(m).forward

        def forward(*args: Any, _m: Any = weakref.ref(m), _spec: Callable = spec, _own: Callable = own,
                    **kwargs: Any) -> Any:
            mod = _m()
            if torch.compiler.is_compiling():
                return _own(mod, *args, **kwargs)
            route = _dynamic_layer(mod, args, kwargs)
            if route is not None and not CACHED_DECODE and _decode_step(mod, route, args, kwargs):
                return _own_call(mod, _own, args, kwargs, "a decode step against a cache (CACHED_DECODE off)")
            if route is not None:
                a, kw = _without(route, args, kwargs)
                if unservable(mod, a, {k: v for k, v in kw.items() if k != "use_cache"}) is None:
                    return _serve_cached(mod, cached_module_spec(type(mod)), a, kw, route)
            why = unservable(mod, args, kwargs)
            if why is not None:
                return _own_call(mod, _own, args, kwargs, why)
            c = _compiled.get(mod)
            if c is None:
                c = _compiled[mod] = compile(_spec)
            return c(mod, *args, **split(kwargs))
        m.forward = forward
        n += 1
    return n


def tables() -> list[CompiledAttention]:
    """The compiled forward of every routed module that has been called, with a cache and without."""
    return _compiled.values() + _compiled_cached.values()
