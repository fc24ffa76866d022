"""A module's own tensor that sits in a submodule (`module.attention.sinks`, as GPT-Neo keeps its mask buffer
in `attention.bias`): verification redraws it on its private copy of the module through the dotted path, so
the program is checked against the spec at other values of it, and a program that baked its values in is
rejected."""
from dataclasses import replace

import torch

import torch_cubridge as tc
from torch_cubridge.capture.trace import bind_example
from torch_cubridge.verify.cpu import verify_program


class Inner(torch.nn.Module):
    def __init__(self, heads: int) -> None:
        super().__init__()
        self.sinks = torch.nn.Parameter(torch.randn(heads))


class Outer(torch.nn.Module):
    def __init__(self, heads: int) -> None:
        super().__init__()
        self.attention = Inner(heads)


def spec(module, q, k, v):
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    col = module.attention.sinks.view(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], 1)
    return torch.cat([s, col], dim=-1).softmax(-1)[..., :-1] @ v


def _program():
    torch.manual_seed(0)
    mod = Outer(4)
    q, k, v = (torch.randn(2, 4, 24, 32) for _ in range(3))
    return tc.transfer(spec, mod, q, k, v), bind_example(spec, (mod, q, k, v), {})


def test_a_submodules_tensor_is_read_and_verified():
    p, ex = _program()
    assert any(x.arg == "module.attention.sinks" for x in p.extras)
    assert verify_program(spec, p, ex).ok


def test_a_program_that_ignores_the_submodules_tensor_is_rejected():
    """The program with the sink read as a constant (its example value) must fail at redrawn sinks."""
    p, ex = _program()
    frozen = replace(p, extras=tuple(x for x in p.extras if x.arg != "module.attention.sinks"))
    assert frozen != p
    try:
        rep = verify_program(spec, frozen, ex)
    except Exception:  # noqa: BLE001  (a program missing an extra it reads may fail to run: rejected too)
        return
    assert not rep.ok
