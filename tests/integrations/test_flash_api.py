"""cubridge's flash-attention API (integrations/flash_api.py) against float64 attention written out per
sequence, the block-table append, and transformers' continuous batching through the registered flash name,
token for token with transformers' own paged eager. On the CPU the verified specs serve."""
import math
import warnings

import pytest
import torch

import torch_cubridge.integrations.flash_api as tfa
from tiny_models import build, small_paged_cache

transformers = pytest.importorskip("transformers")


def reference(q, k, v, scale, causal=True, left=-1, softcap=0.0, sinks=None):
    """One sequence in float64: q [Sq, H, D], k and v [Skv, Hkv, D]; query i at key Skv - Sq + i."""
    q, k, v = q.double(), k.double(), v.double()
    Sq, H, _ = q.shape
    Skv, Hkv, _ = k.shape
    out = torch.empty(Sq, H, v.shape[-1], dtype=torch.float64)
    for h in range(H):
        kh, vh = k[:, h // (H // Hkv)], v[:, h // (H // Hkv)]
        for i in range(Sq):
            s = kh @ q[i, h] * scale
            if softcap:
                s = softcap * torch.tanh(s / softcap)
            at = Skv - Sq + i
            ok = [(not causal or j <= at) and (left < 0 or j >= at - left) for j in range(Skv)]
            s = s[torch.tensor(ok)]
            w = torch.exp(s - s.max())
            total = w.sum() + (math.exp(float(sinks[h]) - float(s.max())) if sinks is not None else 0.0)
            out[i, h] = (w / total) @ vh[torch.tensor(ok)]
    return out


@pytest.fixture(autouse=True)
def quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # on the CPU every call warns that the spec serves
        yield


@pytest.mark.parametrize("causal,left,softcap,sink", [(True, -1, 0.0, False), (True, 3, 0.0, False),
                                                      (True, -1, 20.0, True), (False, -1, 0.0, False)])
def test_varlen_matches_float64_per_sequence(causal, left, softcap, sink):
    g = torch.Generator().manual_seed(1)
    H, Hkv, D = 4, 2, 16
    cu_q = torch.tensor([0, 3, 9, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 7, 13, 17], dtype=torch.int32)
    q = torch.randn(12, H, D, generator=g)  # two padding tokens past the last sequence
    k, v = torch.randn(19, Hkv, D, generator=g), torch.randn(19, Hkv, D, generator=g)
    sinks = torch.randn(H, generator=g) if sink else None
    out = tfa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 7, softmax_scale=0.3, causal=causal,
                                     window_size=(left, left), softcap=softcap, s_aux=sinks)
    assert out.shape == q.shape and out[10:].isfinite().all()
    for s in range(3):
        a, b, c, d = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]), int(cu_k[s + 1])
        want = reference(q[a:b], k[c:d], v[c:d], 0.3, causal, left, softcap, sinks)
        assert (out[a:b].double() - want).abs().max() < 1e-5, s


def test_dense_matches_float64():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 5, 4, 16, generator=g)
    k, v = torch.randn(2, 9, 1, 16, generator=g), torch.randn(2, 9, 1, 16, generator=g)
    out = tfa.flash_attn_func(q, k, v, softmax_scale=0.25, causal=True, softcap=30.0)
    for b in range(2):
        assert (out[b].double() - reference(q[b], k[b], v[b], 0.25, True, -1, 30.0)).abs().max() < 1e-5


def _pages(g, N=12, P=4, Hkv=2, D=16):
    return torch.randn(N, P, Hkv, D, generator=g), torch.randn(N, P, Hkv, D, generator=g)


def test_kvcache_appends_then_attends_through_the_table():
    g = torch.Generator().manual_seed(3)
    kc, vc = _pages(g)
    P = kc.shape[1]
    table = torch.tensor([[5, 2, 9, -1], [0, 7, -1, -1], [-1, -1, -1, -1]], dtype=torch.int32)
    at = torch.tensor([9, 4, -1], dtype=torch.int32)  # where each new token goes; the last row is padding
    q = torch.randn(3, 1, 4, 16, generator=g)
    kn, vn = torch.randn(3, 1, 2, 16, generator=g), torch.randn(3, 1, 2, 16, generator=g)
    k0 = kc.clone()
    out = tfa.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=at, block_table=table, softmax_scale=0.25,
                                      causal=True)
    # exactly the two real sequences' slots were written, with their own keys and values
    assert (kc != k0).any(-1).any(-1).nonzero().tolist() == [[7, 0], [9, 1]]
    assert torch.equal(kc[9, 1], kn[0, 0]) and torch.equal(vc[7, 0], vn[1, 0])
    for b in range(2):
        n = int(at[b]) + 1
        keys = torch.cat([kc[int(table[b, j])] for j in range(-(-n // P))])[:n]
        vals = torch.cat([vc[int(table[b, j])] for j in range(-(-n // P))])[:n]
        assert (out[b].double() - reference(q[b], keys, vals, 0.25)).abs().max() < 1e-5, b
    assert out[2].isfinite().all()


def test_kvcache_padding_alone_writes_nothing():
    g = torch.Generator().manual_seed(4)
    kc, vc = _pages(g)
    k0 = kc.clone()
    table = torch.full((2, 3), -1, dtype=torch.int32)
    q, kn = torch.randn(2, 1, 4, 16, generator=g), torch.randn(2, 1, 2, 16, generator=g)
    tfa.flash_attn_with_kvcache(q, kc, vc, kn, kn, cache_seqlens=torch.tensor([-1, -1], dtype=torch.int32),
                                block_table=table, causal=True)
    assert torch.equal(kc, k0)


def test_bad_calls_raise():
    q = torch.randn(1, 3, 2, 16)
    with pytest.raises(NotImplementedError, match="dropout"):
        tfa.flash_attn_func(q, q, q, dropout_p=0.1)
    with pytest.raises(NotImplementedError, match="block table"):
        tfa.flash_attn_with_kvcache(q, q, q)
    with pytest.raises(ValueError, match="flash"):
        tfa.register("cubridge_paged")
    with pytest.raises(NotImplementedError, match="alibi_slopes"):  # set options are refused, never ignored
        tfa.flash_attn_func(q, q, q, alibi_slopes=torch.ones(2), return_attn_probs=False, num_splits=0)
    with pytest.raises(ValueError, match="both"):
        tfa.flash_attn_with_kvcache(q[:, :1], q, q, k=q[:, :1], cache_seqlens=1,
                                    block_table=torch.zeros(1, 1, dtype=torch.int32))


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a CUDA machine transformers batches a flash model "
                    "asynchronously, which needs the model on the GPU: test_flash_api_gpu.py")
def test_generate_batch_through_the_flash_name_matches_paged_eager():
    from transformers import GenerationConfig
    name = tfa.register()
    ref = build("llama", "eager")
    torch.manual_seed(0)
    prompts = [torch.randint(1, 128, (n,)).tolist() for n in (7, 12, 5)]
    gc = GenerationConfig(max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0)
    try:
        want = {tuple(r.prompt_ids): r.generated_tokens
                for r in ref.generate_batch(inputs=prompts, generation_config=gc, **small_paged_cache()).values()}
    except (ValueError, MemoryError) as e:  # transformers 5.17 sizes the paged cache from device memory: none on
        # the CPU (ValueError by default; MemoryError when the cache's size is given, as small_paged_cache() does)
        pytest.skip(f"this transformers' continuous batching does not run on the CPU ({e})")
    ours = build("llama", name)
    ours.load_state_dict(ref.state_dict())
    before = sum(tfa.compiled()["varlen"].served.values())
    got = {tuple(r.prompt_ids): r.generated_tokens
           for r in ours.generate_batch(inputs=prompts, generation_config=gc, **small_paged_cache()).values()}
    assert got == want
    # every attention call (prefill and 4 steps, 2 layers) went through the packed-query function
    assert sum(tfa.compiled()["varlen"].served.values()) - before == 10


def test_generate_through_the_flash_name_matches_eager_logits():
    """model.generate outside continuous batching: a padded batch is unpadded into the packed function, an
    unpadded one takes the dense function, each step's logits as eager's."""
    name = tfa.register()
    ref = build("llama", "eager")
    ours = build("llama", name)
    ours.load_state_dict(ref.state_dict())
    torch.manual_seed(0)
    ids = torch.randint(1, 128, (2, 9))
    padded = torch.ones_like(ids)
    padded[1, :3] = 0
    for mask, path in ((padded, "varlen"), (None, "dense")):
        before = sum(tfa.compiled()[path].served.values())
        kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        want, got = ref.generate(ids, attention_mask=mask, **kw), ours.generate(ids, attention_mask=mask, **kw)
        assert torch.equal(want.sequences, got.sequences)
        assert max(float((a - b).abs().max()) for a, b in zip(want.logits, got.logits)) < 1e-4
        assert sum(tfa.compiled()[path].served.values()) - before == 8  # 4 steps, 2 layers


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_softcaps_windows_and_sinks_through_transformers_flash_path(family):
    """Gemma 2 (softcap, sliding windows) and gpt-oss (sinks, sliding windows) generate through the name with
    eager's logits. gpt-oss lists the Hub kernels it takes, so it is allowed the name first."""
    name = tfa.register()
    if family == "gpt_oss":
        from transformers.models.gpt_oss import modeling_gpt_oss
        tfa.allow_for(modeling_gpt_oss.GptOssPreTrainedModel)
    ref = build(family, "eager")
    ours = build(family, name)
    ours.load_state_dict(ref.state_dict())
    torch.manual_seed(0)
    ids = torch.randint(1, 128, (2, 40))  # longer than the tiny model's window of 8
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    want, got = ref.generate(ids, attention_mask=mask, **kw), ours.generate(ids, attention_mask=mask, **kw)
    assert torch.equal(want.sequences, got.sequences)
    assert max(float((a - b).abs().max()) for a, b in zip(want.logits, got.logits)) < 1e-4


def test_the_name_continuous_batching_calls_loads_cubridge_functions():
    """Continuous batching calls attention under the flash name itself (transformers 5.24, whose flash path takes
    the block table) or under "paged|" + it (5.17, which switches a flash model to that name and runs its own
    paged forward over the flash functions): in either, the model takes that name and the loader gives ours.
    (5.17's continuous batching sizes its cache from GPU memory, so it runs only in test_flash_api_gpu.py.)"""
    import transformers.modeling_flash_attention_utils as fau
    from transformers import AttentionInterface
    name = tfa.register()
    paged = tfa._paged_forward(fau)
    cb_name = name if paged is None else "paged|" + name
    model = build("llama", name)
    model.set_attn_implementation(cb_name)  # what 5.17's ContinuousBatchingManager does to a flash model
    assert model.config._attn_implementation == cb_name
    _, varlen, kvcache, _, _ = fau._lazy_imports(cb_name)
    assert varlen is tfa.flash_attn_varlen_func and kvcache is tfa.flash_attn_with_kvcache
    assert AttentionInterface._global_mapping[cb_name] is (paged or
                                                         AttentionInterface._global_mapping["flash_attention_2"])
