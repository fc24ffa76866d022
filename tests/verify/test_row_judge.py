"""The row judge (torch_cubridge/verify/judge.py) against simulated kernels on the CPU.

A correct bf16 or fp16 kernel (float32 sums, P and the output rounded to the dtype) must pass at every
shape and variant; a kernel wrong in a few rows must not. Bounds written here: a correct kernel's worst
element stays under 2.5 of the dtype's unit roundoff times its row's largest |value|."""
from __future__ import annotations

import pytest
import torch

import simulated_kernel as sk
from torch_cubridge.verify.judge import judge_rows, judge_rows_in

SHAPES = ((2, 4, 4, 300, 333), (2, 4, 4, 77, 129), (1, 8, 2, 130, 64), (2, 8, 1, 16, 1000), (1, 4, 4, 1, 129))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("variant", sk.VARIANTS, ids=[v.name for v in sk.VARIANTS])
def test_a_correct_kernel_passes_everywhere(variant, dtype):
    u = torch.finfo(dtype).eps / 2
    for n, (B, H, Hkv, Sq, Skv) in enumerate(SHAPES):
        for D in (8, 12, 32, 128):
            for mag in (1.0, 4.0):
                q, k, v = sk.inputs(B, H, Hkv, Sq, Skv, D, mag, dtype, seed=n * 10 + D)
                got, ref = sk.kernel(q, k, v, variant), sk.reference(q, k, v, variant)
                verdict = judge_rows_in(got, ref, dtype)
                assert verdict.ok, (B, H, Hkv, Sq, Skv, D, mag, str(verdict))
                err = (got.double() - ref).abs().amax(-1)
                assert bool((err <= 2.5 * u * ref.abs().amax(-1)).all()), (Sq, Skv, D, mag)


def test_one_wrong_row_fails_where_the_norm_does_not_notice():
    q, k, v = sk.inputs(2, 4, 4, 300, 300, 64, 1.0, torch.bfloat16)
    ref = sk.reference(q, k, v, sk.VARIANTS[1])
    got = sk.kernel(q, k, v, sk.VARIANTS[1]).double()
    got[1, 2, 150] = 0.9 * got[1, 2, 150] + 0.1 * got[1, 2, 149]
    assert float((got - ref).norm() / ref.norm()) < 1e-2  # what a relative L2 at the GPU's 1e-2 would pass
    verdict = judge_rows_in(got, ref, torch.bfloat16)
    assert not verdict.ok and verdict.bad_rows == 1, str(verdict)


def test_a_small_row_is_judged_by_its_own_scale():
    """A row a hundred times smaller than the rest (a sink's or a gate's row), 20% off: a bound from the
    largest |ref| in the tensor passes it."""
    ref = torch.randn(8, 64, dtype=torch.float64)
    ref[3] *= 1e-2
    got = ref.clone()
    got[3] *= 1.2
    assert float((got - ref).abs().max()) < 1e-2 * float(ref.abs().max())
    assert not judge_rows(got, ref, 1e-2).ok
    assert judge_rows(ref * (1 + 1e-3), ref, 1e-2).ok


def test_undefined_rows_are_left_to_the_caller_and_nan_elsewhere_fails():
    ref = torch.randn(4, 16, dtype=torch.float64)
    ref[1] = float("nan")
    got = ref.nan_to_num(0.0)
    assert judge_rows(got, ref, 1e-6).ok
    got[2, 5] = float("nan")
    assert not judge_rows(got, ref, 1e-6).ok
    assert not judge_rows(got[:3], ref, 1e-6).ok  # a shape mismatch fails


def test_an_allowance_loosens_only_its_own_row():
    ref = torch.ones(3, 8, dtype=torch.float64)
    out = ref.clone()
    out[1, 2] += 0.5  # 0.5 off in row 1: beyond 5% of the row's scale
    assert not judge_rows(out, ref, 0.05).ok
    assert judge_rows(out, ref, 0.05, allowance=torch.tensor([0.0, 0.5, 0.0])).ok
    assert not judge_rows(out, ref, 0.05, allowance=torch.tensor([0.5, 0.0, 0.5])).ok


def test_rows_a_mask_leaves_zero_do_not_set_the_floor():
    """dK under a narrow window: most keys are kept by no query (their rows zero), a key kept by one near
    one-hot query has a gradient below a bf16 kernel's rounding. The floor is from the median of the rows that
    are not zero, so rounding there passes; garbage of a typical row's size in a zero row still fails."""
    g = torch.Generator().manual_seed(0)
    ref = torch.zeros(160, 64, dtype=torch.float64)
    ref[100:140] = torch.randn(40, 64, generator=g, dtype=torch.float64) * 1e-2  # the keys some query keeps
    ref[120] = 0.0  # kept by a one-hot row: zero in float64
    out = ref.clone()
    out[120] = 5e-6  # the kernel's rounding there
    assert judge_rows(out, ref, 0.05).ok
    out[10] = 1e-2  # a key no query keeps, given a typical row's gradient
    assert not judge_rows(out, ref, 0.05).ok
