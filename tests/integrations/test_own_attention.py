"""Models whose attention code is their own (no attention interface): each attention module's whole
forward is the spec (integrations/own_attention.py). Every routed call transfers, and its program
matches the module's own forward in float64; calls the compiled spec cannot see (a cache object,
weights asked for) run the module's forward."""
import copy
import warnings

import pytest
import torch

import torch_cubridge.integrations.transformers as tcx
from helpers import rel_err
from torch_cubridge.integrations import own_attention as oa

transformers = pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

FAMILIES = ["git", "megatron-bert", "openai-gpt", "xglm", "falcon", "mpt", "trocr", "roformer", "big_bird", "rembert",
            "bloom", "gpt_neox_japanese", "cpmant", "stablelm"]
# stablelm's module calls the attention interface but declares no backend support: routed whole, with GQA
# (its value repeated before P.v: at B 1 a size-1 batch dim once read as a merged axis, and V was made
# repeated while K was read through its group)
_EXTRA = {"stablelm": dict(num_key_value_heads=2)}


def tiny(family: str, attn: str = "eager") -> torch.nn.Module:
    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=256, pad_token_id=None, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **kw, **_EXTRA.get(family, {})),
                                                attn_implementation=attn).eval()


def _first_calls(model: torch.nn.Module, ids: torch.Tensor) -> list:
    calls = []
    hooks = [m.register_forward_pre_hook(lambda m, a, k: calls.append((m, a, dict(k))), with_kwargs=True)
             for m in oa.attention_modules(model)]
    with torch.no_grad():
        model(ids, use_cache=False)
    for h in hooks:
        h.remove()
    return calls


def _to64(x):
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.double()
    if isinstance(x, (tuple, list)):
        return type(x)(_to64(i) for i in x)
    return x


@pytest.mark.parametrize("B", [1, 2])
@pytest.mark.parametrize("family", FAMILIES)
def test_whole_attention_module_transfers_and_matches_fp64(family, B):
    """B = 1 leaves size-1 dims the analysis names by position: MQA's one K head broadcast by an
    expand (falcon), heads packed with the head dim in [1, S, 3*H*D] (mpt)."""
    model = tiny(family)
    ids = torch.randint(0, 128, (B, 24), generator=torch.Generator().manual_seed(0))
    assert oa.has_own_attention(model)
    calls = _first_calls(model, ids)
    assert oa.serve_own_attention(model) == len(oa.attention_modules(model)) > 0
    oa._compiled.clear()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model(ids, use_cache=False)
    tables = oa.tables()
    assert tables and all(e.result is not None for c in tables for e in c.entries()), \
        [e.reason for c in tables for e in c.entries()]
    m, args, kwargs = calls[0]
    prog = oa._compiled[m].entries()[0].result.program
    m64 = copy.deepcopy(m).double()
    with torch.no_grad():
        try:
            ref = oa.module_spec(type(m))(m64, *_to64(args), **_to64(kwargs))
            got = prog.run(m64, *_to64(args), **oa.split(_to64(kwargs)))
        except RuntimeError:  # xglm's torch.full((), finfo(float64).min) overflows float32: judged in float32
            ref = oa.module_spec(type(m))(m, *args, **kwargs)
            got = prog.run(m, *args, **oa.split(kwargs))
    if isinstance(ref, (tuple, list)):
        assert type(got) is type(ref) and len(got) == len(ref)  # a list stays a list: callers add to it
        got, ref = got[0], ref[0]
    assert rel_err(got, ref) < 1e-5


def test_drop_in_name_routes_own_attention_at_the_first_call():
    tcx.register()
    model = tiny("git", tcx.NAME)
    mods = oa.attention_modules(model)
    assert not any("forward" in vars(m) for m in mods)  # routed at the first call, not before
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model(torch.randint(0, 128, (1, 16)), use_cache=False)
    # routed: the modules with attention code of their own; a module that calls the attention interface
    # (git's vision tower) is served by the drop-in at that call instead
    assert {type(m).__name__ for m in mods if "forward" in vars(m)} == \
        {type(m).__name__ for m in mods if not oa.calls_interface(type(m))} != set()
    assert any(oa.calls_interface(type(m)) for m in mods)


def test_calls_the_compiled_spec_cannot_see_run_the_module():
    """Weights asked for are the probabilities the kernel never writes, and a cache other than a
    DynamicCache of plain layers is updated by code the stand-in does not model: both run the module's own
    forward."""
    from transformers import StaticCache
    model = tiny("xglm")
    oa.serve_own_attention(model)
    oa._compiled.clear()
    oa._compiled_cached.clear()
    ids = torch.randint(0, 128, (1, 16))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model(ids, use_cache=False, output_attentions=True)
        assert oa.tables() == []
        static = StaticCache(config=model.config, max_cache_len=32)
        out = model(ids, past_key_values=static, use_cache=True)
        cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)  # renamed in transformers 5.2x
        assert cache is static and cache.get_seq_length() == 16
    assert oa.tables() == []
    # each own-forward call is accounted for, with the rule it broke
    reasons = oa.own_forward_calls[type(oa.attention_modules(model)[0]).__name__]
    assert any("attention weights" in r for r in reasons), reasons
    assert any("StaticCache" in r and "only a DynamicCache" in r for r in reasons), reasons


def test_a_tensor_inside_a_tuple_argument_is_never_baked_in():
    """(cos, sin) passed as one tuple: the trace sees no input there, so a program would hold the first
    call's values. Either the transfer refuses, or the program reads each call's tensors."""
    import torch_cubridge as tc
    from torch_cubridge.errors import UnsupportedSpec

    def rope_attn(q, k, v, cs):
        cos, sin = cs
        q = q * cos + q.flip(-1) * sin
        return torch.softmax(q @ k.transpose(-1, -2) * 0.25, -1) @ v
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    try:
        prog = tc.transfer(rope_attn, q, k, v, (torch.randn(16, 8), torch.randn(16, 8)))
    except UnsupportedSpec as e:
        assert "tuple" in str(e)
        return
    other = (torch.randn(16, 8), torch.randn(16, 8))
    assert rel_err(prog.run(q, k, v, other), rope_attn(q, k, v, other)) < 1e-5


def test_keywords_split_and_joined():
    cs = (torch.zeros(2), torch.ones(2))
    flat = oa.split({"position_embeddings": cs, "mask": None, "n": 3})
    assert set(flat) == {"position_embeddings__item0", "position_embeddings__item1", "mask", "n"}
    back = oa.joined(flat)
    assert back["position_embeddings"][1] is cs[1] and back["n"] == 3 and back["mask"] is None


def _masked_twice(q, k, v, mask, post):
    s = (q @ k.transpose(-1, -2) * 0.25).masked_fill(~mask, float("-inf"))
    return torch.softmax(s, -1).masked_fill(~post, 0.0) @ v


def test_probabilities_zeroed_where_the_scores_were_masked():
    """cpmant's style: the weights are zeroed after the softmax where the scores were filled with -inf.
    Only a row with every key masked changes (NaN to 0, the kernel's empty row); zeroing under another
    mask changes the weights and is refused."""
    import torch_cubridge as tc
    from torch_cubridge.errors import UnsupportedSpec
    q, k, v = (torch.randn(2, 2, 12, 8) for _ in range(3))
    mask = torch.rand(2, 1, 12, 12) > 0.3
    mask[:, :, 4] = False  # a row with every key masked

    def same(q, k, v, mask):
        return _masked_twice(q, k, v, mask, mask)
    prog = tc.transfer(same, q, k, v, mask)
    ref = same(*(t.double() if t.is_floating_point() else t for t in (q, k, v, mask)))
    assert torch.equal(ref[:, :, 4], torch.zeros_like(ref[:, :, 4]))
    assert rel_err(prog.run(q, k, v, mask), ref) < 1e-6

    def other(q, k, v, mask, post):
        return _masked_twice(q, k, v, mask, post)
    with pytest.raises(UnsupportedSpec):
        tc.transfer(other, q, k, v, mask, torch.rand(2, 1, 12, 12) > 0.5)


def _assert_same_generate(model, ref, ids: torch.Tensor, tol: float, **kw) -> None:
    """Greedy generate of both: equal tokens, and each step's logits within `tol` (a tiny model's attention is
    nearly uniform, so tokens alone would not see keys and values joined out of order)."""
    kw = dict(do_sample=False, output_logits=True, return_dict_in_generate=True, **kw)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got, want = model.generate(ids, **kw), ref.generate(ids, **kw)
    assert torch.equal(got.sequences, want.sequences)
    assert all(rel_err(a, b) < tol for a, b in zip(got.logits, want.logits))


CACHED = ["falcon", "bloom", "gpt_neox_japanese", "cpmant", "git", "xglm"]


@pytest.mark.parametrize("family", CACHED)
def test_generate_with_a_dynamic_cache_goes_through_the_cached_spec(family, monkeypatch):
    """generate passes a DynamicCache: each call is the compiled spec over a stand-in cache made from the layer's
    past keys and values, and the real cache is updated with the new ones by its own code. Greedy tokens
    equal a separate copy's (its own code); every call transfers; the program's every result item (the
    output, the new keys and values the real cache takes) matches the spec in fp64 on a decode step."""
    from torch_cubridge.compile import CompiledAttention, Options

    class Recording(CompiledAttention):
        def __call__(self, *args, **kwargs):
            self.last = (args, kwargs)
            return super().__call__(*args, **kwargs)
    monkeypatch.setattr(oa, "compile", lambda fn: Recording(fn, Options()))
    monkeypatch.setattr(oa, "CACHED_DECODE", True)
    model = tiny(family)
    ref_model = copy.deepcopy(model)
    oa.serve_own_attention(model)
    oa._compiled.clear()
    oa._compiled_cached.clear()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    _assert_same_generate(model, ref_model, ids, 1e-5, max_new_tokens=5, pad_token_id=0)
    cached = list(oa._compiled_cached.items())
    assert cached and all(e.result is not None for _, c in cached for e in c.entries()), \
        [e.reason for _, c in cached for e in c.entries()]
    m, c = cached[0]
    args, kwargs = c.last  # the last decode step: the past keys and values, one new token
    assert kwargs.get(oa._PAST_K) is not None and kwargs[oa._PAST_K].shape[-2] > 12
    prog = c.entries()[-1].result.program
    m64 = copy.deepcopy(m).double()
    with torch.no_grad():
        try:
            kw64 = {k: _to64(v) for k, v in kwargs.items()}
            want = c.fn(m64, *_to64(args[1:]), **kw64)
            have = prog.run(m64, *_to64(args[1:]), **kw64)
        except RuntimeError:  # xglm's own code cannot run in float64: judged in float32
            want, have = c.fn(m, *args[1:], **kwargs), prog.run(m, *args[1:], **kwargs)
    output = have[1] if have[0] is None else have[0]  # a leading None: the module's forward returned a tuple
    assert len(have) == len(want) and all(isinstance(x, torch.Tensor) for x in (*have[-2:], output))
    # the attention weights some modules return are served as None; every other item is compared
    pairs = [(h, w) for h, w in zip(have, want) if h is not None]
    assert len(pairs) >= 3 and all(rel_err(h, w) < 1e-5 for h, w in pairs)


def test_decode_steps_run_the_module_by_default():
    """CACHED_DECODE off (measured slower, host-bound): generate's prefill goes through the cached spec, its
    decode steps through the module's own code on the cache the prefill filled; tokens and logits equal."""
    assert oa.CACHED_DECODE is False
    model = tiny("falcon")
    ref_model = copy.deepcopy(model)
    oa.serve_own_attention(model)
    oa._compiled.clear()
    oa._compiled_cached.clear()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    _assert_same_generate(model, ref_model, ids, 1e-5, max_new_tokens=5, pad_token_id=0)
    calls = [sum(c.served.values()) for c in oa._compiled_cached.values()]
    assert calls and all(n == 1 for n in calls)  # the prefill of each module, once


def test_an_own_attention_model_gets_eagers_mask_under_the_cubridge_name():
    """mpt builds its mask through transformers' mask interface and reads it itself
    (`create_causal_mask(...).to(torch.bool)`): under attn_implementation="cubridge" it must get eager's
    mask, never the None the drop-in's mask function gives where SDPA would skip it."""
    tcx.register()
    model = tiny("mpt", tcx.NAME)
    ref_model = tiny("mpt")
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got, ref = model(ids, use_cache=False).logits, ref_model(ids, use_cache=False).logits
    assert rel_err(got, ref) < 1e-5


def test_a_module_that_names_its_cache_layer_layer_id_joins_the_cache():
    """GPT-Neo's attention updates the cache at `self.layer_id` (not layer_idx): a prefill with a DynamicCache
    goes through the cached spec, and the logits and the cache match the model's own forward in float64."""
    from transformers import GPTNeoConfig, GPTNeoForCausalLM
    cfg = GPTNeoConfig(hidden_size=32, num_layers=2, num_heads=2, attention_types=[[["global"], 2]],
                       vocab_size=128, max_position_embeddings=64, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    ref = GPTNeoForCausalLM(cfg).double().eval()
    model = copy.deepcopy(ref)
    oa._compiled_cached.clear()
    oa.serve_own_attention(model)
    ids = torch.randint(0, 128, (2, 12))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = ref(ids, use_cache=True)
        got = model(ids, use_cache=True)
    assert len(oa._compiled_cached.values()) == 2
    assert rel_err(got.logits, want.logits) < 1e-12
    wc, gc = (o.past_key_values for o in (want, got))
    assert gc.get_seq_length() == wc.get_seq_length() == 12
    assert rel_err(gc.layers[1].keys, wc.layers[1].keys) < 1e-12


def _encoder_decoder_pair(family: str):
    from transformers import FSMTConfig, FSMTForConditionalGeneration, XLMConfig, XLMWithLMHeadModel
    torch.manual_seed(0)
    if family == "xlm":  # one attention class for self and cross; its forward returns a 1-tuple
        ref = XLMWithLMHeadModel(XLMConfig(vocab_size=128, emb_dim=64, n_layers=2, n_heads=4, causal=True))
    else:  # separate self- and cross-attention modules, the cross one filling its own cache at the prefill
        ref = FSMTForConditionalGeneration(FSMTConfig(
            langs=["en", "de"], src_vocab_size=128, tgt_vocab_size=128, d_model=64, encoder_layers=2, decoder_layers=2,
            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128))
    ref = ref.double().eval()
    model = copy.deepcopy(ref)
    oa._compiled.clear()
    oa._compiled_cached.clear()
    oa.serve_own_attention(model)
    return ref, model


@pytest.mark.parametrize("family", ["xlm", "fsmt"])
def test_an_encoder_decoder_cache_is_joined_through_stand_ins(family):
    """A call passing an EncoderDecoderCache goes through the cached spec over stand-ins of both its caches: the
    logits, the self-attention keys and the cross-attention keys the real caches take, and the layers marked
    filled, are the module's own forward's, in float64. fsmt's cross-attention call sees the layer its
    self-attention call just filled, and its sequence-first input's batch where queries are counted: a prefill
    all the same, as the module's first call on this cache."""
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache
    ref, model = _encoder_decoder_pair(family)
    ids = torch.randint(1, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    kw = dict(input_ids=ids) if family == "xlm" else dict(input_ids=ids, decoder_input_ids=ids[:, :20])
    caches = [EncoderDecoderCache(DynamicCache(), DynamicCache()) for _ in range(2)]
    key = "cache" if family == "xlm" else "past_key_values"
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = ref(**kw, **{key: caches[0]}, use_cache=True)
        got = model(**kw, **{key: caches[1]}, use_cache=True)
    assert rel_err(got.logits, want.logits) < 1e-12
    served = [e for c in oa._compiled_cached.values() for e in c.entries()]
    assert served and all(e.result is not None for e in served), [e.reason for e in served]
    assert sum(sum(c.served.values()) for c in oa._compiled_cached.values()) == (2 if family == "xlm" else 4)
    w, g = caches
    assert g.is_updated == w.is_updated
    for part in ("self_attention_cache", "cross_attention_cache"):
        wc, gc = getattr(w, part), getattr(g, part)
        assert len(gc.layers) == len(wc.layers)
        for a, b in zip(gc.layers, wc.layers):
            assert (a.keys is None) == (b.keys is None)
            if b.keys is not None and b.keys.numel():
                assert rel_err(a.keys, b.keys) < 1e-12 and rel_err(a.values, b.values) < 1e-12


def test_an_encoder_decoder_generate_serves_its_prefill_and_runs_its_decode_steps_itself():
    """fsmt's generate over an EncoderDecoderCache: each attention module's first call on it (the prefill:
    self-attention over the start token, cross-attention over the encoder's output) is the compiled spec's, the
    decode steps the module's own code (CACHED_DECODE off); the tokens and every step's logits are a separate
    copy's."""
    ref, model = _encoder_decoder_pair("fsmt")
    ids = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    _assert_same_generate(model, ref, ids, 1e-12, max_new_tokens=4, num_beams=1, pad_token_id=1, eos_token_id=None,
                          decoder_start_token_id=2)
    served = [sum(c.served.values()) for c in oa._compiled_cached.values()]
    assert len(served) == 4 and set(served) == {1}, served


def test_a_self_attention_only_encoder_decoder_cache_decodes_on_the_modules_own_code():
    """xlm fills only the self-attention half of its EncoderDecoderCache, so no layer is ever marked filled:
    a step after the prefill on the same cache is still a decode step (the module's own code), and both
    passes' logits and the cache match the model's own forward in float64."""
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache
    ref, model = _encoder_decoder_pair("xlm")
    ids = torch.randint(3, 128, (2, 25), generator=torch.Generator().manual_seed(0))
    caches = [EncoderDecoderCache(DynamicCache(), DynamicCache()) for _ in range(2)]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for ids_now in (ids[:, :24], ids):  # a prefill, then one new token against its cache
            want = ref(input_ids=ids_now, cache=caches[0], use_cache=True)
            got = model(input_ids=ids_now, cache=caches[1], use_cache=True)
            assert rel_err(got.logits, want.logits) < 1e-12
    assert caches[1].self_attention_cache.get_seq_length() == caches[0].self_attention_cache.get_seq_length() == 25
    served = [sum(c.served.values()) for c in oa._compiled_cached.values()]
    assert served == [1, 1], served


def test_a_module_that_returns_its_cache_returns_the_real_one():
    """LED's decoder attention returns the cache it was given: through the cached spec that is the stand-in the
    spec saw, and the caller must get its own EncoderDecoderCache back, filled as the module's own code fills
    it, with the same output."""
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache
    from transformers.models.led.modeling_led import LEDDecoderAttention
    torch.manual_seed(0)
    ref = LEDDecoderAttention(64, 4, is_decoder=True, layer_idx=0).double().eval()
    wrapper = torch.nn.ModuleList([copy.deepcopy(ref)])
    oa._compiled_cached.clear()
    oa.serve_own_attention(wrapper)
    mod = wrapper[0]
    assert "forward" in vars(mod)
    x = torch.randn(2, 20, 64, dtype=torch.float64)
    caches = [EncoderDecoderCache(DynamicCache(), DynamicCache()) for _ in range(2)]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = ref(x, None, caches[0])  # by position: the keyword is past_key_values in older transformers
        got = mod(x, None, caches[1])
    assert got[-1] is caches[1] and want[-1] is caches[0]
    assert rel_err(got[0], want[0]) < 1e-12
    assert rel_err(caches[1].self_attention_cache.layers[0].keys, caches[0].self_attention_cache.layers[0].keys) < 1e-12
    assert sum(sum(c.served.values()) for c in oa._compiled_cached.values()) == 1
