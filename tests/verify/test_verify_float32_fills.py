"""GPT-2/BERT-style specs add a finite fill (-1e9, finfo.min) to the scores and take softmax in their own
dtype. Where a whole row is filled, float64 still resolves s * scale - 1e9 (the row is not uniform);
float32 (the kernel's score precision) rounds every key to -1e9 (uniform). Verification judges such
rows against the spec run in float32, and still rejects a program that is wrong.
"""
from dataclasses import replace

import pytest
import torch

import torch_cubridge as tc
from torch_cubridge.api import transfer_bound
from torch_cubridge.capture.trace import bind_example
from torch_cubridge.verify import cpu as vcpu
from helpers import rel_err


def gpt2_bool(q, k, v, keep):
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    s = s + (~keep).to(s.dtype) * -1e9
    return torch.softmax(s, -1) @ v


def gpt2_float(q, k, v, mask):
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    return torch.softmax(s + mask, -1) @ v


def gpt2_finfo(q, k, v, keep):
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    s = torch.where(keep, s, torch.tensor(torch.finfo(s.dtype).min, dtype=s.dtype))
    return torch.softmax(s, -1) @ v


def inf_masked(q, k, v, keep):
    """Agrees with gpt2_bool wherever a row keeps a key; fully masked rows are 0 (by contract), not uniform."""
    s = (q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5).masked_fill(~keep, float("-inf"))
    return torch.softmax(s, -1) @ v


def _args(spec, S=70, B=2, H=4, D=32):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, generator=g) for _ in range(3))
    keep = torch.rand(B, 1, S, S, generator=g) < 0.8
    last = torch.zeros(B, 1, S, S).masked_fill(~keep, -1e9) if spec is gpt2_float else keep
    return q, k, v, last


@pytest.mark.parametrize("spec", [gpt2_bool, gpt2_float, gpt2_finfo])
def test_gpt2_style_specs_transfer_and_verify_on_cpu(spec):
    args = _args(spec)
    res = transfer_bound(spec, bind_example(spec, args, {}))
    assert res.report.ok, res.report.summary()
    assert any(t.pattern is not None for t in res.report.trials)  # whole filled rows were drawn
    if spec is not gpt2_finfo:  # finfo(float64).min absorbs the scores in float64 too
        assert any(t.ref_dtype == "float32" for t in res.report.trials)


def test_filled_rows_are_uniform_like_the_spec_in_float32():
    q, k, v, keep = _args(gpt2_bool)
    keep[:, :, :3] = False
    p = tc.transfer(gpt2_bool, q, k, v, keep)
    got = p.run(q.double(), k.double(), v.double(), keep)
    ref32 = gpt2_bool(q, k, v, keep)
    assert rel_err(got, ref32) < 1e-5
    assert rel_err(got[:, :, :3], v.mean(2, keepdim=True).expand(-1, -1, 3, -1)) < 1e-5


def test_a_program_wrong_on_filled_rows_is_rejected():
    """0 for a fully masked row matches neither the float64 spec nor the float32 one (uniform)."""
    args = _args(gpt2_bool)
    bound = bind_example(gpt2_bool, args, {})
    wrong = tc.transfer(inf_masked, *args)
    assert wrong.empty_rows == "zero"
    rep = vcpu.verify_program(gpt2_bool, wrong, bound)
    assert not rep.ok
    # random redraws over many keys never fill a whole row: only filled rows tell the two apart
    assert all(t.ok for t in rep.trials if t.pattern is None and t.sizes["Skv"] > 1)
    assert any(not t.ok for t in rep.trials if t.pattern is not None)


def test_a_program_with_a_wrong_scale_is_rejected():
    args = _args(gpt2_bool)
    good = tc.transfer(gpt2_bool, *args)
    wrong = replace(good, score=tc.transfer(lambda q, k, v, keep: gpt2_bool(q * 1.01, k, v, keep), *args).score)
    assert str(wrong.score) != str(good.score)
    rep = vcpu.verify_program(gpt2_bool, wrong, bind_example(gpt2_bool, args, {}))
    assert not rep.ok


def test_the_float32_spec_decides_rows_only_float64_leaves_undefined():
    """BLOOM's and Gemma 2's fill, finfo(dtype).min before softmax(dtype=torch.float32): made in float64 it
    overflows float32 to -inf, so float64 leaves fully masked rows NaN that float32 (every real dtype, and
    the program) defines. The float32 run then decides, everywhere; a float32 run that leaves undefined a
    row the float64 run defines decides nothing."""
    args = _args(gpt2_bool, S=8)
    p = tc.transfer(gpt2_bool, *args)
    bound = bind_example(gpt2_bool, args, {})

    def spec(q, k, v, keep):  # NaN in row 0 in float64 only
        out = torch.full_like(q, 0.5)
        if q.dtype == torch.float64:
            out[:, :, 0] = float("nan")
        return out
    got = torch.full_like(args[0], 0.5).double()
    ref = spec(*(a.double() if a.is_floating_point() else a for a in args))
    assert vcpu.judge(spec, p, bound, got, ref) == (0.0, 0.0, True, "float32")
    wrong = got.clone()
    wrong[:, :, 0] = 0.7  # the row float32 defines, answered differently
    assert not vcpu.judge(spec, p, bound, wrong, ref)[2]

    def nan32(q, k, v, keep):  # NaN in row 0 in float32 only
        out = torch.full_like(q, 0.5)
        if q.dtype == torch.float32:
            out[:, :, 0] = float("nan")
        return out
    ref64 = torch.full_like(got, 0.5)
    assert not vcpu.judge(nan32, p, bound, wrong, ref64)[2]
    # the same, with the NaN in both runs: float64 decides (0.5 is not the contract's 0), still rejected
    both = lambda q, k, v, keep: spec(q.double(), k, v, keep).to(q.dtype)
    assert not vcpu.judge(both, p, bound, got, ref)[2]
    # and the float32 fallback does accept where the runs agree on NaN and the program matches it
    f32 = lambda q, k, v, keep: torch.full_like(q, 0.5) if q.dtype == torch.float32 else torch.zeros_like(q)
    assert vcpu.judge(f32, p, bound, got, torch.zeros_like(got)) == (0.0, 0.0, True, "float32")


def gemma2_style(q, k, v, mask):
    """Gemma 2's eager attention: a window filled with finfo(q.dtype).min over a 4-D mask made in the call's
    dtype. In bfloat16 both fills are one value, so a fully padded row averages V over every key; in float32
    and float64 the window's fill is far smaller, and such a row averages over the keys outside it."""
    window = torch.tril(torch.ones_like(mask, dtype=torch.bool), diagonal=-4)
    mask = torch.where(window, torch.finfo(q.dtype).min, mask)
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 + mask
    return torch.softmax(s, -1, dtype=torch.float32).to(q.dtype) @ v


def _gemma2_args(S=24, B=1, H=2, D=16, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, generator=g).to(dtype) for _ in range(3))
    mask = torch.full((S, S), torch.finfo(dtype).min).triu(1).to(dtype)[None, None].expand(B, 1, S, S).clone()
    mask[:, :, 20] = torch.finfo(dtype).min  # a fully padded row: 17 of its 24 keys in the window
    return q, k, v, mask


def test_rows_whose_answer_depends_on_the_dtype_are_judged_in_the_calls_dtype():
    args = _gemma2_args()
    bound = bind_example(gemma2_style, args, {})
    p = tc.transfer(gemma2_style, *args)
    a64 = tuple(a.double() for a in args)
    ref = gemma2_style(*a64)
    own = gemma2_style(*args).double()
    assert rel_err(own[:, :, 20], v_mean := args[2].double().mean(2)) < 1e-2  # bf16: every key
    assert rel_err(ref[:, :, 20], v_mean) > 0.5  # float64: the keys outside the window only
    got = own.clone()
    got[:, :, torch.arange(24) != 20] = ref[:, :, torch.arange(24) != 20]  # float64's answer elsewhere
    rel, _, ok, judged = vcpu.judge(gemma2_style, p, bound, got, ref, call_dtype=torch.bfloat16)
    assert ok and "bfloat16 on 2 dtype-dependent rows" in judged, judged
    # without the call's dtype (a float32 call) the same answer is wrong
    assert not vcpu.judge(gemma2_style, p, bound, got, ref, call_dtype=torch.float32)[2]
    # a row that the bfloat16 spec answers as float64 does may not take bfloat16's answer of another row
    wrong = got.clone()
    wrong[:, :, 7] = own[:, :, 20]
    assert not vcpu.judge(gemma2_style, p, bound, wrong, ref, call_dtype=torch.bfloat16)[2]
    # and a padded row answered with neither spec's mean is wrong
    wrong = got.clone()
    wrong[:, :, 20] = 0
    assert not vcpu.judge(gemma2_style, p, bound, wrong, ref, call_dtype=torch.bfloat16)[2]


def test_gemma2_style_transfers_for_a_bfloat16_call():
    args = _gemma2_args(S=40)
    res = transfer_bound(gemma2_style, bind_example(gemma2_style, args, {}))
    assert res.report.ok, res.report.summary()
    assert any("dtype-dependent rows" in t.ref_dtype for t in res.report.trials), res.report.summary()


def neo_band(q, k, v, band, mask):
    """GPT-Neo's local attention: scores in float32 whatever the call's dtype, out-of-band keys filled with
    finfo(float32).min by where(), then the padding mask (another finfo.min) added. A key both out of band
    and padded is -6.8e38 in float64 and -inf in float32: a row of only such keys is uniform in float64 and
    empty (NaN) in float32, the kernel's score precision."""
    s = q.float() @ k.float().transpose(-1, -2) * q.shape[-1] ** -0.5
    s = torch.where(band, s, torch.tensor(torch.finfo(torch.float32).min)) + mask
    return torch.softmax(s, -1).to(v.dtype) @ v


def _neo_args(S=24, B=2, H=4, D=32):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, generator=g) for _ in range(3))
    i = torch.arange(S)
    band = ((i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < 4))[None, None]
    mask = torch.zeros(B, 1, S, S)
    mask[0, :, :, :5] = torch.finfo(torch.float32).min  # row 0 left-padded by 5
    return q, k, v, band, mask


def test_rows_empty_only_in_float32_take_the_empty_row_rule():
    args = _neo_args()
    res = transfer_bound(neo_band, bind_example(neo_band, args, {}))
    assert res.report.ok, res.report.summary()
    p = res.program
    bound = bind_example(neo_band, args, {})
    args2 = list(args)
    args2[3] = torch.zeros_like(args[3])  # no key in band: every row empty in float32, uniform in float64
    args2[4] = torch.full_like(args[4], torch.finfo(torch.float32).min)
    ref = neo_band(*(a.double() if a.is_floating_point() else a for a in args2))
    assert not torch.isnan(ref).any() and torch.isnan(neo_band(*args2)).all()
    zero = torch.zeros_like(ref)
    assert vcpu.judge(neo_band, p, bind_example(neo_band, tuple(args2), {}), zero, ref)[2]
    # float64's uniform answer is right too; anything else there is rejected, and so is a wrong defined row
    assert p.empty_rows == "zero"
    assert not vcpu.judge(neo_band, p, bind_example(neo_band, tuple(args2), {}), ref * 0.5 + 0.3, ref)[2]
    got = first_of(p.run(*args)).double()
    want = neo_band(*(a.double() if a.is_floating_point() else a for a in args))
    assert vcpu.judge(neo_band, p, bound, got, want)[2]
    bad = got.clone()
    bad[1, :, 7] *= 1.05
    assert not vcpu.judge(neo_band, p, bound, bad, want)[2]


def first_of(x):
    return x[0] if isinstance(x, tuple) else x
