"""Wrong-answer probes: reuse only where guards prove a program holds.

Each probe captures a spec at one call and then calls it where a program
without guards would be wrong (the cases found on an H100 at 3a3f50b). The
answer must be the spec's, or a clear refusal. On the CPU the compiled
function always computes with the spec, so these tests look at the programs
and the dispatch table; tests/capture/test_guards_gpu.py repeats them through kernels.
"""
import math
import warnings

import pytest
import torch

import torch_cubridge as tc
from torch_cubridge.ir.program import Program
from helpers import rel_err, serve_through_program, to64


def qkv(B=1, H=4, S=128, D=32, Skv=None):
    return (torch.randn(B, H, S, D), torch.randn(B, H, Skv or S, D), torch.randn(B, H, Skv or S, D))


def windowed_if_long(q, k, v, window: int = 64):
    S = q.shape[-2]
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if S > window:  # a Python branch on a size
        i = torch.arange(S, device=q.device)
        s = s.masked_fill((i[:, None] - i[None, :]).abs() > window, float("-inf"))
    return torch.softmax(s, -1) @ v


def alibi_from_heads(q, k, v):
    H = q.shape[1]
    slopes = torch.tensor([2 ** (-8 * (h + 1) / H) for h in range(H)], device=q.device)  # a constant from a size
    i = torch.arange(q.shape[-2], device=q.device)
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    s = s - slopes[:, None, None] * (i[:, None] - i[None, :]).abs()
    return torch.softmax(s, -1) @ v


def alibi_arange(q, k, v):
    H = q.shape[1]
    slopes = torch.arange(1, H + 1, device=q.device) * (-8.0 / H)  # a size reaches the graph as a value
    s = q @ k.transpose(-1, -2) * 0.125
    return torch.softmax(s + slopes[:, None, None], -1) @ v


def softcap_attn(q, k, v, softcap: float = 50.0):
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    return torch.softmax(softcap * torch.tanh(s / softcap), -1) @ v


def explicit_scale(q, k, v, scale: float = 0.1):
    return torch.softmax(q @ k.transpose(-1, -2) * scale, -1) @ v


def nested_floordiv(q, k, v):
    i = torch.arange(q.shape[-2], device=q.device)
    keep = (i[:, None] // 16) // 4 >= (i[None, :] // 16) // 4
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return torch.softmax(s.masked_fill(~keep, float("-inf")), -1) @ v


def _agrees_or_refuses(p: Program, fn, args, **kw):
    """The program's answer is the spec's (fp64), or it refuses with ValueError naming a guard."""
    try:
        got = p.run(*args, **kw)
    except ValueError as e:
        assert "holds only where" in str(e)
        return "refused"
    assert rel_err(got, fn(*to64(args), **kw)) < 1e-6
    return "served"


def test_size_branch_is_a_guard():
    p = tc.transfer(windowed_if_long, *qkv(S=128))
    assert any("> 64" in str(g) for g in p.guards)
    assert _agrees_or_refuses(p, windowed_if_long, qkv(S=600)) == "served"   # same side of the branch
    assert _agrees_or_refuses(p, windowed_if_long, qkv(S=40)) == "refused"   # the other side


def test_constant_from_a_size_pins_it():
    p = tc.transfer(alibi_from_heads, *qkv(H=4))
    assert _agrees_or_refuses(p, alibi_from_heads, qkv(H=4, S=77)) == "served"
    assert _agrees_or_refuses(p, alibi_from_heads, qkv(H=2)) == "refused"


def test_size_reaching_the_graph_as_a_value_pins_it():
    p = tc.transfer(alibi_arange, *qkv(H=4))
    assert _agrees_or_refuses(p, alibi_arange, qkv(H=8)) == "refused"
    assert _agrees_or_refuses(p, alibi_arange, qkv(H=4, S=50)) == "served"


def test_head_dim_in_the_scale_pins_it_but_an_explicit_scale_does_not():
    p = tc.transfer(softcap_attn, *qkv(D=32))
    assert _agrees_or_refuses(p, softcap_attn, qkv(D=64)) == "refused"
    p = tc.transfer(explicit_scale, *qkv(D=32))
    assert _agrees_or_refuses(p, explicit_scale, qkv(D=64)) == "served"


def sqrt_of_size(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.size(-1)), -1) @ v


def head_dim_from_unpacking(q, k, v):
    *_, D = q.shape
    return torch.softmax((q @ k.transpose(-1, -2)) * (1.0 / D) ** 0.5, -1) @ v


@pytest.mark.parametrize("fn", [softcap_attn, sqrt_of_size, head_dim_from_unpacking])
@pytest.mark.parametrize("other", [16, 48, 64, 128])
def test_head_dim_pin_holds_for_every_other_head_dim(fn, other):
    """However the spec reads the head dim into its scale, a program made at D = 32 refuses every other
    head dim, and a compiled function captures again there and serves the spec's answer (through the
    program: tc.compile here serves by the CPU interpreter)."""
    p = tc.transfer(fn, *qkv(D=32))
    assert _agrees_or_refuses(p, fn, qkv(D=other)) == "refused"
    assert _agrees_or_refuses(p, fn, qkv(D=32, S=77)) == "served"


def test_compiled_function_serves_each_head_dim_its_own_program(monkeypatch):
    serve_through_program(monkeypatch)
    f = tc.compile(sqrt_of_size, fallback="raise")
    for D in (32, 64, 32, 128):
        args = qkv(D=D, S=50)
        assert rel_err(f(*args), sqrt_of_size(*to64(args))) < 1e-5, D
    assert f.served == {"kernel": 4}
    assert len([e for e in f.entries() if e.result is not None]) == 3


@pytest.mark.parametrize("round_trip", [False, True])
def test_program_run_refuses_other_python_values(round_trip):
    p = tc.transfer(softcap_attn, *qkv(), softcap=50.0)
    if round_trip:
        p = Program.from_json(p.to_json())
    args = qkv(S=40)
    assert _agrees_or_refuses(p, softcap_attn, args, softcap=50.0) == "served"
    assert _agrees_or_refuses(p, softcap_attn, args) == "served"          # the default is 50.0 too
    assert _agrees_or_refuses(p, softcap_attn, args, softcap=2.0) == "refused"


def test_compiled_function_captures_again_outside_the_guards(monkeypatch):
    serve_through_program(monkeypatch)  # the value compared is the program's, not the spec's own
    f = tc.compile(windowed_if_long, fallback="silent")
    for S in (128, 600, 40, 30):
        args = qkv(S=S)
        assert rel_err(f(*args), windowed_if_long(*to64(args))) < 1e-5
    assert f.served == {"kernel": 4}
    programs = [e.result.program for e in f.entries() if e.result is not None]
    assert len(programs) == 2  # S=600 reused the S=128 program; S=40 needed its own, which S=30 reused


def test_internal_errors_never_escape(monkeypatch):
    serve_through_program(monkeypatch)
    args = qkv(S=100)
    f = tc.compile(nested_floordiv)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = f(*args)
    assert f.served == {"kernel": 1}  # the program served, and it is the spec's answer
    assert rel_err(out, nested_floordiv(*to64(args))) < 1e-5
    p = tc.transfer(nested_floordiv, *args)  # interval analysis of (i // 16) // 4 no longer overflows
    assert _agrees_or_refuses(p, nested_floordiv, qkv(S=100)) == "served"


def test_guards_survive_json_and_print():
    p = tc.transfer(windowed_if_long, *qkv(S=128))
    q = Program.from_json(p.to_json())
    assert q == p and q.guards
    assert "guards" in str(p) and "q.shape[2] > 64" in str(p)


def windows_masked(q, k, v, mask):
    """Shifted-window masks without a position table: generic in the window length."""
    Bw, H, N, _ = q.shape
    nW = mask.shape[0]
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    s = (s.view(Bw // nW, nW, H, N, N) + mask.unsqueeze(1).unsqueeze(0)).view(-1, H, N, N)
    return s.softmax(-1) @ v


def test_window_count_from_a_view_shape_is_pinned(monkeypatch):
    """Swin splits the batch by view(B // nW, nW, ...): nW reaches the program as the constant of
    b % nW through a view's shape, which the shape guards do not record. The program must not serve
    another window count: its guards pin every dim of that size, and compile captures again."""
    serve_through_program(monkeypatch)

    def inputs(B, nW, N):
        return tuple(torch.randn(B, 4, N, 16) for _ in range(3)) + (
            torch.where(torch.rand(nW, N, N) > 0.3, 0.0, -100.0),)
    prog = tc.transfer(windows_masked, *inputs(8, 4, 49))
    assert not any(n in ("B", "Sq") for n, _ in prog.requires)  # generic: the pin is the guard's
    other = inputs(16, 8, 49)  # 8 windows, 2 images: B // nW as before, only nW differs
    with pytest.raises(ValueError):
        prog.run(*other)
    f = tc.compile(windows_masked)
    for args in (inputs(8, 4, 49), other, inputs(8, 4, 36)):
        assert rel_err(f(*args), windows_masked(*(a.double() for a in args))) < 1e-5
    assert f.served == {"kernel": 3}  # each served by a program of its own window count


def test_lengths_that_must_divide_generalise_on_multiples():
    """A spec that reshapes the sequence into chunks of 32 cannot run at the usual probe lengths (the
    call's plus or minus a few): it is probed at 2, 3 and 4 times the call's length instead, serves every
    multiple of 32, refuses other lengths by its guards, and is verified at small lengths that hold."""
    from torch_cubridge.capture.trace import bind_example
    from torch_cubridge.pipeline import transfer_stage
    from zoo import chunked_local_causal, qkv
    res = transfer_stage(chunked_local_causal, bind_example(chunked_local_causal,
                                                            qkv(2, 4, 4, 512, 512, 32, torch.float32), {}))
    assert res.generic and not any(n == "Sq" for n, _ in res.program.requires)
    assert res.report.trials and all(t.sizes["Sq"] < 512 for t in res.report.trials)
    for S in (96, 160):
        args = qkv(1, 4, 4, S, S, 32, torch.float64)
        assert rel_err(res.program.run(*args), chunked_local_causal(*args)) < 1e-6
    with pytest.raises(ValueError):
        res.program.run(*qkv(1, 4, 4, 100, 100, 32, torch.float64))
