"""On a CUDA device: a program reading an extra tensor at indices read from data (test_data_indexed.py's
hand-written program) is built, verified on the GPU and served by the prefill and decode kernels; ids
that count from the end read what torch indexing reads; ids past the end are clamped (no wild read)."""
from dataclasses import replace

import pytest
import torch

from helpers import rel_err
from test_data_indexed import hand_program, make, type_bias
from torch_cubridge.capture.trace import bind_example
from torch_cubridge.pipeline import kernel_stage, transfer_stage

pytestmark = pytest.mark.gpu


def _spec64(args):
    return type_bias(*[a.double() if a.is_floating_point() else a for a in args])


@pytest.mark.parametrize("Sq,Skv", [(300, 300), (1, 900), (4, 900)])
def test_data_indexed_reads_on_the_gpu(Sq, Skv):
    args = make(B=2, H=4, Sq=Sq, Skv=Skv, D=64, dtype=torch.bfloat16, device="cuda")
    bound = bind_example(type_bias, args, {})
    res = transfer_stage(type_bias, bound, "symbolic", {})
    hand = hand_program([a.cpu() for a in args])
    res = replace(res, program=replace(hand, guards=res.program.guards, requires=res.program.requires))
    run, why = kernel_stage(type_bias, res, bound)  # GPU verification included
    assert run is not None, why
    assert run.low.tile.kernel == ("decode" if Sq <= 16 else run.low.tile.kernel)
    assert "cb_index" in run.low.source
    assert rel_err(run(*args).double(), _spec64(args)) < 1e-2
    q, k, v, tq, tk, table = args
    neg = (q, k, v, tq - 5, tk - 5, table)  # every id counts from the end
    assert rel_err(run(*neg).double(), _spec64(neg)) < 1e-2
    far = (q, k, v, tq + 100, tk - 100, table)  # past either end: clamped to the last and first rows
    clamped = (q, k, v, torch.full_like(tq, 4), torch.zeros_like(tk), table)
    assert rel_err(run(*far).double(), _spec64(clamped)) < 1e-2
