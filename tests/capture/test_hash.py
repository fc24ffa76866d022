"""The spec hash: stable across processes, changed by any semantic change."""
import subprocess
import sys
import textwrap

import torch

from torch_cubridge.capture.hashing import spec_hash
from torch_cubridge.capture.trace import bind_example, capture

from paths import ROOT, SEARCH

SRC = textwrap.dedent("""
    import sys, torch
    sys.path[:0] = {search!r}
    from torch_cubridge.capture.hashing import spec_hash
    from torch_cubridge.capture.trace import bind_example, capture
    from zoo import softcap_causal
    a = tuple(torch.zeros(1, 2, 20, 16) for _ in range(3))
    print(spec_hash(capture(softcap_causal, bind_example(softcap_causal, a, {{}}))))
""")


def _hash(fn, *args):
    return spec_hash(capture(fn, bind_example(fn, args, {})))


def test_stable_across_processes():
    code = SRC.format(search=[str(ROOT), *map(str, SEARCH)])
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
            for _ in range(2)}
    from zoo import softcap_causal
    here = _hash(softcap_causal, *(torch.zeros(1, 2, 20, 16) for _ in range(3)))
    assert outs == {here}


def test_changes_with_semantics():
    a = tuple(torch.zeros(1, 2, 20, 16) for _ in range(3))

    def cap30(q, k, v):
        return (30.0 * torch.tanh(q @ k.transpose(-1, -2) / 30.0)).softmax(-1) @ v

    def cap50(q, k, v):
        return (50.0 * torch.tanh(q @ k.transpose(-1, -2) / 50.0)).softmax(-1) @ v

    slopes = torch.rand(2)

    def bias(q, k, v):
        return (q @ k.transpose(-1, -2) + slopes[:, None, None]).softmax(-1) @ v

    h1, h2 = _hash(cap30, *a), _hash(cap50, *a)
    assert h1 != h2
    hb = _hash(bias, *a)
    slopes.add_(1.0)  # a captured constant's value is part of the hash
    assert _hash(bias, *a) != hb
    assert _hash(cap30, *(x.to(torch.float64) for x in a)) != h1  # dtype matters
