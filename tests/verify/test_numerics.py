"""Verification sees what is served: structured masks (whole tiles, whole rows, every fill).

Random redraws keep ~70% of a mask, so they never mask a whole 64-key tile of a row nor a whole row:
the cases where the kernel once returned NaN (transformers' finfo.min sliding-window masks).
"""
from dataclasses import replace

import pytest
import torch

import torch_cubridge as tc
from torch_cubridge.capture.trace import bind_example
from torch_cubridge.verify import cpu as vcpu
from torch_cubridge.verify.inputs import FILLS, STRUCTURED, example_sizes, has_structured, make_inputs
from helpers import rel_err, to64


def additive_mask_attention(q, k, v, mask):
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 + mask
    return torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def window_mask(S, W, fill):
    i = torch.arange(S)
    keep = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < W)
    return torch.zeros(1, 1, S, S).masked_fill(~keep, fill)


def _case(S=160, W=40, fill=torch.finfo(torch.float32).min):
    args = (torch.randn(1, 2, S, 32), torch.randn(1, 2, S, 32), torch.randn(1, 2, S, 32), window_mask(S, W, fill))
    return args, bind_example(additive_mask_attention, args, {})


def test_whether_structured_cases_apply_is_read_without_drawing(monkeypatch):
    """has_structured answers from the arguments themselves: a mask over (query, key) yes, a paged
    cache's pools and table no; and no argument is drawn (it once drew a 2 x 268M-element page pool
    twice per verification, 12 s of a 32k paged decode's first call)."""
    import paged_specs as ps
    from torch_cubridge.verify import inputs

    def no_draw(*a, **k):
        raise AssertionError("has_structured drew an argument")
    args, bound = _case()
    p = tc.transfer(additive_mask_attention, *args)
    pargs = ps.pages(2, 8, 2, 100, 64, 16, torch.float32, slots_first=True)
    pp = tc.transfer(ps.flash_slots_first, *pargs[:4])
    monkeypatch.setattr(inputs, "redraw", no_draw)
    assert has_structured(p, bound)
    assert not has_structured(pp, bind_example(ps.flash_slots_first, pargs[:4], {}))


def test_structured_cases_cover_tiles_rows_and_fills():
    args, bound = _case()
    p = tc.transfer(additive_mask_attention, *args)
    assert has_structured(p, bound)
    sizes = dict(example_sizes(p, bound), Sq=200, Skv=200)
    fills, first_tile, whole_row = set(), False, False
    for k in range(STRUCTURED):
        m = make_inputs(p, bound, sizes, seed=k, pattern=k)["mask"][0, 0]
        fills |= {float(x) for x in m.unique() if x != 0}
        first_tile |= bool((m[150:, :64] != 0).all())
        whole_row |= bool((m != 0).all(dim=-1).any())
    assert first_tile and whole_row
    assert {float(torch.tensor(f, dtype=torch.float32)) for f in FILLS} <= fills


@pytest.mark.parametrize("fill", [float("-inf"), torch.finfo(torch.float32).min, torch.finfo(torch.bfloat16).min, -1e9])
def test_interpreter_matches_the_spec_where_whole_tiles_are_fill(fill):
    args, _ = _case(S=200, W=20, fill=fill)
    p = tc.transfer(additive_mask_attention, *args)
    got = p.run(*args)
    ref = additive_mask_attention(*to64(args))
    assert not torch.isnan(got).any()
    assert rel_err(got, ref) < 1e-4


def test_a_program_only_structured_cases_can_catch_is_rejected():
    """Fully -inf rows are NaN in the spec, 0 by contract; a program claiming the mean of V for them
    agrees with every random redraw (no row is ever fully masked there) but not with the structured cases."""
    args, bound = _case(fill=float("-inf"))
    good = tc.transfer(additive_mask_attention, *args)
    wrong = replace(good, empty_rows="mean_v")
    assert vcpu.verify_program(additive_mask_attention, good, bound).ok
    random_only = [t for t in vcpu.trials(wrong, bound, vcpu.verify_shapes(wrong, bound, True), (1.0, 8.0), 200)
                   if t[2] is None]
    assert random_only
    rep = vcpu.verify_program(additive_mask_attention, wrong, bound)
    assert not rep.ok
    assert all(t.ok for t in rep.trials if t.pattern is None)  # random redraws alone would have passed it
