"""Setting a module attribute the spec reads, in place, must retire the program that baked it in."""
from __future__ import annotations

import torch

import torch_cubridge as tc
from torch_cubridge.capture.signature import call_signature


class Attn(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scaling = 0.25
        self.window = 3


def spec(module, q, k, v):
    i = torch.arange(q.shape[-2])
    s = (q @ k.transpose(-2, -1)) * module.scaling
    s = s.masked_fill((i[:, None] - i[None, :]).abs() > module.window, float("-inf"))
    return torch.softmax(s, -1) @ v


def _served(f, args):
    e = f._find(call_signature(args, {}), args, {})
    assert e is not None and e.result is not None, [x.reason for x in f.entries()]
    return e.result.program.run(*args)


def _ref(mod, q, k, v):
    return spec(mod, q.double(), k.double(), v.double())


def test_in_place_attribute_change_retires_the_program():
    f = tc.compile(spec, fallback="silent")
    mod = Attn()
    q, k, v = (torch.randn(1, 2, 20, 16) for _ in range(3))
    f(mod, q, k, v)
    assert (_served(f, (mod, q, k, v)).double() - _ref(mod, q, k, v)).abs().max() < 1e-5
    mod.scaling, mod.window = 0.5, 7  # same module object
    f(mod, q, k, v)
    assert (_served(f, (mod, q, k, v)).double() - _ref(mod, q, k, v)).abs().max() < 1e-5
    mod.train(False)  # a flag that does not change what this spec computes still re-captures, correctly
    f(mod, q, k, v)
    assert (_served(f, (mod, q, k, v)).double() - _ref(mod, q, k, v)).abs().max() < 1e-5
