"""The corpus (tests/corpus/): specs transcribed from public code in their authors' styles transfer to a
program that matches the spec in float64 at new values; non-softmax attentions are refused cleanly."""
import pytest
import torch

import torch_cubridge as tc
from corpus_index import CASES, NOT_YET, REFUSAL_CAUSE, REFUSED
from helpers import first, rel_err, to64


def _marks(name):
    return [pytest.mark.xfail(raises=tc.UnsupportedSpec, strict=True, reason=NOT_YET[name])] if name in NOT_YET else []


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name, marks=_marks(c.name)) for c in CASES])
def test_corpus_case_transfers_and_matches_spec(case):
    prog = tc.transfer(case.fn, *case.make(2, 4, 2, 70, 64, torch.float32))
    torch.manual_seed(1)
    args = case.make(2, 4, 2, 70, 64, torch.float32)  # new values at the program's shape
    got = first(prog.run(*args))
    try:
        ref = first(case.fn(*to64(args)))
    except RuntimeError:  # a spec that cannot run in float64 (finfo(float64).min into a float32 tensor: Cohere)
        ref = first(case.fn(*args))
    if torch.isnan(ref).any():
        # a finfo(dtype).min fill that float64 overflows to -inf under softmax(dtype=float32) (BLOOM):
        # every real dtype defines those rows, so the spec in the inputs' own float32 decides
        ref = first(case.fn(*args))
        assert not torch.isnan(ref).any()
    assert rel_err(got, ref) < 2e-5


@pytest.mark.parametrize("case", REFUSED, ids=[c.name for c in REFUSED])
def test_corpus_non_softmax_attention_is_refused(case):
    with pytest.raises(tc.UnsupportedSpec, match=REFUSAL_CAUSE.get(case.name)):
        tc.transfer(case.fn, *case.make(2, 4, 2, 70, 64, torch.float32))
