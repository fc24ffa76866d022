"""A drop-in attention implementation for Hugging Face transformers.

    import torch_cubridge.integrations.transformers as tcx
    tcx.register()                                   # adds "cubridge" to AttentionInterface
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="cubridge")
    tcx.register_continuous_batching()               # generate_batch of models loaded with "eager"

Each attention module is served by its own model file's `eager_attention_forward`
(so softcaps, sinks and scalings are exactly the model's), compiled with
@torch_cubridge.compile into a table of its own: a table shared by every layer
needs two programs (prefill, decode) per layer and runs out of room at 16
layers. What cannot be compiled runs eager.
"""
from __future__ import annotations

import functools
import inspect
import sys
import weakref
from typing import Any, Callable

import torch

from ..compile import CompiledAttention, compile
from . import eager_lookup
from .module_table import ModuleTable
from .own_attention import has_own_attention, serve_own_attention

NAME = "cubridge"
# an entry dies with its module (the table holds its module only weakly)
_compiled: ModuleTable[CompiledAttention] = ModuleTable("dropin")


_eager_fns: ModuleTable[Callable] = ModuleTable("dropin_eager")  # the eager function each module's call resolved


def _eager_for(module: torch.nn.Module, caller: Any = None) -> Callable:
    """The function `module` calls under "eager": the attention lookup of the code that called the drop-in
    (`caller`, its frame), repeated with "eager" (eager_lookup.py); where that code has no lookup (a wrapper
    called us), the lookup of the forward bound on the module's class. Never a guess: where neither tells
    one function, a ValueError says why."""
    known = _eager_fns.get(module)
    if known is not None:
        return known
    if torch.compiler.is_compiling():  # no frame to read while tracing: the class's, worked out at the model's build
        known = _class_eager_fns.get(module)
        if known is None:
            raise ValueError(f"cubridge: {type(module).__name__} was built outside a model loaded with 'cubridge' "
                             "and first called under torch.compile: call it once eagerly first")
        return known
    found = eager_lookup.from_frame(caller) if caller is not None else None
    if found is None or not found.lookups:  # the calling code dispatches nothing: the class's forward may
        found = eager_lookup.from_class(type(module))
    if found.fn is None:
        raise ValueError(f"cubridge cannot tell which attention function {type(module).__name__} runs under "
                         f"'eager' ({found.reason}); load the model with attn_implementation='eager'")
    _eager_fns[module] = found.fn
    return found.fn


# the eager function of each attention module's class, for a first call under torch.compile (no frame to read)
_class_eager_fns: ModuleTable[Callable] = ModuleTable("dropin_class_eager")


def _note_class_eager(model: torch.nn.Module) -> None:
    """Each module of a model built for the drop-in whose class's forward looks up the attention interface:
    the function that lookup gives for "eager", kept for a first call under torch.compile."""
    for m in model.modules():
        found = eager_lookup.from_class(type(m)) if eager_lookup.names_interface(type(m)) else None
        if found is not None and found.fn is not None:
            _class_eager_fns[m] = found.fn


def eager_function(cls: type) -> Callable:
    """The eager attention function the class's own forward falls back to: its attention-interface lookup
    repeated with "eager", names resolved where forward is defined (llama4's vision attention falls back
    to `vision_eager_attention_forward`, phi4's vision attention to `simple_eager_attention_forward`)."""
    found = eager_lookup.from_class(cls)
    if found.fn is None:
        raise ValueError(f"no eager attention function for {cls.__name__}: {found.reason}")
    return found.fn


_building: Any = None  # a pipeline.BuildRecord while build_model_ahead runs: calls build kernels, then run eager


# continuous batching's bookkeeping, which the paged cache reads and the attention maths does not
_CB_KWARGS = ("cache", "read_index", "write_index", "block_table", "cu_seq_lens_q", "cu_seq_lens_k",
              "max_length_q", "max_length_k", "logits_indices", "logits_processor_args", "k_cache", "v_cache")


_PAGED_MARKS = frozenset(("cu_seq_lens_q", "read_index", "block_table"))  # any of them: a paged call


@functools.lru_cache(maxsize=None)
def _update_takes_kwargs(cache_type: type) -> bool:
    return "kwargs" in inspect.signature(cache_type.update).parameters


def _from_paged_cache(module: torch.nn.Module, key: torch.Tensor, value: torch.Tensor, mask: Any,
                      kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, Any, dict[str, Any]]:
    """Continuous batching (generate_batch, ContinuousBatchingManager) passes the new keys and values
    and its paged cache: the cache takes them and gives back every key and value of the packed
    sequences, the eager contract ("paged|eager"); the mask it built keeps each sequence to its own.
    transformers 5.2x's cache takes the kwargs and returns [1, Hkv, S, D]; 5.17's takes the read and
    write indices and returns [S, Hkv, D], with the masks in a dict by layer type; 5.24 passes no cache,
    the keys and values being every key already. The bookkeeping kwargs (lengths that change every step)
    are dropped: the eager function does not read them, and as Python values they would pin a program."""
    cache = kwargs.get("cache")
    paged = cache is not None and type(cache).__name__ == "PagedAttentionCache"
    if not paged and _PAGED_MARKS.isdisjoint(kwargs):
        return key, value, mask, kwargs
    kwargs = dict(kwargs)
    if paged and _update_takes_kwargs(type(cache)):
        key, value = cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx, kwargs=kwargs)
    elif paged:
        key, value = cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx,
                                  read_index=kwargs["read_index"], write_index=kwargs["write_index"])
        key, value = key.transpose(0, 1).unsqueeze(0), value.transpose(0, 1).unsqueeze(0)
    if isinstance(mask, dict):
        window = getattr(module, "sliding_window", 1)
        mask = mask["full_attention" if window in (1, None) else "sliding_attention"]
    if kwargs.get("block_table") is not None:  # the flash contract: keys left in the pages, no mask
        raise ValueError("continuous batching's block-table (flash) contract is not served by cubridge; "
                         "register it as 'paged|eager' (register_continuous_batching)")
    return key, value, mask, {k: v for k, v in kwargs.items() if k not in _CB_KWARGS}


_compiled_causal: ModuleTable[CompiledAttention] = ModuleTable("dropin_causal")


_causal_specs: dict[Callable, Callable] = {}


def causal_spec(eager: Callable) -> Callable:
    """The model's eager function under the causal mask that a None mask stands for.

    The mask function registered with the drop-in skips the mask where transformers' SDPA path does
    (no padding, and a prefill whose causal pattern is torch's top-left one), and a None mask then
    means what it means to SDPA: causal (top-left) for more than one query of a causal module. This
    spec builds that mask from the positions, as eager's mask would hold it (0 and finfo.min), so the
    program reads no mask tensor and the kernel skips the masked tiles."""
    def causal_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                                 value: torch.Tensor, attention_mask: None, **kwargs: Any):
        i = torch.arange(query.shape[-2], device=query.device)
        j = torch.arange(key.shape[-2], device=query.device)
        zero = torch.zeros((), dtype=query.dtype, device=query.device)
        mask = torch.where(j[None, :] <= i[:, None], zero, torch.finfo(query.dtype).min)
        return eager(module, query, key, value, mask[None, None], **kwargs)
    causal_attention_forward.__name__ = f"causal_{getattr(eager, '__name__', 'attention')}"
    return _causal_specs.setdefault(eager, causal_attention_forward)  # one per eager function: memos key on it


def _is_causal_call(module: torch.nn.Module, query: torch.Tensor, mask: Any, kwargs: dict[str, Any]) -> bool:
    """SDPA's reading of a call (transformers' sdpa_attention_forward): a None mask is causal for
    more than one query where the call or the module says the attention is causal; and, as eager reads
    it, only where that None stands for a causal mask skipping_mask skipped for the module's config. A
    None the model passes itself (phi4's vision attention says is_causal but builds no mask) is no mask
    at all to eager, whatever the module says."""
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else causal
    if mask is not None or query.shape[-2] <= 1 or not causal:
        return False
    config = getattr(module, "config", None)
    return config is None or _skipped_for(config)  # a module without a config: SDPA's reading alone


# id(config) -> a weak reference to each config skipping_mask skipped a causal mask for
_causal_skips: dict[int, Any] = {}


def _skipped_for(config: Any) -> bool:
    ref = _causal_skips.get(id(config))
    return ref is not None and ref() is config


def cubridge_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                               value: torch.Tensor, attention_mask: torch.Tensor | None, **kwargs: Any):
    key, value, attention_mask, kwargs = _from_paged_cache(module, key, value, attention_mask, kwargs)
    causal = _is_causal_call(module, query, attention_mask, kwargs)
    if _building is not None:
        return _build_call(module, query, key, value, attention_mask, causal, sys._getframe(1), **kwargs)
    table = _compiled_causal if causal else _compiled
    c = table.get(module)
    if c is None:
        # the caller's frame: the module code whose attention lookup gave it this function
        eager = _eager_for(module, None if torch.compiler.is_compiling() else sys._getframe(1))
        fn = causal_spec(eager) if causal else eager
        if torch.compiler.is_compiling():
            # no eager call verified a kernel for this kind of call (under torch.compile transformers
            # builds the mask that an eager call without padding skips): the trace takes the spec
            out, _ = fn(module, query, key, value, attention_mask, **kwargs)
            return out, None
        c = table[module] = compile(fn)
    out, _ = c(module, query, key, value, attention_mask, **kwargs)
    return out, None


def tables(module: torch.nn.Module | None = None) -> list[CompiledAttention]:
    """The compiled tables of one attention module, or of every module: one for calls with a mask
    and one for causal calls without (causal_spec)."""
    if module is not None:
        return [t[module] for t in (_compiled, _compiled_causal) if module in t]
    return _compiled.values() + _compiled_causal.values()


def table_items() -> list[tuple[torch.nn.Module, CompiledAttention]]:
    return _compiled.items() + _compiled_causal.items()


def clear_tables() -> None:
    _compiled.clear()
    _compiled_causal.clear()


_own_attention_types: set[str] = set()  # model types whose attention code is their own (own_attention.py)


@functools.lru_cache(maxsize=None)
def _sdpa_mask() -> Callable:
    from transformers.masking_utils import sdpa_mask
    return sdpa_mask


def skipping_mask(*args: Any, dtype: torch.dtype = torch.float32, **kwargs: Any) -> torch.Tensor | None:
    """eager's 4-D float mask, or None where transformers' SDPA mask is None (the caller allows the
    causal skip, no token is padded, and the pattern is torch's causal one: see causal_spec). A model
    whose attention code is its own reads the mask itself (mpt: `create_causal_mask(...).to(torch.bool)`),
    so it always gets eager's."""
    # once a forward, on the decode step's host path: no import statement, no config read unless needed
    if _own_attention_types and getattr(kwargs.get("config"), "model_type", None) in _own_attention_types:
        from transformers.masking_utils import eager_mask
        return eager_mask(*args, dtype=dtype, **kwargs)
    kwargs.setdefault("allow_is_causal_skip", True)
    mask = _sdpa_mask()(*args, **kwargs)
    if mask is None and kwargs["allow_is_causal_skip"] and not kwargs.get("allow_is_bidirectional_skip"):
        _mark_causal_skip(kwargs.get("config"))
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.where(mask, torch.zeros((), device=mask.device, dtype=dtype), torch.finfo(dtype).min)


def _mark_causal_skip(config: Any) -> None:
    if config is not None and not _skipped_for(config):
        key = id(config)
        _causal_skips[key] = weakref.ref(config, lambda _, key=key: _causal_skips.pop(key, None))


def register(name: str = NAME) -> str:
    """Register the implementation under `name` in transformers' AttentionInterface, and its mask.

    The model's eager function adds the mask to the scores, so it needs the additive float mask
    transformers builds for "eager" (causal, sliding windows, padding). Without a mask function
    registered under the same name, transformers passes None (no causal mask at all) or a bool mask.
    """
    from transformers import AttentionInterface
    AttentionInterface.register(name, cubridge_attention_forward)
    _own_tables_run_eager(name)
    _class_eager_at_post_init(name)
    try:
        from transformers import AttentionMaskInterface
        from transformers.masking_utils import eager_mask
    except ImportError:  # transformers before masking_utils builds eager's 4-D mask for any name
        return name
    from transformers.masking_utils import sdpa_mask
    # a transformers whose sdpa_mask cannot skip keeps eager's mask (every call reads it as data)
    skips = "allow_is_causal_skip" in inspect.signature(sdpa_mask).parameters
    AttentionMaskInterface.register(name, skipping_mask if skips else eager_mask)
    return name


def _own_tables_run_eager(name: str) -> None:
    """Models that pick an attention class from a table of their own (falcon, gptj, gpt_neo:
    `FALCON_ATTENTION_CLASSES[config._attn_implementation]`) raised KeyError for `name`. When such a
    model is built, its file's tables get `name` -> their "eager" class. A model whose attention code
    is its own (no attention interface: bloom, mpt, falcon, git, ...) has its attention modules routed
    through their compiled forward at its first call (integrations/own_attention.py)."""
    from transformers import PreTrainedModel
    init = PreTrainedModel.__init__
    if getattr(init, "_cubridge_names", None) is not None:
        init._cubridge_names.add(name)
        return

    def __init__(self, config, *args, **kwargs):
        init(self, config, *args, **kwargs)
        if getattr(config, "_attn_implementation", None) in __init__._cubridge_names:
            for attr, table in vars(sys.modules.get(type(self).__module__, object)).items():
                if attr.endswith("_ATTENTION_CLASSES") and isinstance(table, dict) and "eager" in table:
                    for n in __init__._cubridge_names:
                        table.setdefault(n, table["eager"])
            if has_own_attention(self):  # its modules exist only after the subclass's __init__: route at the first call
                self._cubridge_route = self.register_forward_pre_hook(_route_own_attention)
                _own_attention_types.add(getattr(config, "model_type", ""))
    __init__._cubridge_names = {name}
    __init__.__wrapped__ = init
    PreTrainedModel.__init__ = __init__


def _class_eager_at_post_init(name: str) -> None:
    """A model's modules exist once its __init__ has built them, which transformers ends with post_init:
    there, a model built for `name` has its attention modules' class lookups worked out (_note_class_eager)."""
    from transformers import PreTrainedModel
    post = PreTrainedModel.post_init
    if getattr(post, "_cubridge_names", None) is not None:
        post._cubridge_names.add(name)
        return

    @functools.wraps(post)
    def post_init(self, *args, **kwargs):
        out = post(self, *args, **kwargs)
        if getattr(getattr(self, "config", None), "_attn_implementation", None) in post_init._cubridge_names:
            _note_class_eager(self)
        return out
    post_init._cubridge_names = {name}
    PreTrainedModel.post_init = post_init


def _route_own_attention(model: torch.nn.Module, args: Any) -> None:
    model._cubridge_route.remove()
    serve_own_attention(model, interface_served=True)  # the drop-in serves the modules that call the interface


PAGED_NAME = "paged|eager"  # a name continuous batching accepts (with "sdpa" and flash ones)


def register_continuous_batching(name: str = PAGED_NAME) -> str:
    """Serve transformers' continuous batching (generate_batch, ContinuousBatchingManager, `transformers
    serve`) through cubridge. Continuous batching accepts only "paged|eager", "sdpa" or a flash name, and
    switches a model loaded with "eager" to "paged|eager": registering there makes every such model's
    batched generation call the compiled attention, which takes the paged cache's keys and values and
    the mask continuous batching builds (packed sequences, each attending to its own). Replaces
    transformers' own "paged|eager" function in this process."""
    from transformers import AttentionInterface
    AttentionInterface.register(name, cubridge_attention_forward)
    return name


# ---- ahead of time: every attention variant of a model, from its config -------------------------


def _build_call(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, causal: bool, caller: Any, **kwargs: Any):
    """Build mode: verify this call's spec and build its kernels into the cache, then compute it eager."""
    assert _building is not None
    eager = _eager_for(module, caller)
    fn = causal_spec(eager) if causal else eager
    args = (module, query, key, value, attention_mask)
    _building.call(fn, args, kwargs, f"layer {getattr(module, 'layer_idx', '?')}",
                   layer=getattr(module, "layer_idx", None), queries=query.shape[-2])
    return fn(*args, **kwargs)


_FFN = ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size")
_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts")


def small_config(cfg: Any) -> Any:
    """The config with its attention as it is and the rest shrunk: one layer per distinct layer type
    (`layer_types`; else two layers), feed-forward width 64, at most two experts, a 256-token
    vocabulary. Attention calls (heads, head dim, windows, sinks, scaling) are the model's own."""
    import copy
    cfg = copy.deepcopy(cfg)
    types = list(getattr(cfg, "layer_types", None) or [])
    if types:
        first = [types.index(t) for t in dict.fromkeys(types)]
        try:
            cfg.layer_types = [types[i] for i in first]
            cfg.num_hidden_layers = len(first)
        except AttributeError:  # types derived from other fields (jamba's periods): the first layers up to
            # each type's first layer
            cfg.num_hidden_layers = max(first) + 1
    else:
        cfg.num_hidden_layers = min(getattr(cfg, "num_hidden_layers", 2), 2)
    for name in _FFN:
        if isinstance(getattr(cfg, name, None), int):
            setattr(cfg, name, min(getattr(cfg, name), 64))
    for name in _EXPERTS:
        if isinstance(getattr(cfg, name, None), int):
            setattr(cfg, name, min(getattr(cfg, name), 2))
    if isinstance(getattr(cfg, "num_experts_per_tok", None), int):
        cfg.num_experts_per_tok = min(cfg.num_experts_per_tok, 2)
    if isinstance(getattr(cfg, "vocab_size", None), int):
        cfg.vocab_size = min(cfg.vocab_size, 256)
        for tok in ("pad_token_id", "bos_token_id", "eos_token_id"):
            t = getattr(cfg, tok, None)
            if isinstance(t, int) and t >= cfg.vocab_size:
                setattr(cfg, tok, None)
    return cfg


def build_model_ahead(path: str, arch: str, batch: int, seq: int, queries: int, dtype: torch.dtype,
                      progress: Callable[[str], None]) -> dict[str, list]:
    """Every attention variant a causal LM's forward calls (prefill at [batch, seq]; with `queries`,
    then a decode step of that many tokens on the prefill's cache) verified on the CPU and its
    kernels built for `arch` into the disk cache, from the model's config alone (a directory with
    config.json, or the file): no weights, no GPU. Returns {"built": [...], "refused": [...]}."""
    global _building
    from ..pipeline import BuildRecord
    register()
    cfg, model = small_model(path, NAME, dtype, progress)
    _building = BuildRecord(arch, progress)
    try:
        with torch.no_grad():
            ids = torch.randint(0, cfg.vocab_size, (batch, seq))
            out = model(ids, use_cache=bool(queries))
            if queries:
                model(ids[:, :queries], **kv_cache(model, out), use_cache=True)
        return _building.result()
    finally:
        _building = None


def kv_cache(model: torch.nn.Module, out: Any) -> dict[str, Any]:
    """A forward's KV cache as the keyword `model`'s forward takes: `cache` where it has one (the old
    name, past_key_values, then warns FutureWarning from our own call), else past_key_values."""
    if "cache" in inspect.signature(model.forward).parameters:
        return {"cache": out.cache}
    return {"past_key_values": out.past_key_values}


def small_model(path: str, attn_implementation: str, dtype: torch.dtype, progress: Callable[[str], None],
                what: str = "") -> tuple[Any, torch.nn.Module]:
    """(config, model) of a causal LM's small_config from `path` (config.json alone: random weights), eval."""
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = small_config(AutoConfig.from_pretrained(path))
    progress(f"{type(cfg).__name__}: {cfg.num_hidden_layers} layer(s) of distinct attention{what}")
    return cfg, AutoModelForCausalLM.from_config(cfg, attn_implementation=attn_implementation, dtype=dtype).eval()
