"""Every spec style in the zoo transfers to a program that matches the spec in
float64 on fresh inputs at a shape the transfer never saw."""
import pytest
import torch

import torch_cubridge as tc
from helpers import first, rel_err, to64
from zoo import CASES, LAYOUTS, MORE_STYLES


@pytest.mark.parametrize("case", CASES + MORE_STYLES + LAYOUTS, ids=[c.name for c in CASES + MORE_STYLES + LAYOUTS])
def test_transfer_matches_spec(case):
    prog = tc.transfer(case.fn, *case.make(2, 4, 2, 70, 64, torch.float32))
    prog.validate()
    e = case.expect
    if e.get("mask") is False:
        assert prog.mask is None and prog.block_rule == "none"
    if "block_rule" in e:
        assert prog.block_rule == e["block_rule"]
    if "head_map" in e:
        assert prog.head_map == e["head_map"]
    if "extras" in e:
        assert len(prog.extras) == e["extras"]
    if "scalars" in e:
        assert len(prog.scalars) >= e["scalars"]
    if "score_has" in e:
        assert e["score_has"] in str(prog.score)
    if e.get("sink"):
        assert prog.sink is not None
    if "q_dims" in e:
        assert prog.q.dims == e["q_dims"]
    if "k_dims" in e:
        assert prog.k.dims == e["k_dims"]
    if "out_dims" in e:
        assert prog.out.dims == e["out_dims"]
    if "empty_rows" in e:
        assert prog.empty_rows == e["empty_rows"]
    # a new shape, new values: the interpreter (tiled, online softmax) against the spec in fp64
    args = to64(case.make(1, 4, 2, 45, 64, torch.float32))
    got = first(prog.run(*args))
    ref = first(case.fn(*args))
    assert got.shape == ref.shape
    assert rel_err(got, ref) < 1e-6


@pytest.mark.parametrize("D", [64, 96, 128])
@pytest.mark.parametrize("name", ["softcap_causal", "gqa_expand", "sliding_window", "document_causal"])
def test_head_dims_and_odd_lengths(name, D):
    case = next(c for c in CASES if c.name == name)
    prog = tc.transfer(case.fn, *case.make(2, 4, 2, 133, D, torch.float32))
    args = to64(case.make(2, 4, 2, 67, D, torch.float32))
    assert rel_err(first(prog.run(*args)), first(case.fn(*args))) < 1e-6


def test_bf16_example_program_runs_in_bf16():
    case = next(c for c in CASES if c.name == "softcap_causal")
    q, k, v = case.make(1, 2, 2, 40, 64, torch.bfloat16)
    prog = tc.transfer(case.fn, q, k, v)
    out = prog.run(q, k, v)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, case.fn(*to64((q, k, v)))) < 1e-2
