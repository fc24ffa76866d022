"""Verification must reject a program or a kernel that is slightly wrong: a scale or softcap 1% off, a mask
moved by one key in a block of ~32 rows, one wrong 64 x 64 tile of the output, an output 1e-3 off.

(a) The CPU path: the CuIR program itself is mutated and verify_program runs it against the spec in float64.
(b) The GPU verdict (verify.gpu.kernel_verdict, a pure function of tensors): a simulated correct bf16 kernel's
    output is accepted, and the same kernel with each mistake is rejected.

The thresholds are written here, never read from the code under test: loosening the library's tolerances
(REL_TOL 1e-4 -> 1e-2, or the CPU's tolerances floored at the GPU's) makes a test here fail."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

import simulated_kernel as sk
import torch_cubridge as tc
from torch_cubridge.capture.trace import bind_example
from torch_cubridge.ir.expr import call, const, var, where
from torch_cubridge.verify.cpu import verify_program
from torch_cubridge.verify.gpu import kernel_verdict
from torch_cubridge.verify.reference import run_reference

CAP = 30.0


def spec(q, k, v):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = CAP * torch.tanh(s / CAP)
    i = torch.arange(q.shape[-2], device=q.device)
    return torch.softmax(s.masked_fill(i[:, None] < i[None, :], float("-inf")), -1) @ v


SPEC = sk.Variant("softcap_causal", lambda s, h, i, j: CAP * torch.tanh(s / CAP), lambda b, i, j: i >= j)


def _program(S: int = 128):
    q, k, v = (torch.randn(2, 4, S, 32) for _ in range(3))
    return tc.transfer(spec, q, k, v), bind_example(spec, (q, k, v), {})


def _scaled(p, name: str, factor: float):
    return replace(p, scalars=tuple(replace(s, value=s.value * factor) if s.name == name else s for s in p.scalars))


def _rows_in(lo: int, hi: int):
    return call("and", call("ge", var("q"), const(lo)), call("lt", var("q"), const(hi)))


def _mask_shifted(p):
    """Rows 32..63 see their causal mask one key further: key q + 1 too."""
    moved = call("ge", call("add", var("q"), const(1)), var("kv"))
    return replace(p, mask=where(_rows_in(32, 64), moved, p.mask))


def _tile_dropped(p):
    """Rows 64..127 lose key 0: one 64-row tile misses the first key of its first block."""
    tile = call("and", _rows_in(64, 128), call("eq", var("kv"), const(0)))
    return replace(p, mask=call("and", p.mask, call("not", tile)))


def test_the_program_as_transferred_passes():
    p, ex = _program()
    assert verify_program(spec, p, ex).ok


@pytest.mark.parametrize("mutate", [
    pytest.param(lambda p: _scaled(p, p.scalars[0].name, 1.01), id="scale_1pc"),
    pytest.param(lambda p: _scaled(_scaled(p, p.scalars[1].name, 1.01), p.scalars[2].name, 1.01), id="softcap_1pc"),
    pytest.param(_mask_shifted, id="mask_one_key_in_32_rows"),
    pytest.param(_tile_dropped, id="one_64x64_tile"),
    pytest.param(lambda p: replace(p, row_scale=const(1.001)), id="output_1e-3"),
    pytest.param(lambda p: replace(p, row_scale=const(1.0008)), id="output_8e-4"),
])
def test_a_mutated_program_is_rejected_on_the_cpu(mutate):
    p, ex = _program()
    assert [s.value for s in p.scalars] == [math.sqrt(32), CAP, CAP], str(p)  # the scalars mutated above
    bad = mutate(p)
    assert bad != p
    rep = verify_program(spec, bad, ex)
    assert not rep.ok, rep.summary()


@pytest.mark.parametrize("err", [2e-4, 8e-4])
def test_an_output_slightly_off_is_rejected_in_every_trial(err):
    """REL_TOL pinned: the interpreter meets the float64 spec to ~1e-6 (rel L2 3e-7 at magnitude 8), so an
    output off by 2e-4 or 8e-4 relative, uniformly (every row within 1e-3 of its own scale), fails each
    trial on its relative L2 alone: a REL_TOL raised past 2e-4 lets it through."""
    p, ex = _program()
    rep = verify_program(spec, replace(p, row_scale=const(1 + err)), ex)
    assert rep.trials and not any(t.ok for t in rep.trials), rep.summary()
    assert all(0.9 * err < t.rel_err < 1.1 * err for t in rep.trials if t.max_err > 0), rep.summary()


# (b) the GPU verdict, on a simulated bf16 kernel at the first shape of tests/pipeline/test_gpu.py
S, D = 333, 64


@pytest.fixture(scope="module")
def gpu_case():
    q, k, v = sk.inputs(2, 4, 4, S, S, D, 1.0, torch.bfloat16, seed=3)
    p = tc.transfer(spec, q, k, v)
    bound = bind_example(spec, (q, k, v), {})
    ref = run_reference(spec, bound)
    return p, bound, ref, (q, k, v)


def _verdict(case, got):
    p, bound, ref, _ = case
    return kernel_verdict(spec, p, bound, got, ref, "float64", torch.bfloat16)


def test_the_simulated_kernel_matches_the_spec(gpu_case):
    p, bound, ref, qkv = gpu_case
    assert (sk.reference(*qkv, SPEC) - ref).abs().max() < 1e-12  # the simulation is the spec's maths
    rel, mx, ok, judged = _verdict(gpu_case, sk.kernel(*qkv, SPEC))
    assert ok, (rel, mx, judged)


def _off_scale(factor):
    return sk.Variant("scaled", lambda s, h, i, j: CAP * torch.tanh(factor * s / CAP), SPEC.mask)


def _tile_wrong(qkv):
    """One output tile (batch 0, head 0, rows 256..319, all 64 columns at D = 64) misses key 0."""
    good = sk.kernel(*qkv, SPEC)
    lost = sk.kernel(*qkv, sk.Variant("lost", SPEC.score, lambda b, i, j: (i >= j) & (j > 0)))
    good[0, 0, 256:320] = lost[0, 0, 256:320]
    return good


def _one_head_shifted(qkv):
    """Batch 1, head 2 only: rows 64..95 see one key too many."""
    good = sk.kernel(*qkv, SPEC)
    good[1, 2] = sk.kernel(*qkv, SPEC, mask_shift=(64, 96, 1))[1, 2]
    return good


@pytest.mark.parametrize("wrong, norm_fooled", [
    pytest.param(lambda qkv: sk.kernel(*qkv, _off_scale(1.01)), False, id="scale_1pc"),
    pytest.param(lambda qkv: sk.kernel(*qkv, SPEC, mask_shift=(300, 333, 1)), True,
                 id="mask_one_key_in_rows_300_332"),
    pytest.param(lambda qkv: sk.kernel(*qkv, SPEC, mask_shift=(64, 96, 1)), False, id="mask_one_key_in_rows_64_95"),
    pytest.param(_one_head_shifted, False, id="mask_one_key_in_rows_64_95_of_one_head"),
    pytest.param(_tile_wrong, True, id="one_64x64_tile"),
])
def test_a_wrong_kernel_is_rejected_by_the_gpu_verdict(gpu_case, wrong, norm_fooled):
    p, bound, ref, qkv = gpu_case
    got = wrong(qkv)
    if norm_fooled:  # a relative L2 or a max against 5e-2 x max|ref| over the whole tensor passes this one
        e = got.double() - ref
        assert float(e.norm() / ref.norm()) < 1e-2 and float(e.abs().max()) < 5e-2 * float(ref.abs().max())
    rel, mx, ok, judged = _verdict(gpu_case, got)
    assert not ok, (rel, mx, judged)
