"""The backward of CuIR programs (ir/backward.py) against torch.autograd of the spec, in float64.

Gradients of q, k, v and of every floating tensor the spec reads (tables, slopes, temperatures, sinks, a
module's parameters) must match the spec's own autograd to float64 rounding."""
import math

import pytest
import torch
import torch.nn as nn

import torch_cubridge as tc
from torch_cubridge.errors import UnsupportedSpec
from torch_cubridge.ir.backward import run_with_grad
from torch_cubridge.ir.derivative import NotDifferentiable
from torch_cubridge.ir.expr import call, const, var
from torch_cubridge.ir.program import Operand, Output, Program
from zoo import CASES

TOL = 1e-11  # float64: every gradient is a few hundred roundings from the spec's own
# specs that compute in float32 on float64 inputs, so the spec is no float64 reference there
SPEC_IN_FLOAT32 = {"full_bshd": "its softmax runs with dtype=torch.float32"}


def _err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach(), ref.detach()
    return float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-300))


def _leaves(args: tuple) -> list:
    """The call's floating tensors in float64, requiring grad (a module's parameters included)."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            out.append(a.detach().double().requires_grad_())
        else:
            out.append(a)
    return out


def _params(args: list) -> list[torch.Tensor]:
    ts = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    return ts + [p for a in args if isinstance(a, nn.Module) for p in a.parameters()]


def check_grads(fn, args: tuple, tol: float = TOL, ref_fn=None) -> list[torch.Tensor]:
    """Transfer fn, run the program with grad and compare each gradient with the spec's (or ref_fn's)."""
    call_args = _leaves(args)
    prog = tc.transfer(fn, *call_args)
    leaves = _params(call_args)
    out = run_with_grad(prog, *call_args)
    ref = (ref_fn or fn)(*call_args)
    out, ref = (x[0] if isinstance(x, tuple) else x for x in (out, ref))
    assert _err(out, ref) < tol, "forward"
    g_out = torch.randn_like(ref)
    got = torch.autograd.grad(out, leaves, g_out, allow_unused=True)
    want = torch.autograd.grad(ref, leaves, g_out, allow_unused=True)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a is not None and b is not None, f"gradient {i} missing"
        assert torch.isfinite(a).all(), f"gradient {i} not finite"
        assert _err(a, b) < tol, f"gradient {i}: {_err(a, b):.2e}"
    return list(got)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_zoo_gradients_match_spec(case):
    torch.manual_seed(0)
    # one query tile (the tests below take two); H 4 over Hkv 2 where the case groups heads
    check_grads(case.fn, case.make(2, 4, 2, 40, 8, torch.float64),
                tol=1e-6 if case.name in SPEC_IN_FLOAT32 else TOL)


# ---- learnable score terms beyond the zoo ------------------------------------------------------
class Learnable(nn.Module):
    def __init__(self, H: int) -> None:
        super().__init__()
        self.slopes = nn.Parameter(torch.rand(H, dtype=torch.float64))
        self.temp = nn.Parameter(1 + torch.rand(H, dtype=torch.float64))


def alibi_temperature_module(q, k, v, m):
    """ALiBi slopes and a per-head temperature held as a module's parameters (the temperature divides)."""
    S = q.shape[-2]
    dist = (torch.arange(S, device=q.device)[None, :] - torch.arange(S, device=q.device)[:, None]).abs()
    s = q @ k.transpose(-1, -2) / m.temp[None, :, None, None] - m.slopes[None, :, None, None] * dist
    return s.softmax(-1) @ v


def t5_buckets(q, k, v, table):
    """T5-style relative buckets (exact near, logarithmic far, by direction) into a learnable [16, H]."""
    S = q.shape[-2]
    rel = torch.arange(S, device=q.device)[None, :] - torch.arange(S, device=q.device)[:, None]
    far = (4 + (rel.abs().clamp(min=1).float() / 4).log() / math.log(8) * 4).long().clamp(max=7)
    bucket = torch.where(rel.abs() < 4, rel.abs(), far) + (rel > 0).long() * 8
    s = q @ k.transpose(-1, -2) + table[bucket].permute(2, 0, 1)
    return s.softmax(-1) @ v


def softcap_rel_bias(q, k, v, table):
    """A softcap over a learnable [H, 2S-1] table: the table's gradient passes through 1 - tanh^2."""
    S = q.shape[-2]
    rel = torch.arange(S, device=q.device)[None, :] - torch.arange(S, device=q.device)[:, None] + S - 1
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 + table[:, rel]
    return torch.softmax(20.0 * torch.tanh(s / 20.0), -1) @ v


def row_sinks(q, k, v, sinks):
    """A learnable sink logit per head and query row, causal: the program's row scale sigmoid(lse - c)."""
    S = q.shape[-2]
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    s = s.masked_fill(~torch.ones(S, S, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    col = sinks[None, :, :, None].expand(q.shape[0], -1, -1, 1)
    return torch.cat([s, col], dim=-1).softmax(-1)[..., :-1] @ v


def returns_lse(q, k, v):
    """The rows' log-sum-exp returned beside the output: its gradient enters the backward as dLSE."""
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    lse = s.logsumexp(-1)
    return (s - lse[..., None]).exp() @ v, lse


def _qkv(B=2, H=4, S=70, D=16):
    return tuple(torch.randn(B, H, S, D, dtype=torch.float64) for _ in range(3))


def test_module_parameters_alibi_and_temperature():
    torch.manual_seed(1)
    g = check_grads(alibi_temperature_module, _qkv() + (Learnable(4),))
    assert g[3].abs().max() > 0 and g[4].abs().max() > 0  # slopes and temperature both learn


def test_t5_bucket_table():
    torch.manual_seed(2)
    check_grads(t5_buckets, _qkv() + (torch.randn(16, 4, dtype=torch.float64),))


def test_softcap_over_relative_table():
    torch.manual_seed(3)
    check_grads(softcap_rel_bias, _qkv(S=40) + (torch.randn(4, 79, dtype=torch.float64),))


def test_sink_per_query_row():
    torch.manual_seed(4)
    check_grads(row_sinks, _qkv() + (torch.randn(4, 70, dtype=torch.float64),))


def test_returned_lse_gets_its_gradient():
    torch.manual_seed(5)
    q, k, v = _leaves(_qkv(S=40))
    prog = tc.transfer(returns_lse, q, k, v)
    out, lse = run_with_grad(prog, q, k, v)
    ref, ref_lse = returns_lse(q, k, v)
    g, g_lse = torch.randn_like(ref), torch.randn_like(ref_lse)
    got = torch.autograd.grad((out, lse), (q, k, v), (g, g_lse))
    want = torch.autograd.grad((ref, ref_lse), (q, k, v), (g, g_lse))
    for a, b in zip(got, want):
        assert _err(a, b) < TOL


# ---- rows with no key ----------------------------------------------------------------------------
def padded_queries(q, k, v, qdoc, kdoc):
    keep = qdoc[:, None, :, None] == kdoc[:, None, None, :]
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    return s.masked_fill(~keep, float("-inf")).softmax(-1) @ v


def padded_queries_safe(q, k, v, qdoc, kdoc):
    """The same attention with rows of no key written as zeros, so its autograd is NaN-free."""
    keep = qdoc[:, None, :, None] == kdoc[:, None, None, :]
    any_key = keep.any(-1, keepdim=True)
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    x = torch.where(any_key, s.masked_fill(~keep, float("-inf")), torch.zeros_like(s))
    return (x.softmax(-1) * any_key) @ v


def test_fully_masked_rows_have_finite_zero_gradients():
    torch.manual_seed(6)
    B, S = 2, 70
    qdoc = torch.randint(0, 3, (B, S))
    kdoc = torch.randint(1, 3, (B, S))  # no key of document 0: its queries see nothing
    assert (qdoc == 0).any()
    dq = check_grads(padded_queries, _qkv(B=B, S=S) + (qdoc, kdoc), ref_fn=padded_queries_safe)[0]
    empty = (qdoc == 0)[:, None, :, None].expand_as(dq)
    assert (dq[empty] == 0).all()


def finfo_padded(q, k, v, mask):
    """An eager-style additive mask: padded query rows filled whole with finfo(float32).min."""
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + mask
    return torch.softmax(s, dim=-1) @ v


def test_rows_filled_whole_with_a_finite_fill_get_the_uniform_rows_gradient():
    """The fill absorbs the scores and log(count) alike (the LSE is the fill): the row is uniform over its
    keys, in the forward and in the gradients (P from the LSE alone would be 1 on every key)."""
    torch.manual_seed(7)
    B, S = 2, 40
    mask = torch.zeros(B, 1, S, S)
    mask[0, :, :6] = torch.finfo(torch.float32).min  # six query rows with every key filled
    mask[1, :, :, :3] = torch.finfo(torch.float32).min  # and keys masked in ordinary rows
    check_grads(finfo_padded, _qkv(B=B, S=S) + (mask,))


# ---- refusals ------------------------------------------------------------------------------------
def _program(score, mask=None):
    op = Operand("q", ("b", "h", "s", "d"))
    return Program(signature=("q", "k", "v"), q=op, k=Operand("k", op.dims), v=Operand("v", op.dims),
                   score=score, out=Output(op.dims), mask=mask, block_rule="none" if mask is None else "interval")


def test_step_function_of_the_score_is_refused():
    prog = _program(call("floor", call("mul", var("s"), const(4.0))))
    q, k, v = _leaves(_qkv(B=1, H=1, S=8, D=8))
    out = run_with_grad(prog, q, k, v)  # the forward runs; the backward names the op it cannot derive
    with pytest.raises(NotDifferentiable, match="floor") as err:
        out.sum().backward()
    assert isinstance(err.value, UnsupportedSpec)


def test_step_functions_of_indices_have_no_gradient():
    # a band mask through mod and a floored index bias: only indices move them, so the gradient is s's alone
    band = call("eq", call("mod", call("sub", var("q"), var("kv")), const(3)), const(0))
    score = call("add", call("mul", var("s"), const(0.25)), call("to_float", call("floordiv", var("kv"), const(4))))
    prog = _program(score, call("or", band, call("ge", var("q"), var("kv"))))
    q, k, v = _leaves(_qkv(B=1, H=2, S=20, D=8))
    out = run_with_grad(prog, q, k, v)
    i = torch.arange(20)
    keep = ((i[:, None] - i[None, :]) % 3 == 0) | (i[:, None] >= i[None, :])
    s = q @ k.transpose(-1, -2) * 0.25 + (i[None, :] // 4).double()
    ref = s.masked_fill(~keep, float("-inf")).softmax(-1) @ v
    g = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        assert _err(a, b) < TOL
