"""A spec that caches into its module (a bias gathered once, kept in a dict) is traced over fake tensors
several times before it serves. Those traces must leave the module as they found it: a fake tensor left in
the cache is read by every later call, the spec's own included."""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor

import torch_cubridge as tc
from torch_cubridge.capture.signature import call_signature


class CachingBias(torch.nn.Module):
    def __init__(self, heads: int, n: int) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(heads, 2 * n - 1))
        self.cache: dict[str, torch.Tensor] = {}
        self.seen: list[int] = []

    def bias(self, n: int) -> torch.Tensor:
        key = f"{n}"
        if key not in self.cache:
            i = torch.arange(n)
            self.cache[key] = self.table[:, i[:, None] - i[None, :] + n - 1]
            self.seen.append(n)
        return self.cache[key]


def spec(module, q, k, v):
    s = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5 + module.bias(q.shape[-2])
    return torch.softmax(s, -1) @ v


def test_traces_leave_a_modules_cache_as_they_found_it():
    f = tc.compile(spec, fallback="silent")
    mod = CachingBias(2, 24)
    q, k, v = (torch.randn(1, 2, 24, 16) for _ in range(3))
    with torch.no_grad():
        out = f(mod, q, k, v)
    assert not any(isinstance(t, FakeTensor) for t in mod.cache.values())
    assert mod.seen in ([], [24])  # only a real call of the spec may have filled it, once
    ref = spec(mod.double(), q.double(), k.double(), v.double())
    mod.float()
    assert (out.double() - ref).abs().max() < 1e-5
    e = f._find(call_signature((mod, q, k, v), {}), (mod, q, k, v), {})
    assert e is not None and e.result is not None, [x.reason for x in f.entries()]  # a program serves
