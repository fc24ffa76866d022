"""On a CUDA device: a pairwise bias read through data-indexed ids (test_data_indexed.py) is served by
the prefill and decode kernels against fp64; ids that count from the end read what torch indexing reads;
ids past either end are clamped into the table (no wild read)."""
import pytest
import torch

import torch_cubridge as tc
from helpers import rel_err
from test_data_indexed import make, type_bias

pytestmark = pytest.mark.gpu


def _spec64(args):
    return type_bias(*[a.double() if a.is_floating_point() else a for a in args])


@pytest.mark.parametrize("Sq,Skv,kernel", [(300, 300, None), (16, 900, "decode")])
def test_data_indexed_reads_on_the_gpu(Sq, Skv, kernel):
    args = make(B=2, H=4, Sq=Sq, Skv=Skv, D=64, dtype=torch.bfloat16, device="cuda")
    f = tc.compile(type_bias, fallback="raise")
    out = f(*args)
    assert f.served["kernel"] == 1, [e.reasons or e.reason for e in f.entries()]
    run = f.kernels()[-1]
    assert "cb_index" in run.low.source and not run.p.prologue
    assert kernel is None or run.low.tile.kernel == kernel
    assert rel_err(out.double(), _spec64(args)) < 1e-2
    q, k, v, tq, tk, table = args
    neg = (q, k, v, tq - 5, tk - 5, table)  # every id counts from the end
    assert rel_err(f(*neg).double(), _spec64(neg)) < 1e-2
    far = (q, k, v, tq + 100, tk - 100, table)  # past either end: clamped to the last and first rows
    clamped = (q, k, v, torch.full_like(tq, 4), torch.zeros_like(tk), table)
    assert rel_err(f(*far).double(), _spec64(clamped)) < 1e-2
    assert f.served["spec"] == 0
