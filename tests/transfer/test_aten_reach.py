"""Every op a spec may reach on its scores (pointwise maths, comparisons, reductions, casts, bit and integer
ops, shape ops) either transfers to a program that verifies against the spec in float64, or is refused
cleanly: UnsupportedSpec naming the op, never an internal error or any other exception."""
import math
import warnings

import pytest
import torch

import torch_cubridge as tc
from torch_cubridge.capture.trace import bind_example, capture
from torch_cubridge.transfer import symbolic_transfer
from torch_cubridge.verify.cpu import verify_program
from zoo import qkv

T = torch
# Each op applied to the scores s (float) and to i, j (the query and key positions, int64).
SCORE_OPS = {
    "abs": T.abs, "neg": T.neg, "exp": lambda s: T.exp(s / 8), "exp2": lambda s: T.exp2(s / 8),
    "expm1": lambda s: T.expm1(s / 8), "log": lambda s: T.log(s.abs() + 1), "log2": lambda s: T.log2(s.abs() + 1),
    "log10": lambda s: T.log10(s.abs() + 1), "log1p": lambda s: T.log1p(s.abs()), "sqrt": lambda s: T.sqrt(s.abs()),
    "rsqrt": lambda s: T.rsqrt(s.abs() + 1), "tanh": T.tanh, "sigmoid": T.sigmoid, "sin": T.sin, "cos": T.cos,
    "tan": lambda s: T.tan(s / 100), "atan": T.atan, "asinh": T.asinh, "erf": T.erf, "erfc": T.erfc,
    "sign": T.sign, "sgn": T.sgn, "floor": T.floor, "ceil": T.ceil, "round": T.round, "trunc": T.trunc,
    "frac": T.frac, "reciprocal": lambda s: T.reciprocal(s.abs() + 1), "square": T.square,
    "pow": lambda s: T.pow(s, 2), "pow_tensor": lambda s: T.pow(2.0, s / 8), "relu": T.relu,
    "gelu": T.nn.functional.gelu, "silu": T.nn.functional.silu, "softplus": T.nn.functional.softplus,
    "elu": T.nn.functional.elu, "leaky_relu": T.nn.functional.leaky_relu, "hardtanh": T.nn.functional.hardtanh,
    "logsigmoid": T.nn.functional.logsigmoid, "mish": T.nn.functional.mish, "clamp": lambda s: T.clamp(s, -5, 5),
    "clamp_min": lambda s: T.clamp_min(s, -5), "clamp_max": lambda s: T.clamp_max(s, 5),
    "clamp_tensor": lambda s: T.clamp(s, min=T.tensor(-5.0), max=T.tensor(5.0)),
    "maximum": lambda s: T.maximum(s, s.new_tensor(0.5)), "minimum": lambda s: T.minimum(s, T.zeros_like(s)),
    "fmax": lambda s: T.fmax(s, s.new_tensor(0.5)), "fmin": lambda s: T.fmin(s, s.new_tensor(0.5)),
    "remainder": lambda s: T.remainder(s, 3.0), "fmod": lambda s: T.fmod(s, 3.0), "atan2": lambda s: T.atan2(s, s + 3),
    "hypot": lambda s: T.hypot(s, s), "lerp": lambda s: T.lerp(s, T.tanh(s), 0.3), "addcmul": lambda s: T.addcmul(s, s, s, value=0.1),
    "addcdiv": lambda s: T.addcdiv(s, s, s.abs() + 1, value=0.1), "xlogy": lambda s: T.xlogy(s.abs(), s.abs() + 1),
    "where": lambda s: T.where(s > 0, s, 0.5 * s), "masked_fill": lambda s: s.masked_fill(s > 30, 30.0),
    "nan_to_num": T.nan_to_num, "isnan": lambda s: T.where(T.isnan(s), 0.0, s),
    "isinf": lambda s: T.where(T.isinf(s), 0.0, s), "isfinite": lambda s: T.where(T.isfinite(s), s, 0.0),
    "signbit": lambda s: T.where(T.signbit(s), s, 2 * s), "logical_xor": lambda s: T.where((s > 0) ^ (s > 1), s, -s),
    "copysign": lambda s: T.copysign(s, s - 1), "heaviside": lambda s: s * T.heaviside(s, s.new_tensor(0.5)),
    "to_half": lambda s: s.half().float(), "to_bf16": lambda s: s.bfloat16().float(), "to_int": lambda s: s.int() * 1.0,
    "to_double": lambda s: s.double().float(), "type_as": lambda s: s.type_as(s),
    "mean": lambda s: s - s.mean(-1, keepdim=True), "sum": lambda s: s - s.sum(-1, keepdim=True) / 100,
    "amax": lambda s: s - s.amax(-1, keepdim=True), "amin": lambda s: s - s.amin(-1, keepdim=True),
    "max_dim": lambda s: s - s.max(-1, keepdim=True).values, "min_dim": lambda s: s - s.min(-1, keepdim=True).values,
    "logsumexp": lambda s: s - T.logsumexp(s, -1, keepdim=True), "std": lambda s: s / (s.std(-1, keepdim=True) + 1),
    "var": lambda s: s / (s.var(-1, keepdim=True) + 1), "norm": lambda s: s / (s.norm(dim=-1, keepdim=True) + 1),
    "prod": lambda s: s + T.tanh(s).prod(-1, keepdim=True), "cumsum": lambda s: T.cumsum(s, -1) / 10,
    "cummax": lambda s: T.cummax(s, -1).values, "max_all": lambda s: s - s.max(), "sum_all": lambda s: s - s.sum() / 1e3,
    "mean_q": lambda s: s - s.mean(-2, keepdim=True), "flip": lambda s: T.flip(s, (-1,)), "roll": lambda s: T.roll(s, 1, -1),
    "sort": lambda s: T.sort(s, -1).values, "topk": lambda s: s.masked_fill(s < T.topk(s, 3, -1).values[..., -1:], -1e9),
    "argmax": lambda s: s.masked_fill(T.arange(s.shape[-1]) == s.argmax(-1, keepdim=True), 0.0),
    "softmax_twice": lambda s: T.softmax(s, -1) * 10, "layer_norm": lambda s: T.nn.functional.layer_norm(s, s.shape[-1:]),
    "dropout_eval": lambda s: T.nn.functional.dropout(s, 0.1, training=False), "tril": lambda s: T.tril(s),
    "triu": lambda s: T.triu(s, 1), "diagonal": lambda s: s - T.diag_embed(T.diagonal(s, 0, -2, -1)),
    "transpose": lambda s: s.transpose(-1, -2), "contiguous": lambda s: s.contiguous().clone(),
    "cat_cols": lambda s: T.cat([s[..., :3], s[..., 3:]], -1), "pad": lambda s: T.nn.functional.pad(s, (0, 1))[..., :-1],
    "index_put": lambda s: s.index_put((T.tensor([0]),), T.tensor(0.0)), "scatter": lambda s: s.scatter(-1, T.zeros_like(s, dtype=T.long)[..., :1], 0.0),
    "gather": lambda s: T.gather(s, -1, T.arange(s.shape[-1]).expand_as(s).contiguous()),
}
POS_OPS = {  # on the int64 positions i (queries) and j (keys): a mask of s
    "bitwise_and": lambda i, j: (i & j) == 0, "bitwise_or": lambda i, j: (i | j) >= i, "bitwise_xor": lambda i, j: (i ^ j) < 4,
    "shift_right": lambda i, j: (i >> 2) == (j >> 2), "shift_left": lambda i, j: (j << 1) <= (i << 1) + 2,
    "floor_divide": lambda i, j: i // 4 >= j // 4, "remainder": lambda i, j: (i - j) % 3 == 0, "abs": lambda i, j: (i - j).abs() < 5,
    "bool_minus": lambda i, j: ((i >= j).int() - (i - j > 4).int()) > 0, "bool_add": lambda i, j: (i >= j) + (j == 0),
    "bool_mul": lambda i, j: (i >= j) * (i - j < 6), "maximum": lambda i, j: T.maximum(i, j) == i,
    "minimum": lambda i, j: T.minimum(i, j) == j, "clamp": lambda i, j: (i - j).clamp(0, 4) == i - j,
    "float_div": lambda i, j: (i / (j + 1)) >= 1, "sqrt": lambda i, j: T.sqrt(i.float()) >= T.sqrt(j.float()),
    "logical_not": lambda i, j: T.logical_not(j > i), "logical_xor": lambda i, j: T.logical_xor(i >= j, i > 100),
    "eq_ne": lambda i, j: (i == j) | (i != j) & (i > j), "to_bool": lambda i, j: (i - j + 1).clamp(min=0).bool(),
}


def _score_spec(op):
    def spec(q, k, v):
        s = op(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]))
        return torch.softmax(s, dim=-1) @ v
    return spec


def _mask_spec(op):
    def spec(q, k, v):
        i = torch.arange(q.shape[-2], device=q.device)[:, None]
        j = torch.arange(k.shape[-2], device=q.device)[None, :]
        keep = op(i, j) | (i == j)  # every row keeps its diagonal
        s = (q @ k.transpose(-1, -2)).masked_fill(~keep, float("-inf"))
        return torch.softmax(s, dim=-1) @ v
    return spec


def _transfers_or_refuses(fn) -> None:
    args = qkv(1, 2, 2, 11, 11, 8, torch.float32)
    bound = bind_example(fn, args, {})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            prog = symbolic_transfer(capture(fn, bound))
        except tc.UnsupportedSpec as e:
            assert "internal error" not in str(e), str(e)
            assert e.op or e.reason, "a refusal names its op or cause"
            return
        report = verify_program(fn, prog, bound, generic=False)
    assert report.ok or "Error" not in report.reason, report.summary()  # it ran; a disagreement is a refusal


@pytest.mark.parametrize("name", sorted(SCORE_OPS))
def test_op_on_the_scores_transfers_or_is_refused(name):
    _transfers_or_refuses(_score_spec(SCORE_OPS[name]))


@pytest.mark.parametrize("name", sorted(POS_OPS))
def test_op_on_the_positions_transfers_or_is_refused(name):
    _transfers_or_refuses(_mask_spec(POS_OPS[name]))
