"""A seeded generator of attention specs composed from the ops the symbolic walker knows: layouts of q, k and v
(views, permutes, reshapes, a torch.cat of head-dim halves), elementwise maths on the scores (scale, tanh softcap,
exp/log, clamp, where), masks (causal, window, arithmetic on bools, finite fills, a bool mask argument), biases
(tensors and module parameters in float32 or bfloat16) and the softmax in its spellings. A spec is a list of
choices read by one function, so a failing case prints as its choices."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

LAYOUTS = ("bhsd", "bshd", "merged", "cat_d", "param_q")
SCALES = ("mul", "div_sqrt", "pre_q", "baddbmm", "none")
SCORE_OPS = ("softcap", "explog", "clamp", "clamp_tensor", "where_half", "neg_neg", "sigmoid_gate")
MASKS = ("causal", "window", "bool_minus", "bool_count", "bool_add", "finite_fill", "where_fill", "mask_arg", "none")
BIASES = ("tensor_f32", "tensor_bf16", "param_f32", "param_bf16", "alibi", "none")
SOFTMAXES = ("softmax", "method_f32", "by_hand", "log_softmax_exp")


@dataclass(frozen=True)
class Spec:
    layout: str
    scale: str
    score_ops: tuple[str, ...]
    mask: str
    bias: str
    softmax: str
    fill: float
    window: int
    sizes: tuple[int, int, int, int]   # B, H, S, D

    def __str__(self) -> str:
        return (f"layout={self.layout} scale={self.scale} ops={','.join(self.score_ops) or '-'} mask={self.mask} "
                f"bias={self.bias} softmax={self.softmax} fill={self.fill:g} window={self.window} sizes={self.sizes}")


def draw(rng: random.Random) -> Spec:
    return Spec(rng.choice(LAYOUTS), rng.choice(SCALES), tuple(rng.sample(SCORE_OPS, rng.randint(0, 2))),
                rng.choice(MASKS), rng.choice(BIASES), rng.choice(SOFTMAXES),
                rng.choice((-math.inf, -1e9, torch.finfo(torch.float32).min, -1e4)), rng.randint(1, 9),
                (rng.randint(1, 2), rng.choice((1, 2, 3)), rng.randint(5, 23), rng.choice((8, 16))))


class Held(nn.Module):
    """The parameters a spec reads from a module argument: a bias per head and query/key, a gain on q."""

    def __init__(self, H: int, S: int, D: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.bias = nn.Parameter((0.5 * torch.randn(H, S, S)).to(dtype))
        self.gain = nn.Parameter((1 + 0.1 * torch.randn(D)).to(dtype))
        self.register_buffer("slopes", torch.tensor([2.0 ** -(i + 1) for i in range(H)]).to(dtype))


def make_args(spec: Spec, dtype: torch.dtype = torch.float32) -> tuple[Any, ...]:
    """(q, k, v, module, bias tensor, bool mask) in the spec's layout, values fresh from torch's generator."""
    B, H, S, D = spec.sizes
    shape = (B, S, H, D) if spec.layout in ("bshd",) else (B, S, H * D) if spec.layout == "merged" else (B, H, S, D)
    q, k, v = (torch.randn(shape, dtype=dtype) for _ in range(3))
    bias_dt = torch.bfloat16 if spec.bias.endswith("bf16") else torch.float32
    module = Held(H, S, D, bias_dt)
    bias = (0.5 * torch.randn(1, H, S, S)).to(bias_dt)
    mask = torch.rand(B, 1, S, S) < 0.7
    mask |= torch.eye(S, dtype=torch.bool)  # every row keeps a key
    return q, k, v, module, bias, mask


def build(spec: Spec):
    """The spec as a plain PyTorch function of (q, k, v, module, bias, mask)."""
    B, H, S, D = spec.sizes

    def fn(q, k, v, module, bias, mask):
        if spec.layout == "bshd":
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        elif spec.layout == "merged":
            q, k, v = (t.view(t.shape[0], t.shape[1], H, -1).permute(0, 2, 1, 3) for t in (q, k, v))
        elif spec.layout == "cat_d":  # the head dim in two halves, joined again
            q = torch.cat([q[..., : D // 2], q[..., D // 2:]], dim=-1)
        elif spec.layout == "param_q":
            q = q * module.gain.to(q.dtype)
        n = q.shape[-2]
        if spec.scale == "pre_q":
            q = q / math.sqrt(q.shape[-1])
        if spec.scale == "baddbmm":
            s = torch.baddbmm(torch.zeros(q.shape[0] * q.shape[1], n, n, dtype=q.dtype),
                              q.reshape(-1, n, q.shape[-1]), k.reshape(-1, n, k.shape[-1]).transpose(1, 2),
                              beta=0.0, alpha=q.shape[-1] ** -0.5).view(q.shape[0], q.shape[1], n, n)
        else:
            s = q @ k.transpose(-2, -1)
        if spec.scale == "mul":
            s = s * q.shape[-1] ** -0.5
        elif spec.scale == "div_sqrt":
            s = s / math.sqrt(q.shape[-1])
        for op in spec.score_ops:
            if op == "softcap":
                s = 20.0 * torch.tanh(s / 20.0)
            elif op == "explog":
                s = torch.log(torch.exp(s / 8) + 1e-3) * 8
            elif op == "clamp":
                s = s.clamp(min=-30.0, max=30.0)
            elif op == "clamp_tensor":
                s = torch.clamp(s, max=torch.tensor(25.0, dtype=s.dtype))
            elif op == "where_half":
                s = torch.where(s > 1.0, s, 0.5 * s)
            elif op == "neg_neg":
                s = -(-s)
            elif op == "sigmoid_gate":
                s = s * torch.sigmoid(s / 4)
        if spec.bias in ("tensor_f32", "tensor_bf16"):
            s = s + bias
        elif spec.bias in ("param_f32", "param_bf16"):
            s = s + module.bias
        elif spec.bias == "alibi":
            i = torch.arange(n, device=q.device)
            s = s - module.slopes.view(-1, 1, 1).to(s.dtype) * (i[:, None] - i[None, :]).abs()
        i = torch.arange(n, device=q.device)
        causal = i[:, None] >= i[None, :]
        if spec.mask == "causal":
            s = s.masked_fill(~causal, spec.fill)
        elif spec.mask == "window":
            s = s.masked_fill(~(causal & (i[:, None] - i[None, :] < spec.window)), spec.fill)
        elif spec.mask == "bool_minus":
            far = (i[:, None] - i[None, :]) >= spec.window
            s = s.masked_fill((causal.int() - far.int()) == 0, spec.fill)
        elif spec.mask == "bool_count":
            near = (i[:, None] - i[None, :]).abs() < spec.window
            s = s.masked_fill((causal.long() + near.long()) < 2, spec.fill)
        elif spec.mask == "bool_add":
            first = i[None, :] == 0
            s = s.masked_fill(~(causal * (first + (i[:, None] - i[None, :] < spec.window))), spec.fill)
        elif spec.mask == "finite_fill":
            s = s.masked_fill(~causal, torch.finfo(s.dtype).min)
        elif spec.mask == "where_fill":
            s = torch.where(causal, s, torch.full_like(s, -1e9))
        elif spec.mask == "mask_arg":
            s = s.masked_fill(~mask, spec.fill)
        if spec.softmax == "softmax":
            p = torch.softmax(s, dim=-1)
        elif spec.softmax == "method_f32":
            p = s.softmax(-1, dtype=torch.float32).to(q.dtype)
        elif spec.softmax == "by_hand":
            e = torch.exp(s - s.amax(dim=-1, keepdim=True))
            p = e / e.sum(dim=-1, keepdim=True)
        else:
            p = torch.log_softmax(s, dim=-1).exp()
        out = p @ v
        return out.transpose(1, 2) if spec.layout == "bshd" else out
    return fn
