"""CuIR: JSON round trip, text form, validity check, interval classification."""
import itertools
import math

import pytest
import torch

import torch_cubridge as tc
from torch_cubridge.ir.expr import call, const, load, var
from torch_cubridge.ir.interpreter import evaluate
from torch_cubridge.ir.interval import classify_tile
from torch_cubridge.ir.program import ExtraTensor, Operand, Output, Program
from torch_cubridge.ir.validate import InvalidProgram
from zoo import CASES


def _base(**kw):
    op = Operand("q", ("b", "h", "s", "d"))
    d = dict(signature=("q", "k", "v"), q=op, k=Operand("k", op.dims), v=Operand("v", op.dims),
             score=call("mul", var("s"), const(0.125)), out=Output(op.dims))
    d.update(kw)
    return Program(**d)


@pytest.mark.parametrize("case", CASES[::3], ids=[c.name for c in CASES[::3]])
def test_json_round_trip(case):
    p = tc.transfer(case.fn, *case.make(1, 4, 2, 33, 64, torch.float32))
    text = p.to_json()
    back = Program.from_json(text)
    assert back == p
    assert back.to_json() == text
    assert "score" in str(back) and "cuir.program" in str(back)


def test_infinities_survive_json():
    p = _base(score=call("where", call("ge", var("q"), var("kv")), var("s"), const(-math.inf)))
    assert Program.from_json(p.to_json()).score == p.score


@pytest.mark.parametrize("bad, words", [
    (dict(score=call("add", var("s"), load("bias", var("q")))), "undeclared tensor"),
    (dict(mask=call("lt", var("s"), const(0.0)), block_rule="interval"), "may not"),
    (dict(q=Operand("q", ("b", "h", "s"))), "permutation"),
    (dict(mask=call("ge", var("q"), var("kv")), block_rule="none"), "block rule"),
    (dict(extras=(ExtraTensor("t", "float32", 2, arg="t"),), score=load("t", var("q"))), "rank"),
])
def test_validate_rejects(bad, words):
    with pytest.raises(InvalidProgram, match=words):
        _base(**bad).validate()


MASKS = {
    "causal": call("ge", var("q"), var("kv")),
    "window": call("and", call("ge", var("q"), var("kv")), call("lt", call("sub", var("q"), var("kv")), const(19))),
    "prefix": call("or", call("lt", var("kv"), const(23)), call("ge", var("q"), var("kv"))),
    "band_mod": call("eq", call("mod", call("sub", var("q"), var("kv")), const(7)), const(0)),
}


@pytest.mark.parametrize("name", list(MASKS))
def test_tile_classes_are_sound(name):
    """Empty tiles hold no kept element and full tiles no masked one, for every tile."""
    m = MASKS[name]
    for q0, k0 in itertools.product(range(0, 96, 16), range(0, 96, 16)):
        env = {"q": (q0, q0 + 15), "kv": (k0, k0 + 15)}
        cls = classify_tile(m, env)
        qi = torch.arange(q0, q0 + 16).view(-1, 1)
        ki = torch.arange(k0, k0 + 16).view(1, -1)
        keep = torch.as_tensor(evaluate(m, {"q": qi, "kv": ki}, torch.float64)).bool().expand(16, 16)
        if cls == 0:
            assert not keep.any()
        if cls == 2:
            assert keep.all()
    # and the analysis is not trivially "partial": causal has empty and full tiles
    if name == "causal":
        assert classify_tile(m, {"q": (0, 15), "kv": (32, 47)}) == 0
        assert classify_tile(m, {"q": (32, 47), "kv": (0, 15)}) == 2


def test_load_bounds_follow_the_index_expressions():
    from torch_cubridge.ir.bounds import load_sites, out_of_bounds
    from zoo import rel_bias_table
    S = 30
    args = (torch.randn(1, 2, S, 16), torch.randn(1, 2, S, 16), torch.randn(1, 2, S, 16), torch.randn(2, 2 * S - 1))
    p = tc.transfer(rel_bias_table, *args)
    sites = load_sites(p)
    assert sites and all(name == "table" for name, _, _ in sites)
    from torch_cubridge.ir.bind import scalar_values
    for S2, ok in ((30, True), (20, True), (31, False)):
        sizes = {"B": 1, "H": 2, "Hkv": 2, "Sq": S2, "Skv": S2, "D": 16}
        scal = scalar_values(p, {}, sizes)
        msg = out_of_bounds(sites, sizes, scal, {"table": (2, 2 * S - 1)})
        assert (msg is None) == ok, msg


def test_runner_refuses_reads_outside_an_extra_tensor():
    """The kernel path hands an out-of-range read back to the spec instead of reading stray memory."""
    from torch_cubridge.ir.bind import scalar_values
    from torch_cubridge.ir.bounds import load_sites
    from torch_cubridge.ops.errors import SpecServes
    from torch_cubridge.ops.runner import KernelRunner
    from zoo import document_causal
    args = (torch.randn(2, 2, 24, 16),) * 3 + (torch.randint(0, 3, (2, 24)).sort(-1).values,)
    p = tc.transfer(document_causal, *args)
    r = KernelRunner.__new__(KernelRunner)  # only the bounds check, no CUDA needed
    r._sites, r._in_bounds = load_sites(p), set()
    scal = scalar_values(p, {}, {"B": 2, "H": 2, "Hkv": 2, "Sq": 24, "Skv": 24, "D": 16})
    r._check_bounds(2, 2, 2, 24, 24, 16, scal, {"doc": torch.zeros(2, 24)})
    with pytest.raises(SpecServes, match="doc has size 20"):
        r._check_bounds(2, 2, 2, 24, 24, 16, scal, {"doc": torch.zeros(2, 20)})
