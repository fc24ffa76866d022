"""The corpus (tests/corpus/): specs transcribed from public code in their authors' styles transfer to a
program that matches the spec in float64 at new values; non-softmax attentions are refused cleanly."""
import pytest
import torch

import torch_cubridge as tc
from corpus_index import CASES, NOT_YET, REFUSAL_CAUSE, REFUSED, reference
from helpers import first, rel_err


def _marks(name):
    return [pytest.mark.xfail(raises=tc.UnsupportedSpec, strict=True, reason=NOT_YET[name])] if name in NOT_YET else []


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name, marks=_marks(c.name)) for c in CASES])
def test_corpus_case_transfers_and_matches_spec(case):
    prog = tc.transfer(case.fn, *case.make(2, 4, 2, 70, 64, torch.float32))
    torch.manual_seed(1)
    args = case.make(2, 4, 2, 70, 64, torch.float32)  # new values at the program's shape
    got, ref = first(prog.run(*args)), reference(case, args)
    assert rel_err(got, ref) < 2e-5


@pytest.mark.parametrize("case", REFUSED, ids=[c.name for c in REFUSED])
def test_corpus_non_softmax_attention_is_refused(case):
    with pytest.raises(tc.UnsupportedSpec, match=REFUSAL_CAUSE.get(case.name)):
        tc.transfer(case.fn, *case.make(2, 4, 2, 70, 64, torch.float32))
