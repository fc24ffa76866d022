"""Which decode runners the C Decoder may serve (KernelRunner.decodable), decided on the CPU from the program alone,
and the Params template it patches per call.

The first device run of the Decoder found it never used: decode programs hold B = 1 and Sq = 1 (unit dims
are in the call's signature), which the rule read as "sizes needed per call". These cases keep that from
coming back without a GPU; tests/ops/test_decoder_gpu.py checks the launches themselves."""
import re

import pytest
import torch

import paged_specs as ps
import torch_cubridge as tc
from torch_cubridge.ir.paged import paged_operands
from torch_cubridge.lower import lower
from torch_cubridge.ops import host_header
from torch_cubridge.ops.layout import DECODE_PARAMS
from torch_cubridge.ops.pack import params_template
from torch_cubridge.ops.runner import KernelRunner


def gqa_decode(q, k, v):
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    return (q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5).softmax(-1) @ v


def eager_style(module, query, key, value, attention_mask, scaling=None, dropout=0.0):
    """transformers' eager function: a module argument, keywords, (output in [B, S, H, D], weights)."""
    g = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(g, 1), value.repeat_interleave(g, 1)
    w = (query @ key.transpose(2, 3) * scaling).softmax(-1)
    return (w @ value).transpose(1, 2).contiguous(), w


def key_padding(q, k, v, pad):
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    return s.masked_fill(~pad[:, None, None, :], float("-inf")).softmax(-1) @ v


def _runner(fn, *args, paged=False, **kwargs):
    p = tc.transfer(fn, *args, **kwargs)
    q = next(a for a in args if isinstance(a, torch.Tensor))
    reads = None
    if paged:
        import inspect
        reads = paged_operands(p, dict(zip(inspect.signature(fn).parameters, args)))
        assert reads is not None
    low = lower(p, arch="sm_90a", head_dim=q.shape[-1], decode=True, paged=paged)
    return KernelRunner(p, low, None, q.shape[-1], {}, paged=reads)


@pytest.mark.parametrize("B", [1, 2])
def test_plain_decode_programs_are_served_by_the_decoder(B):
    q, k, v = torch.randn(B, 8, 1, 64), torch.randn(B, 2, 300, 64), torch.randn(B, 2, 300, 64)
    r = _runner(gqa_decode, q, k, v)
    assert r.p.requires and r.decodable  # B = 1 and/or Sq = 1 held: the Decoder checks them itself


def test_the_drop_in_s_eager_function_is_served_by_the_decoder():
    q, k, v = torch.randn(1, 8, 1, 64), torch.randn(1, 2, 300, 64), torch.randn(1, 2, 300, 64)
    r = _runner(eager_style, torch.nn.Module(), q, k, v, None, scaling=0.125)
    assert r.p.out.tuple_len == 2 and r.decodable


def test_an_extra_tensor_argument_is_read_by_the_decoder_its_words_patched():
    """A padding mask passed as an argument: the Decoder reads it after q, k and v and patches its pointer
    and strides into a Params template (every other word fixed by the program)."""
    q, k, v = torch.randn(1, 8, 1, 64), torch.randn(1, 8, 300, 64), torch.randn(1, 8, 300, 64)
    r = _runner(key_padding, q, k, v, torch.rand(1, 300) > 0.2)
    assert r.p.extras and r.decodable and r._c_args == ("q", "k", "v", "pad") and r._c_at == (0, 1, 2, 3)
    (x,) = r.p.extras
    tmpl, patches = params_template(r.fmt, r.low.params, {}, r._lit, {x.name: x.rank}), r.per_call_words
    assert len(tmpl) == 8 * len(r.low.params)
    fields = {f.kind: f for f in r.low.params if f.source == x.name}
    assert "ptr" in fields and {(o // 8, kind, src) for o, kind, src, _ in patches} >= {
        (r.low.params.index(fields["ptr"]), 0, 0)}
    assert all(src == 0 and 0 <= dim < x.rank and o % 8 == 0 for o, _, src, dim in patches)
    assert len(patches) == sum(f.source == x.name for f in r.low.params)
    # a record of such a launch patches the mask's pointer into Params (block 1) as the fourth source
    assert r.replayable and r.replay_sources() == (0, 1, 2, 3)
    assert (3, 1, 8 * r.low.params.index(fields["ptr"]), False) in r.replay_patches()
    assert (4, 0, 24, False) in r.replay_patches()  # the output, after the sources


@pytest.mark.parametrize("spec,slots_first", [(ps.vllm_heads_first, False), (ps.flash_slots_first, True)])
def test_paged_decode_programs_are_served_by_the_decoder(spec, slots_first):
    """Paged K and V: the Decoder reads q, both page arrays and both tables, then the sequence lengths
    where the spec takes them (their reads at index b bounds-checked by the runner)."""
    args = ps.pages(2, 8, 2, 300, 64, 16, torch.bfloat16, slots_first=slots_first)
    args = args if spec is ps.vllm_heads_first else args[:4]
    r = _runner(spec, *args, paged=True)
    names = ("q",) + tuple(spec.__code__.co_varnames[1:3]) + ("block_table", "block_table")
    assert r.decodable and r._c_args[:5] == names
    assert (r._c_args[5:] == ("seq_lens",)) == (spec is ps.vllm_heads_first) == bool(r._sites)
    # a record of a paged launch patches q's and the pages' pointers into FwdArgs, the tables' into the
    # PagedKV words (the last block), the lengths' into Params
    patches = r.replay_patches()
    assert r.replayable and r.replay_sources() == tuple(r.plan.positions[n] for n in r._c_args)
    assert {(3, -1, 0, False), (4, -1, 8, False), (len(r._c_args), 0, 24, False)} <= set(patches)
    assert any(src == 5 and blk == 1 for src, blk, _, _ in patches) == (spec is ps.vllm_heads_first)
    if r._sites:  # the Decoder's bounds question, answered by the runner's check
        assert r.reads_in_bounds((2, 8, 8, 1, 320, 64), {"seq_lens": (2,)})
        assert not r.reads_in_bounds((3, 8, 8, 1, 320, 64), {"seq_lens": (2,)})


def sorted_lengths(q, k_pages, v_pages, block_table, seq_lens):
    """The lengths computed from an argument (a prologue step that PyTorch runs before the kernel)."""
    return ps.vllm_heads_first(q, k_pages, v_pages, block_table, seq_lens.sort().values)


def test_a_computed_extra_takes_the_python_runner():
    args = ps.pages(2, 8, 2, 300, 64, 16, torch.bfloat16)
    r = _runner(sorted_lengths, *args, paged=True)
    assert any(x.step for x in r.p.extras) and not r.decodable


def test_a_pool_of_2_31_pages_is_refused_at_the_call():
    """paged.cuh reads table entries in 32 bits, so the runner refuses a pool of 2^31 pages or more (SpecServes:
    the spec serves that call; the C Decoder hands such a call to the runner) and takes the pool below it; an
    empty pool has no page to clamp an entry into. The large pool is one page viewed 2^31 times (stride 0)."""
    import inspect
    from torch_cubridge.ops.errors import SpecServes
    args = ps.pages(2, 8, 2, 300, 64, 16, torch.float32)
    r = _runner(ps.vllm_heads_first, *args, paged=True)
    names = list(inspect.signature(ps.vllm_heads_first).parameters)
    q, kp, vp, table, lens = args
    r._pages(dict(zip(names, args)))
    for big in ((kp[:1].expand(2 ** 31, *kp.shape[1:]), vp), (kp, vp[:1].expand(2 ** 31, *vp.shape[1:]))):
        with pytest.raises(SpecServes, match="2\\^31 pages"):
            r._pages(dict(zip(names, (q, *big, table, lens))))
    with pytest.raises(SpecServes, match="empty pool"):  # no page to clamp an entry into
        r._pages(dict(zip(names, (q, kp[:0], vp, table, lens))))


@pytest.mark.parametrize("paged", [False, True])
def test_the_decode_kernel_takes_its_parameters_in_the_order_both_hosts_pack(paged):
    """The lowered decode entry's parameters are DECODE_PARAMS, name for name and type for type: the list
    the Python runner orders its launch blocks by and the C Decoder (host_rules.h DEC_*) places them by."""
    if paged:
        args = ps.pages(2, 8, 2, 300, 64, 16, torch.bfloat16)
        r = _runner(ps.vllm_heads_first, *args, paged=True)
    else:
        r = _runner(gqa_decode, torch.randn(2, 8, 1, 64), torch.randn(2, 2, 300, 64), torch.randn(2, 2, 300, 64))
    entry = re.search(rf"\b{DECODE_PARAMS.kernel}\(([^)]*)\)", r.low.source)
    assert entry is not None
    got = [tuple(x.strip().rsplit(" ", 1)) for x in entry.group(1).split(",")]
    want = [(t if t != "KV" else "cubridge::PagedKV", n) for n, t in DECODE_PARAMS.params]
    assert got == want
    assert f"DEC_NPARAMS = {len(want)}" in host_header.text()
