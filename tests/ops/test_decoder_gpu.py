"""On a CUDA device: the decode kernel's launch in C for any sizes (csrc/host/decoder.h, ops/decoder.py).

The same kernel launched by the C Decoder and by the Python runner must give the same output bit for bit
(same blocks, same split rule) over batch sizes, head groupings, query counts, key lengths, head dims and
layouts, paged K and V and extra tensors; calls the Decoder must not take (misaligned rows, grad, another
dtype, a CUDA graph, a scratch of another stream, extras read out of range) are served by the Python runner,
correctly."""
import pytest
import torch

import paged_specs as ps
import torch_cubridge as tc
from helpers import rel_err, to64
from torch_cubridge.ops import hotpath
from torch_cubridge.ops.errors import NeedsAutograd, SpecServes

pytestmark = pytest.mark.gpu


def gqa_decode(q, k, v):
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    return (q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5).softmax(-1) @ v


def bshd_softcap(q, k, v):
    """[B, S, H, D] operands, a softcap, the output merged to [B, S, H * D], as a model's attention returns it."""
    g = q.shape[2] // k.shape[2]
    q, k, v = q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(g, 1), v.transpose(1, 2).repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    s = 30.0 * torch.tanh(s / 30.0)
    o = s.softmax(-1) @ v
    return o.transpose(1, 2).reshape(o.shape[0], o.shape[2], -1)


def with_weights(q, k, v):
    """A tuple result (output, weights), as transformers' eager functions return: weights served as None."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    p = (q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5).softmax(-1)
    return (p @ v).transpose(1, 2).contiguous(), p


def _qkv(B, H, Hkv, Sq, Skv, D, bshd=False, Dv=None):
    def t(h, s, d):
        x = torch.randn(B, h, s, d, device="cuda", dtype=torch.bfloat16)
        return x.transpose(1, 2).contiguous() if bshd else x
    return t(H, Sq, D), t(Hkv, Skv, D), t(Hkv, Skv, Dv or D)


def key_padding(q, k, v, pad):
    """A padding mask [B, Skv] passed as an argument: an extra tensor the Decoder reads per call."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    return s.masked_fill(~pad[:, None, None, :], float("-inf")).softmax(-1) @ v


def _runner(f, args):
    f(*args)
    assert hotpath.wait(120) is not None, hotpath.failure
    (r,) = f.kernels()
    assert r.low.tile.kernel == "decode" and r._decoder_ok
    return r


def _from_c(r, args, retry: bool = True):
    """One call served by the Decoder (`retry`: a second try where the first made a larger split scratch; a
    call of one block has no splits, so it must launch from C the first time)."""
    hits = r.decoder_hits
    c = r.serve(args, {}, record=False)
    if retry and hits == r.decoder_hits:
        c = r.serve(args, {}, record=False)
    assert r.decoder_hits == hits + 1
    return c


def _same(a, b) -> bool:
    if isinstance(a, tuple):
        return all(x is None and y is None or torch.equal(x, y) for x, y in zip(a, b))
    return torch.equal(a, b)


@pytest.mark.parametrize("spec,bshd", [(gqa_decode, False), (bshd_softcap, True), (with_weights, False)],
                         ids=["bhsd", "bshd_merged_out", "tuple"])
@pytest.mark.parametrize("B,H,Hkv,D", [(1, 32, 8, 128), (3, 8, 8, 64), (2, 16, 2, 40)])
def test_the_c_launch_equals_the_python_launch(spec, bshd, B, H, Hkv, D):
    """Over queries 1, 4 and 16 and key lengths from one block to many splits, each call served by the C
    Decoder equals the Python runner's launch bit for bit, and float64 within bf16's error."""
    for Sq in (1, 4, 16):  # a program each (a unit dim is part of the call's signature: Sq = 1 is held)
        f = tc.compile(spec, fallback="raise")
        r = _runner(f, _qkv(B, H, Hkv, Sq, 100, D, bshd))
        for Skv in (2, 63, 64, 65, 1000, 4097, 30011):  # the program is generic in the key length
            args = _qkv(B, H, Hkv, Sq, Skv, D, bshd)
            c = _from_c(r, args, retry=Skv > 64)
            py = r(*args)
            assert _same(c, py), (Sq, Skv)
            ref = spec(*to64(args))
            assert rel_err((c[0] if isinstance(c, tuple) else c).float(), ref[0] if isinstance(ref, tuple) else ref) < 2e-2


def test_a_growing_cache_launches_from_c_after_the_records_stop():
    """A compiled function called positionally over a growing cache: the first calls make records (none of
    them ever replays), then every call launches through the Decoder; all of them right."""
    f = tc.compile(gqa_decode, fallback="raise")
    r = _runner(f, _qkv(2, 16, 4, 1, 500, 64))
    for n in range(501, 541):
        args = _qkv(2, 16, 4, 1, n, 64)
        assert rel_err(f(*args), gqa_decode(*to64(args))) < 2e-2
    assert f._hot_made == hotpath.MAX_RECORDS and r.decoder_hits >= 25
    assert f.served["kernel"] == 41 and f.served["spec"] == 0


def test_calls_the_decoder_must_not_take_are_served_right():
    f = tc.compile(gqa_decode, fallback="raise")
    r = _runner(f, _qkv(1, 8, 2, 1, 700, 64))
    r.serve(_qkv(1, 8, 2, 1, 700, 64), {})  # a scratch for this stream
    # rows not 16-byte aligned: a view one element in (the runner copies it)
    q, k, v = _qkv(1, 8, 2, 1, 701, 64)
    kk = torch.empty(k.numel() + 1, device="cuda", dtype=k.dtype)[1:].view_as(k).copy_(k)
    hits = r.decoder_hits
    assert rel_err(r.serve((q, kk, v), {}), gqa_decode(*to64((q, k, v)))) < 2e-2
    assert r.decoder_hits == hits
    # another dtype: the runner's error, not a launch
    with pytest.raises(TypeError):
        r.serve((q.half(), k, v), {})
    # grad on, an input that requires it: the runner refuses; with grad off the Decoder serves it
    qg = q.clone().requires_grad_()
    with pytest.raises(NeedsAutograd):
        r.serve((qg, k, v), {})
    with torch.no_grad():
        out = r.serve((qg, k, v), {})
    assert r.decoder_hits == hits + 1 and torch.equal(out, r(q, k, v))
    # another stream: its own scratch, made by the runner at its first call there, then the Decoder's
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        a = _qkv(1, 8, 2, 1, 900, 64)
        o1, o2 = r.serve(a, {}), r.serve(a, {})
    s.synchronize()
    assert torch.equal(o1, o2) and r.decoder_hits == hits + 2
    # a CUDA graph captures its own scratch: the runner serves the captured call, and replays are right
    a = _qkv(1, 8, 2, 1, 800, 64)
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        r.serve(a, {})  # warm up on the capturing stream
        hits = r.decoder_hits
        with torch.cuda.graph(g, stream=side):
            out = r.serve(a, {})
    torch.cuda.current_stream().wait_stream(side)
    assert r.decoder_hits == hits
    for _ in range(2):
        for t in a:
            t.copy_(torch.randn_like(t))
        g.replay()
        torch.cuda.synchronize()
        assert rel_err(out, gqa_decode(*to64(a))) < 2e-2


def test_the_drop_in_decodes_a_growing_cache_from_c():
    """A tiny llama through the drop-in, a DynamicCache growing by one key a step (teacher-forced, so both
    models see the same tokens): after the first steps the decode calls launch through the Decoder, and
    every step's logits match eager's (built from a config of its own)."""
    import torch_cubridge.integrations.transformers as tcx
    from tiny_models import forced_step_logits, pair
    tcx.register()
    assert hotpath.wait(120) is not None, hotpath.failure
    ref, ours = pair("llama", torch.bfloat16, "cuda")
    ids = torch.randint(1, 128, (2, 40), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    mask = torch.ones_like(ids)
    tokens = torch.randint(1, 128, (2, 30), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    with torch.no_grad():
        got = forced_step_logits(ours, ids, mask, tokens)
        want = forced_step_logits(ref, ids, mask, tokens)
    for step, (g, w) in enumerate(zip(got, want)):
        assert float((g - w).norm() / w.norm()) < 3e-2, step
    decode = [r for t in tcx.tables() for r in t.kernels() if r.low.tile.kernel == "decode"]
    assert decode and sum(r.decoder_hits for r in decode) >= 2 * 20, [r.decoder_hits for r in decode]


@pytest.mark.parametrize("P", [16, 24, 256])
@pytest.mark.parametrize("spec,slots_first,table_dtype", [(ps.vllm_heads_first, False, torch.int64),
                                                          (ps.flash_slots_first, True, torch.int32)],
                         ids=["heads_first_lengths", "slots_first_int32"])
def test_paged_calls_launch_from_c_as_the_python_runner_does(spec, slots_first, table_dtype, P):
    """Paged K and V, with and without sequence lengths, int64 and int32 tables, pages a power of two and
    not: over a widening table (one program), each call from C equals the Python runner's bit for bit, and
    float64 within bf16's error."""
    def args(keys):
        a = ps.pages(2, 16, 4, keys, 128, P, torch.bfloat16, slots_first=slots_first, table_dtype=table_dtype)
        return tuple(t.cuda() for t in (a if spec is ps.vllm_heads_first else a[:4]))
    f = tc.compile(spec, fallback="raise")
    r = _runner(f, args(3 * P))
    assert r.paged is not None
    for keys in (100, 1000, 6000):  # one split to many
        a = args(keys)
        c = _from_c(r, a)
        assert torch.equal(c, r(*a)), keys
        assert rel_err(c.float().cpu(), spec(*to64(tuple(t.cpu() for t in a)))) < 1e-2, keys


def test_a_short_paged_call_splits_into_four_blocks_a_split_in_c_and_python():
    """B 1, 4k keys, 32:8 heads: the rule alone would give 32 splits of two blocks; a paged call takes one CTA
    per SM where splits are that short (splitkv.PAGED_SPLIT_MIN_BLOCKS), 16 splits of four, from C as from
    Python, and the output is right."""
    a = tuple(t.cuda() for t in ps.pages(1, 32, 8, 4096, 128, 16, torch.bfloat16))
    f = tc.compile(ps.vllm_heads_first, fallback="raise")
    r = _runner(f, a)
    py = r(*a)
    assert r._last[0] == (16, 8, 1)
    assert torch.equal(_from_c(r, a), py)
    assert rel_err(py.float().cpu(), ps.vllm_heads_first(*to64(tuple(t.cpu() for t in a)))) < 1e-2


def test_an_extra_tensor_launches_from_c_and_out_of_range_reads_do_not():
    """A padding mask read per call (its pointer and strides patched into Params): C equals Python bit
    for bit over growing lengths; a mask one key short (a read out of range) is refused by the bounds
    check, which the Python runner then raises; the next good call launches from C again."""
    def args(n):
        q, k, v = _qkv(2, 16, 4, 1, n, 64)
        return q, k, v, torch.rand(2, n, device="cuda") > 0.3
    f = tc.compile(key_padding, fallback="raise")
    r = _runner(f, args(200))
    for n in (201, 777, 5000):
        a = args(n)
        c = _from_c(r, a)
        assert torch.equal(c, r(*a)), n
        assert rel_err(c.float(), key_padding(*to64(a))) < 2e-2, n
    q, k, v, pad = args(300)
    hits = r.decoder_hits
    with pytest.raises(SpecServes):
        r.serve((q, k, v, pad[:, :-1]), {})
    assert r.decoder_hits == hits
    assert torch.equal(_from_c(r, (q, k, v, pad)), r(q, k, v, pad))


def test_paged_calls_the_decoder_must_not_take_are_served_right():
    """Pages one element off 16-byte alignment: the Python runner refuses them (SpecServes, so the
    compiled function serves the spec); under a CUDA graph the runner captures, and replays read the
    rewritten cache."""
    a = tuple(t.cuda() for t in ps.pages(2, 8, 2, 640, 64, 16, torch.bfloat16))
    f = tc.compile(ps.vllm_heads_first, fallback="raise")
    r = _runner(f, a)
    q, kp, vp, table, lens = a
    hits = r.decoder_hits
    off = torch.empty(kp.numel() + 1, device="cuda", dtype=kp.dtype)[1:].view_as(kp).copy_(kp)
    with pytest.raises(SpecServes):
        r.serve((q, off, vp, table, lens), {})
    assert r.decoder_hits == hits
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        r.serve(a, {})
        hits = r.decoder_hits
        with torch.cuda.graph(g, stream=side):
            out = r.serve(a, {})
    torch.cuda.current_stream().wait_stream(side)
    assert r.decoder_hits == hits
    kp.normal_()
    g.replay()
    torch.cuda.synchronize()
    assert rel_err(out.float().cpu(), ps.vllm_heads_first(*to64(tuple(t.cpu() for t in a)))) < 1e-2


def test_paged_calls_of_one_layout_replay_their_record_with_each_call_s_tables_and_lengths():
    """A serving loop's table of fixed width: every call has the first call's layout, so its record
    replays, the pages', tables' and lengths' pointers of each call patched in (new tensors each call,
    the old ones kept alive with other contents): every output against float64."""
    assert hotpath.wait(120) is not None, hotpath.failure
    f = tc.compile(ps.vllm_heads_first, fallback="raise")
    keep = []
    for step in range(6):
        a = tuple(t.cuda() for t in ps.pages(2, 16, 4, 1000, 128, 16, torch.bfloat16))
        keep.append(a)
        out = f(*a)
        assert rel_err(out.float().cpu(), ps.vllm_heads_first(*to64(tuple(t.cpu() for t in a)))) < 1e-2, step
    assert f._hot and sum(rec.hits for rec in f._hot) >= 4
    assert f.served["spec"] == 0
