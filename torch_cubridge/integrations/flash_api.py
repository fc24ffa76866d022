"""The flash-attention API (`flash_attn_func`, `flash_attn_varlen_func`, `flash_attn_with_kvcache`) served by
cubridge, and its registration in transformers as a flash implementation.

transformers' flash path (and continuous batching's block-table decode, which it takes only for a flash
implementation) calls whatever functions its loader holds for the model's implementation name; a Hub
kernel is loaded through the `kernels` package. These functions are ours instead: each is a spec in plain
PyTorch compiled with @torch_cubridge.compile, so every call is served by a verified kernel or, where none
holds, by the spec (flash_specs.py). The block-table call writes the new keys and values into their pages
(one launch, ops/append.py, or PyTorch; it does not touch the scores) and then runs the paged decode spec,
whose gathers the decode kernel reads in place.

    import torch_cubridge.integrations.flash_api as tfa
    name = tfa.register()   # "cubridge_flash3": a flash name continuous batching takes, block tables included
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation=name)
    model.generate_batch(...)
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

import torch

from ..compile import compile
from ..ops.append import paged_append
from .flash_specs import dense_attention, paged_decode_attention, varlen_attention

NAME = "cubridge_flash3"  # continuous batching's block-table path needs "flash" then a 2 or a 3 in the name


_dense = compile(dense_attention)
_varlen = compile(varlen_attention)
_paged_decode = compile(paged_decode_attention)


_building: Any = None  # a pipeline.BuildRecord while build_model_ahead runs: calls build kernels, then run the spec
_decode_calls: dict[tuple, Any] = {}  # while building: the block-table decodes the model's layers will make


def _serve(c: Any, *args: Any) -> torch.Tensor:
    if _building is None:
        return c(*args)
    return _build_call(c.fn, args)


def compiled() -> dict[str, Any]:
    """The three compiled specs, by name (their tables tell what served each call)."""
    return {"dense": _dense, "varlen": _varlen, "paged_decode": _paged_decode}


# ---- the flash-attention API over them ---------------------------------------------------------------


def _common(q: torch.Tensor, dropout_p: float, softmax_scale: float | None, window_size: Any,
            softcap: float | None, unused: dict[str, Any]) -> tuple[float, int, int, float]:
    # flash-attn's other options (alibi_slopes, rotary_cos, return_attn_probs, ...) change the answer when
    # set: refused, never ignored (transformers passes only the options these signatures name)
    set_ = [k for k, v in unused.items() if v is not None and not (isinstance(v, (bool, int, float)) and not v)]
    if set_:
        raise NotImplementedError(f"cubridge's flash API does not take {', '.join(sorted(set_))}")
    if dropout_p:
        raise NotImplementedError("cubridge's flash API has no dropout (inference only)")
    scale = float(softmax_scale) if softmax_scale is not None else q.shape[-1] ** -0.5
    left, right = (int(w) for w in (window_size if window_size is not None else (-1, -1)))
    return scale, left, right, float(softcap or 0.0)


def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                    softmax_scale: float | None = None, causal: bool = False, window_size: Any = (-1, -1),
                    softcap: float = 0.0, s_aux: torch.Tensor | None = None, deterministic: bool = False,
                    **unused: Any) -> torch.Tensor:
    """q [B, Sq, H, D], k and v [B, Skv, Hkv, D]; causal aligned bottom-right, as flash-attention 2.1 and up."""
    scale, left, right, cap = _common(q, dropout_p, softmax_scale, window_size, softcap, unused)
    return _serve(_dense, q, k, v, scale, bool(causal), left, right, cap, s_aux)


def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int | None = None,
                           max_seqlen_k: int | None = None, dropout_p: float = 0.0,
                           softmax_scale: float | None = None, causal: bool = False, window_size: Any = (-1, -1),
                           softcap: float = 0.0, s_aux: torch.Tensor | None = None, deterministic: bool = False,
                           **unused: Any) -> torch.Tensor:
    """Packed sequences: q [Tq, H, D], k and v [Tk, Hkv, D], int32 cumulative lengths (max_seqlen_* unused)."""
    scale, left, right, cap = _common(q, dropout_p, softmax_scale, window_size, softcap, unused)
    return _serve(_varlen, q, k, v, cu_seqlens_q, cu_seqlens_k, scale, bool(causal), left, right, cap, s_aux)


def _append(cache: torch.Tensor, new: torch.Tensor, block_table: torch.Tensor, pos: torch.Tensor) -> None:
    """Write new [B, 1, Hkv, D] at position pos[b] of each sequence's pages with PyTorch, in place and without
    a sync (so a CUDA graph can hold it), where ops/append.py's one launch does not take the call. A sequence
    with no position (padding: pos < 0) writes nothing: its write goes to the first real sequence's slot with
    that sequence's own value (or, where none is real, puts a slot's value back), since two different values
    at one slot would race."""
    N, P = cache.shape[0], cache.shape[1]
    rows = cache.view(N * P, *cache.shape[2:])
    real = pos >= 0
    at = pos.clamp(min=0)
    page = block_table.gather(1, (at // P)[:, None].long())[:, 0].long() % N  # negative entries wrap, as torch's
    slot = page * P + at % P
    first = torch.argmax(real.int()).view(1)  # indexing by a tensor, not by its value: no sync
    slot_0 = slot.index_select(0, first)
    slot = torch.where(real, slot, slot_0)
    value_0 = torch.where(real.index_select(0, first)[:, None, None], new[:, 0].index_select(0, first),
                          rows.index_select(0, slot_0))
    value = torch.where(real[:, None, None], new[:, 0], value_0)
    rows.index_copy_(0, slot, value.to(cache.dtype))


def flash_attn_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            k: torch.Tensor | None = None, v: torch.Tensor | None = None,
                            cache_seqlens: torch.Tensor | int | None = None, block_table: torch.Tensor | None = None,
                            softmax_scale: float | None = None, causal: bool = False, window_size: Any = (-1, -1),
                            softcap: float = 0.0, s_aux: torch.Tensor | None = None, **unused: Any) -> torch.Tensor:
    """Decode over a paged cache: q [B, 1, H, D], pages [N, P, Hkv, D], block_table [B, W]; k and v [B, 1, Hkv,
    D] are appended at cache_seqlens[b] first, then each query attends to its sequence's keys up to its own."""
    if block_table is None or q.shape[1] != 1 or cache_seqlens is None:
        raise NotImplementedError("cubridge's flash_attn_with_kvcache serves paged decode: a block table, "
                                  "one query per sequence and cache_seqlens")
    if (k is None) != (v is None):
        raise ValueError("flash_attn_with_kvcache appends k and v together: give both or neither")
    scale, left, _, cap = _common(q, 0.0, softmax_scale, window_size, softcap, unused)
    if not isinstance(cache_seqlens, torch.Tensor):
        cache_seqlens = torch.full((q.shape[0],), int(cache_seqlens), dtype=torch.int32, device=q.device)
    if k is not None:
        if not paged_append(k_cache, v_cache, k, v, block_table, cache_seqlens):
            _append(k_cache, k, block_table, cache_seqlens)
            _append(v_cache, v, block_table, cache_seqlens)
    # the appended row is counted by the kernel's mask: no launch adds one to cache_seqlens
    return _serve(_paged_decode, q, k_cache, v_cache, block_table, cache_seqlens, scale, left, cap, s_aux,
                  int(k is not None))


# ---- transformers ------------------------------------------------------------------------------------


def _functions() -> tuple[Callable, Callable, Callable, Callable, Callable]:
    import transformers.modeling_flash_attention_utils as fau
    return flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache, fau._pad_input, fau._unpad_input


def _paged_forward(fau: Any) -> Callable | None:
    """transformers' attention function for "paged|<flash name>" where continuous batching calls that name
    (5.17: `integrations/flash_paged.py`, which takes the flash functions from the same loader); None where the
    flash path itself takes the block table (5.24), which continuous batching then calls under the name itself."""
    forward = getattr(fau, "_flash_attention_forward", None)
    if forward is not None and "block_table" in inspect.signature(forward).parameters:
        return None
    try:
        from transformers.integrations.flash_paged import paged_attention_forward
    except ImportError:
        return None
    return paged_attention_forward


def register(name: str = NAME) -> str:
    """Register these functions in transformers as the flash implementation `name`: its flash attention
    function runs them, and continuous batching (generate_batch, ContinuousBatchingManager) takes its
    packed-query and block-table paths through them, under `name` (transformers 5.24) or "paged|" + name
    (5.17, which switches a flash model to that name). transformers loads a flash implementation other than the
    flash-attn packages from the Hub (the `kernels` package); for these names its loader returns ours instead."""
    import transformers
    import transformers.modeling_flash_attention_utils as fau
    from transformers import AttentionInterface
    from transformers.integrations.flash_attention import flash_attention_forward
    from transformers.utils.generic import is_flash_attention_requested
    if not is_flash_attention_requested(requested_attention_implementation=name):
        raise ValueError(f"transformers treats a name as flash only where it holds 'flash'; got {name!r}")
    if not hasattr(fau, "_lazy_imports"):
        raise RuntimeError(f"transformers {transformers.__version__} has no flash loader to register with")
    loader = fau._lazy_imports
    names = getattr(loader, "_cubridge_names", None)
    if names is None:
        names = set()

        def _lazy_imports(implementation: str | None, *args: Any, **kwargs: Any):
            if implementation in names:
                return _functions()
            return loader(implementation, *args, **kwargs)
        _lazy_imports._cubridge_names = names  # type: ignore[attr-defined]
        fau._lazy_imports = _lazy_imports
    names.add(name)
    AttentionInterface.register(name, flash_attention_forward)
    paged = _paged_forward(fau)
    if paged is not None:  # no mask is registered for it: transformers then builds none, as flash wants
        names.add("paged|" + name)
        AttentionInterface.register("paged|" + name, paged)
    try:
        from transformers import AttentionMaskInterface
        from transformers.masking_utils import flash_attention_mask
        AttentionMaskInterface.register(name, flash_attention_mask)
    except ImportError:
        pass
    return name


def allow_for(model_class: type, name: str = NAME) -> None:
    """Let a model class that lists the flash implementations it takes (`_compatible_flash_implementations`:
    gpt_oss, granite_swa, flint, ...) take `name` too; transformers otherwise switches it to the first listed, a
    Hub kernel. Only for a model whose flash calls use what these functions implement (scale, causal, windows,
    softcap, sinks): a model that lists kernels for attention of another kind would get a wrong answer."""
    listed = getattr(model_class, "_compatible_flash_implementations", None)
    if listed is not None and name not in listed:
        model_class._compatible_flash_implementations = [*listed, name]


# ---- ahead of time: the flash API's kernels for a model, from its config -------------------------------


def _build_call(spec: Callable, args: tuple) -> torch.Tensor:
    """Build mode: verify this call's spec on the CPU and build its kernels into the cache, then compute it."""
    assert _building is not None
    a = inspect.signature(spec).bind(*args).arguments
    q, k = a["q"], args[1]
    if spec is not paged_decode_attention:  # the paged decode the same layer's steps would take
        key = (q.shape[-2], k.shape[-2], q.shape[-1], q.dtype, a["scale"], a["softcap"])
        _decode_calls.setdefault(key, a["sinks"])
    _building.call(spec, args, {}, spec.__name__, function=spec.__name__,
                   queries=q.shape[1] if q.dim() == 4 else q.shape[0])
    return spec(*args)


def _page_size() -> int:
    """The page size of transformers' continuous batching by default (`page_size`, `block_size` in 5.17): a
    block-table decode program is held at its page size (the pool's page count and the table's width are
    free), so the programs built ahead are made at it."""
    try:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
        c = ContinuousBatchingConfig()
        return int(getattr(c, "page_size", None) or getattr(c, "block_size", None) or 256)
    except Exception:  # a transformers without continuous batching: its default in 5.17 and 5.24
        return 256


def _decode_examples(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, scale: float, softcap: float,
                     sinks: torch.Tensor | None) -> None:
    """Block-table decode calls as continuous batching makes them, at its page size, in build mode: one
    sequence (its own kernel) and two (a program that serves every larger batch too, its views fitted to B;
    the pool's size and the table's width are free)."""
    P = _page_size()
    for B in (1, 2):
        N, W = 4 * B + 1, 4
        q = torch.randn(B, 1, heads, head_dim, dtype=dtype)
        pages = [torch.randn(N, P, kv_heads, head_dim, dtype=dtype) for _ in range(2)]
        new = [torch.randn(B, 1, kv_heads, head_dim, dtype=dtype) for _ in range(2)]
        table = torch.arange(B * W, dtype=torch.int32).view(B, W)
        at = (torch.arange(B, dtype=torch.int32) * 31 + 9) % (W * P - 1)  # lengths that differ
        flash_attn_with_kvcache(q, *pages, *new, cache_seqlens=at, block_table=table, softmax_scale=scale,
                                causal=True, softcap=softcap, s_aux=sinks)


def build_model_ahead(path: str, arch: str, batch: int, seq: int, dtype: torch.dtype,
                      progress: Callable[[str], None], name: str = NAME) -> dict[str, list]:
    """The kernels this API serves a causal LM with through transformers' flash path, verified on the CPU and
    built for `arch` into the disk cache from the model's config alone (no weights, no GPU): the dense
    prefill and decode step of `model.generate`, the packed prefill of a padded batch and of continuous
    batching, continuous batching's block-table decode at the model's heads, scale and softcap, and the
    append kernel. Returns {"built": [...], "refused": [...]}."""
    global _building
    from ..ops.append import build as build_append
    from ..pipeline import BuildRecord
    from .transformers import kv_cache, small_model
    register(name)
    cfg, model = small_model(path, name, dtype, progress, ", flash API")
    _building = BuildRecord(arch, progress)
    _decode_calls.clear()
    try:
        with torch.no_grad():
            ids = torch.randint(0, cfg.vocab_size, (batch, seq))
            out = model(ids, use_cache=True)                                  # dense prefill
            model(ids[:, -1:], **kv_cache(model, out), use_cache=True)  # dense decode step
            padded = torch.ones(2, seq, dtype=torch.long)
            padded[1, : seq // 2] = 0
            model(torch.randint(0, cfg.vocab_size, (2, seq)), attention_mask=padded)  # packed prefill
            for (h, hkv, d, dt, scale, cap), sinks in list(_decode_calls.items()):
                progress(f"block-table decode at {h}:{hkv} heads, head dim {d}")
                _decode_examples(h, hkv, d, dt, scale, cap, sinks)
        progress(f"building the block-table append for {arch}")
        a = build_append(arch)
        _building.built.append({"key": a["key"], "built": a["built"], "seconds": a["seconds"],
                                "kernel": a["kernel"], "function": "append", "queries": 1})
        return _building.result()
    finally:
        _building = None
        _decode_calls.clear()
