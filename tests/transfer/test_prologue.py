"""Values off the score path that no rule covers are computed by PyTorch (the prologue): the spec's
own ops, replayed per call, read by the program as extra tensors."""
import pytest
import torch

import torch_cubridge as tc
from helpers import first, rel_err, to64
from torch_cubridge.capture.trace import bind_example, capture
from torch_cubridge.ir.program import Program
from torch_cubridge.ir.prologue import run_prologue
from torch_cubridge.transfer.symbolic_backend import symbolic_transfer
from torch_cubridge.verify.cpu import verify_program
from zoo import PROLOGUE, DynamicPosBias, forgetting_attention, mlp_position_bias, qkv


@pytest.mark.parametrize("case", PROLOGUE, ids=[c.name for c in PROLOGUE])
def test_prologue_case_matches_spec(case):
    prog = tc.transfer(case.fn, *case.make(2, 4, 2, 70, 64, torch.float32))
    ops = [s.op.split(".")[1] if "." in s.op else s.op for s in prog.prologue]
    for op in case.expect["steps"]:
        assert op in ops, ops
    assert any(x.step for x in prog.extras) or case.expect.get("computed")
    if "block_rule" in case.expect:
        assert prog.block_rule == case.expect["block_rule"]
    computed = "".join(r for r, op in (("q", prog.q), ("k", prog.k), ("v", prog.v)) if op.step)
    assert computed == case.expect.get("computed", "")
    # new values at the program's shape: the interpreter, prologue included, in the captured dtype
    # (its casts are the spec's own), against the spec in fp64
    args = case.make(2, 4, 2, 70, 64, torch.float32)
    got, ref = first(prog.run(*args)), first(case.fn(*to64(args)))
    assert rel_err(got, ref) < 2e-5
    # the program's JSON carries the prologue and runs the same
    again = Program.from_json(prog.to_json())
    assert again == prog
    assert torch.equal(first(again.run(*args)), got)


@pytest.mark.parametrize("case", PROLOGUE, ids=[c.name for c in PROLOGUE])
def test_without_prologue_refused_or_right(case):
    """Without the prologue the walk refuses these, or makes a program that holds only where it is right:
    T5's buckets from float maths, which the spec computes in float32 and the program's compares, floors and
    casts too (as the kernel does), verify, and then match the spec at other values."""
    bound = bind_example(case.fn, case.make(2, 4, 2, 70, 64, torch.float32), {})
    try:
        prog = symbolic_transfer(capture(case.fn, bound), prologue=False)
    except tc.UnsupportedSpec:
        return
    if not verify_program(case.fn, prog, bound, generic=False).ok:
        return
    torch.manual_seed(1)
    args = to64(case.make(2, 4, 2, 70, 64, torch.float32))
    assert rel_err(first(prog.run(*args)), first(case.fn(*args))) < 1e-6


def test_prologue_reads_each_calls_values():
    """The gates are read per call, not baked: other gates give the spec's other answer."""
    q, k, v = qkv(1, 2, 2, 40, 40, 32, torch.float64)
    g1 = torch.nn.functional.logsigmoid(torch.randn(1, 2, 40, dtype=torch.float64))
    prog = tc.transfer(forgetting_attention, q.float(), k.float(), v.float(), g1.float())
    assert prog.prologue and prog.prologue[0].args[0] == ("@arg", "log_f")
    g2 = g1 * 3
    out1, out2 = prog.run(q, k, v, g1), prog.run(q, k, v, g2)
    assert rel_err(out2, forgetting_attention(q, k, v, g2)) < 1e-6
    assert rel_err(out1, out2) > 1e-3


def test_prologue_keeps_autograd_visible():
    """Weights that need gradients make prologue tensors that need them, so the kernel (no backward)
    steps aside for the spec instead of dropping the gradient."""
    dpb = DynamicPosBias(2)
    q, k, v = qkv(1, 2, 2, 24, 24, 32, torch.float32)
    prog = tc.transfer(mlp_position_bias, q, k, v, dpb)
    made = run_prologue(prog, {"q": q, "k": k, "v": v, "dpb": dpb}, q.device)
    assert made and all(t.requires_grad for t in made.values())
    with torch.no_grad():
        made = run_prologue(prog, {"q": q, "k": k, "v": v, "dpb": dpb}, q.device)
    assert not any(t.requires_grad for t in made.values())


def test_prologue_literals_fitted_to_the_lengths():
    """torch.arange(S) inside the prologue becomes arange(Sq) (fitted on probes, checked at other
    lengths): the program serves another length, while batch and heads stay pinned (a call with
    another batch is refused by its guards; compile captures again there)."""
    case = next(c for c in PROLOGUE if c.name == "block_causal_shift")
    prog = tc.transfer(case.fn, *case.make(1, 2, 2, 48, 32, torch.float32))
    assert ("@size", 0, (("Sq", 1),)) in prog.prologue[0].args
    assert not any(n in ("Sq", "Skv") for n, _ in prog.requires) and ("B", 1) in prog.requires
    for S in (50, 130):
        args = case.make(1, 2, 2, S, 32, torch.float32)
        assert rel_err(first(prog.run(*args)), first(case.fn(*to64(args)))) < 2e-5
    with pytest.raises(ValueError):
        prog.run(*case.make(2, 2, 2, 48, 32, torch.float32))
    f = tc.compile(case.fn)
    for B, S in ((1, 48), (1, 50), (2, 48)):
        args = case.make(B, 2, 2, S, 32, torch.float32)
        assert rel_err(first(f(*args)), first(case.fn(*args))) < 1e-5


def test_latent_query_baked_into_a_bound_method_is_refused():
    """A latent query read from `self` of a bound method would be baked into the program (stale once
    trained, its gradient dropped): refused with the reason; the module as an argument is served."""
    from zoo import Latents, perceiver_latents

    class Bound(Latents):
        def forward(self, k, v):
            return perceiver_latents(self, k, v)

    m = Bound(8, 2, 16)
    _, k, v = qkv(2, 2, 2, 30, 30, 16, torch.float32)
    with pytest.raises(tc.UnsupportedSpec, match="outside its arguments"):
        tc.transfer(m.forward, k, v)
    prog = tc.transfer(perceiver_latents, m, k, v)
    assert prog.q.step and prog.prologue[0].args[0] == ("@arg", "module.latents")


@pytest.mark.parametrize("name", ["t5_relative_bias", "bessel_distance_bias"])
def test_function_of_the_distance_is_a_table_over_distances(name):
    """A value that depends on the positions only through kv - q (T5's buckets and the bias gathered
    through them; a Bessel function of q - kv) is computed over the Sq + Skv - 1 distances, not the
    Sq x Skv grid, and read at kv - q + Sq - 1; the program serves other lengths."""
    case = next(c for c in PROLOGUE if c.name == name)
    prog = tc.transfer(case.fn, *case.make(1, 2, 2, 48, 32, torch.float32))
    (x,) = [x for x in prog.extras if x.step]
    for S in (48, 80):
        args = case.make(1, 2, 2, S, 32, torch.float32)
        bound = bind_example(case.fn, args, {})
        made = run_prologue(prog, bound, torch.device("cpu"))
        sq, skv = args[0].shape[-2], args[1].shape[-2]
        assert made[x.step].shape[:2] == (1, sq + skv - 1)  # not sq x skv
        assert rel_err(first(prog.run(*args)), first(case.fn(*to64(args)))) < 2e-5


def test_a_captured_constant_is_made_once_per_program_and_device():
    """A constant step argument is built from its nested values once, not on every call (60 ms a call
    for a 1M-element table)."""
    from torch_cubridge.ir.prologue import _decode
    c = ("@const", "float32", ((1.0, 2.0), (3.0, 4.0)))
    a = _decode(c, {}, {}, torch.device("cpu"), {})
    b = _decode(c, {}, {}, torch.device("cpu"), {})
    assert a is b and a.tolist() == [[1.0, 2.0], [3.0, 4.0]]


def test_a_constant_made_under_fake_tensors_is_not_kept():
    """The symbolic-lengths run replays steps over fake tensors: a constant made there is fake, and a
    later real call must get a real one (a kept fake was an illegal address on the GPU)."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch_cubridge.ir.prologue import _decode
    c = ("@const", "int64", (-2,))
    with FakeTensorMode():
        fake = _decode(c, {}, {}, torch.device("cpu"), {})
    real = _decode(c, {}, {}, torch.device("cpu"), {})
    assert isinstance(fake, FakeTensor) and not isinstance(real, FakeTensor) and real.tolist() == [-2]
