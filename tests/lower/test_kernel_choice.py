"""The kernel choice: worked out once per call, as one frozen value, which lower() takes as given."""
import dataclasses

import pytest
import torch

import paged_specs as ps
import torch_cubridge as tc
import torch_cubridge.lower.choice as choice_mod
from torch_cubridge.capture.trace import bind_example
from torch_cubridge.errors import UnsupportedSpec
from torch_cubridge.ir.paged import PagedRead
from torch_cubridge.ir.segments import KVSegments
from torch_cubridge.lower import lower
from torch_cubridge.lower.choice import KernelChoice, choose, choose_kernel
from torch_cubridge.lower.tiles import tile_for
from zoo import causal_where_finfo, kv_cache_concat, qkv, softcap_causal

bf = torch.bfloat16


def _call(fn, args):
    return tc.transfer(fn, *args), bind_example(fn, args, {})


def _concat_call():
    """One new token and a cache of 60 the spec concatenates: a decode call whose K and V are pieces."""
    return qkv(2, 4, 4, 1, 1, 64, bf) + tuple(torch.randn(2, 4, 60, 64, dtype=bf) for _ in range(2))


def test_the_choice_is_a_frozen_value_whose_fields_round_trip():
    p, bound = _call(softcap_causal, qkv(1, 2, 2, 48, 48, 64, bf))
    c = choose_kernel(p, bound, "sm_90a")
    assert (c.arch, c.dtype, c.head_dim, c.value_dim, c.decode, c.paged, c.segmented) == \
        ("sm_90a", "bfloat16", 64, 64, False, False, False)
    assert c.kind == "sm90" and c.refusal is None and c.reads is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.tile = None
    again = KernelChoice(**{f.name: getattr(c, f.name) for f in dataclasses.fields(c)})
    assert again == c and hash(again) == hash(c)
    assert lower(p, choice=again).source == lower(p, choice=c).source
    # the flags lower() is called with by hand make the same choice, and the same kernel
    assert choose(p, "sm_90a", "bfloat16", 64) == c
    assert lower(p, "sm_90a", "bfloat16", 64).source == lower(p, choice=c).source


def test_lower_takes_the_tile_and_the_refusal_as_given():
    """A choice whose tile is not the one the rules give lowers with that tile, and one that carries a refusal
    is refused for that reason: lower() works neither out again."""
    p, bound = _call(softcap_causal, qkv(1, 2, 2, 48, 48, 64, bf))
    c = choose_kernel(p, bound, "sm_90a")
    fa2 = tile_for(64, "sm_80")
    assert c.tile != fa2
    low = lower(p, choice=dataclasses.replace(c, tile=fa2))
    assert low.tile == fa2 and "cubridge::FwdConfig<64, __nv_bfloat16, 64>" in low.source
    assert "attention_fwd_sm90" not in low.source
    with pytest.raises(UnsupportedSpec, match="lower: a reason the test gives"):
        lower(p, choice=dataclasses.replace(c, refusal="a reason the test gives"))


def test_the_tile_and_refusal_rules_run_once_for_a_call_and_its_two_builds(monkeypatch):
    """choose_kernel and the fast-tanh and exact builds a server tries enter the tile rule once and each
    refusal rule once (they were entered four times on the way to lower())."""
    calls = []

    def counted(name):
        real = getattr(choice_mod, name)
        monkeypatch.setattr(choice_mod, name, lambda *a, **k: calls.append(name) or real(*a, **k))
    for name in ("program_tile", "in_place_refusal", "decode_dims_refusal", "decode_refusal"):
        counted(name)
    for fn, args, arch in [(softcap_causal, qkv(1, 2, 2, 48, 48, 64, bf), "sm_90a"),
                           (kv_cache_concat, _concat_call(), "sm_80")]:
        p, bound = _call(fn, args)
        calls.clear()
        c = choose_kernel(p, bound, arch)
        for fast in (True, False):
            lower(p, choice=c, fast_tanh=fast)
        assert sorted(calls) == sorted(set(calls)) and "program_tile" in calls, (fn.__name__, calls)


def test_a_call_gets_the_kernel_and_the_reads_it_takes():
    """Few queries: the decode kernel, reading K and V as the spec's pieces; many queries over pages: the
    Hopper kernel reads them in place where its boxes fit, and the FA2-class kernel pages of whole key
    blocks; rows that take V's mean are read in one piece."""
    p, bound = _call(kv_cache_concat, _concat_call())
    c = choose_kernel(p, bound, "sm_90a")
    assert c.decode and c.kind == "decode" and c.segmented and not c.paged and isinstance(c.reads, KVSegments)
    assert c.readers() == {"paged": None, "segments": c.reads}
    low = lower(p, choice=c)
    assert low.segmented and low.tile == c.tile and "cubridge::SegKV" in low.source

    args = ps.pages(2, 8, 2, 300, 128, 16, bf, sq=40)
    p, bound = _call(ps.chunked_prefill, args)
    hopper, fa2 = choose_kernel(p, bound, "sm_90a"), choose_kernel(p, bound, "sm_80")
    assert hopper.kind == "sm90" and hopper.paged and isinstance(hopper.reads, tuple)
    assert all(isinstance(r, PagedRead) for r in hopper.reads) and hopper.readers()["paged"] == hopper.reads
    assert fa2.kind == "sm80" and not fa2.paged and fa2.reads is None  # pages of 16 < a key block of 64: gathered
    assert lower(p, choice=hopper).paged and not lower(p, choice=fa2).paged

    p, bound = _call(causal_where_finfo, qkv(2, 4, 4, 3, 3, 64, bf))
    assert p.empty_rows == "mean_v"
    c = choose_kernel(p, bound, "sm_90")
    assert c.decode and not c.paged and not c.segmented and c.reads is None


def test_refusals_are_carried_by_the_choice_and_raised_by_lower():
    p, bound = _call(softcap_causal, qkv(1, 2, 2, 48, 48, 264, bf))
    c = choose_kernel(p, bound, "sm_80")
    assert c.tile is None and c.kind is None and "head dim 264" in c.refusal
    with pytest.raises(UnsupportedSpec, match="^lower: head dim 264 has no kernel configuration"):
        lower(p, choice=c)
    with pytest.raises(UnsupportedSpec, match="^kernel: the kernel computes in bfloat16 or float16"):
        choose_kernel(*_call(softcap_causal, qkv(1, 2, 2, 48, 48, 64, torch.float32)), "sm_80")
    assert choose(p, "sm_80", "float32", 64).refusal == "the kernel computes in bfloat16 or float16, not float32"
    assert choose(p, "sm_80", "bfloat16", 64, segmented=True).refusal.startswith("K and V are read in place as pieces")


def test_a_kernel_is_given_as_a_choice_or_as_arguments_not_both():
    p, bound = _call(softcap_causal, qkv(1, 2, 2, 48, 48, 64, bf))
    with pytest.raises(TypeError, match="either as a choice or as arguments"):
        lower(p, "sm_80", choice=choose_kernel(p, bound, "sm_90a"))


def scale_from_head_dim(q, k, v):
    """A scale the program reads as the head dim D (the generated code bakes D in)."""
    s = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    return torch.softmax(30.0 * torch.tanh(s / 30.0), -1) @ v


@pytest.mark.parametrize("D, padded", [(4, 8), (30, 32), (36, 40), (60, 64), (100, 104)])
def test_head_dims_off_the_step_of_8_take_the_prefill_kernel_at_the_padded_dims(D, padded):
    """Swin2SR's 30, MobileViT's 36 and 60: the prefill kernel at the head dim rounded up to 8 (decode-sized
    calls too: the decode kernel reads K and V in place, and these are copied padded), the call's own head
    dims kept for the runner, and a score that reads D lowered with the call's D, not the padded one."""
    for Sq in (48, 1):
        p, bound = _call(scale_from_head_dim, qkv(1, 2, 2, Sq, 48, D, bf))
        c = choose_kernel(p, bound, "sm_90a")
        assert (c.head_dim, c.value_dim, c.pad_from, c.decode) == (padded, padded, (D, D), False), c
        assert c.refusal is None and c.kind == "sm90"
        src = lower(p, choice=c).source
        assert f"Sm90Tile<{padded}, " in src
    assert choose(p, "sm_90a", "bfloat16", D) == c
    assert choose(p, "sm_90a", "bfloat16", D, paged=True).pad_from is None  # in-place reads keep the rule
    assert choose(p, "sm_90a", "bfloat16", 264).refusal  # past 256 nothing pads


def test_a_score_reading_d_is_lowered_with_the_calls_head_dim():
    """A program whose score reads D (an LLM backend may write s / D, or softcap over D): the padded kernel
    folds the call's head dim, 30, never the 32 it computes at."""
    from torch_cubridge.ir.expr import call, var
    from torch_cubridge.ir.interval import interval
    p, bound = _call(softcap_causal, qkv(1, 2, 2, 48, 48, 30, bf))
    for score in (call("div", var("s"), var("D")), call("tanh", call("div", var("s"), var("D")))):
        q = dataclasses.replace(p, score=score)
        c = choose_kernel(q, bound, "sm_90a")
        low = lower(q, choice=c)
        assert c.head_dim == 32 and c.pad_from == (30, 30)
        if low.scale is not None:  # folded into the kernel's exp2: the constant 1/30
            assert interval(low.scale, {})[0] == pytest.approx(1 / 30)
        else:  # a score hook: D is the literal 30
            assert "(float)(30)" in low.source and "(float)(32)" not in low.source
