"""What the transfer refuses: it raises UnsupportedSpec naming the op and the reason,
and never returns a wrong program."""
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import torch_cubridge as tc
from torch_cubridge.api import transfer_bound
from torch_cubridge.capture.trace import bind_example
from torch_cubridge.verify.cpu import verify_program
from zoo import alibi_tensor, rel_bias_table, softcap_causal


def qkv(S=32):
    return torch.randn(1, 2, S, 16), torch.randn(1, 2, S, 16), torch.randn(1, 2, S, 16)


def control_flow(q, k, v):
    s = q @ k.transpose(-1, -2)
    if s.max() > 0:  # a tensor value decides a branch
        s = s * 2
    return s.softmax(-1) @ v


def top_k(q, k, v):
    s = q @ k.transpose(-1, -2)
    kth = s.topk(4, dim=-1).values[..., -1:]
    return s.masked_fill(s < kth, float("-inf")).softmax(-1) @ v


def dropout_training(q, k, v):
    return F.dropout((q @ k.transpose(-1, -2)).softmax(-1), p=0.1, training=True) @ v


def sdpa_dropout(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, dropout_p=0.2)


def not_attention(q, k, v):
    return (q @ k.transpose(-1, -2)) @ v


def probs_scaled(q, k, v):  # per key: the weights the softmax gave change (a per-row factor would be served)
    return ((q @ k.transpose(-1, -2)).softmax(-1) * torch.linspace(0, 1, k.shape[-2])) @ v


def softmax_wrong_axis(q, k, v):
    return (q @ k.transpose(-1, -2)).softmax(-2) @ v


@pytest.mark.parametrize("fn, op, words", [
    (control_flow, None, "data-dependent"),
    (top_k, "torch.topk at test_unsupported.py", "top-k"),
    (dropout_training, None, "random"),
    (sdpa_dropout, "scaled_dot_product_attention", "dropout"),
    (not_attention, "torch.bmm at test_unsupported.py", "neither"),
    (probs_scaled, "torch.mul at test_unsupported.py", "along the key axis"),
    (softmax_wrong_axis, "torch.softmax at test_unsupported.py", "key axis"),
])
def test_refused_with_op_and_reason(fn, op, words):
    with pytest.raises(tc.UnsupportedSpec) as err:
        tc.transfer(fn, *qkv())
    if op is not None:
        assert err.value.op.startswith(op), err.value.op  # the user's spelling and line, not an aten name
    assert words in str(err.value)


def test_verification_rejects_a_wrong_scalar():
    args = qkv(40)
    res = transfer_bound(softcap_causal, bind_example(softcap_causal, args, {}))
    bad = replace(res.program, scalars=tuple(replace(s, value=s.value * 1.5) if s.kind == "float" else s
                                              for s in res.program.scalars))
    rep = verify_program(softcap_causal, bad, res.captured.example, generic=True)
    assert not rep.ok and "disagrees" in rep.reason


def test_verification_rejects_a_program_that_baked_example_values():
    args = qkv(20) + (torch.rand(2),)
    res = transfer_bound(alibi_tensor, bind_example(alibi_tensor, args, {}))
    x = res.program.extras[0]
    baked = replace(res.program, extras=(replace(x, arg=None, value=args[3].tolist()),))
    rep = verify_program(alibi_tensor, baked, res.captured.example, generic=True)
    assert not rep.ok


def test_verification_rejects_wrong_mask_offset():
    args = qkv(24) + (torch.randn(2, 47),)
    res = transfer_bound(rel_bias_table, bind_example(rel_bias_table, args, {}))
    assert res.generic  # the table offset S - 1 is fitted as a derived scalar
    derived = [s for s in res.program.scalars if s.expr is not None]
    assert derived
    shifted = replace(res.program, scalars=tuple(replace(s, expr=None, value=23) if s.expr is not None else s
                                                  for s in res.program.scalars))
    assert not verify_program(rel_bias_table, shifted, res.captured.example, generic=True).ok
