"""The size-guard memo: one symbolic trace per code, shapes and module attributes read.

A hit must give exactly the guards a fresh trace gives; a module attribute the spec reads, a size, a
plain argument or the code changing must miss; reads the key cannot hold (a submodule call) must not
be memoised at all.
"""
import math

import pytest
import torch

from torch_cubridge.capture import guards, tracememo
from torch_cubridge.capture.trace import bind_example

SEQ = (("q", 2), ("k", 2))


class Attn(torch.nn.Module):
    def __init__(self, layer_idx: int, window: int = 8, scaling: float = 0.125) -> None:
        super().__init__()
        self.layer_idx, self.window, self.scaling = layer_idx, window, scaling
        self.norm = torch.nn.Identity()


def windowed(module, q, k, v):
    assert isinstance(module, Attn)  # a stand-in must still pass isinstance
    s = q @ k.transpose(-1, -2) * module.scaling
    S = q.shape[-2]
    if S > module.window:  # a branch on a size against a module attribute
        i = torch.arange(S)
        s = s.masked_fill((i[:, None] - i[None, :]).abs() > module.window, float("-inf"))
    return torch.softmax(s, -1) @ v


def with_submodule(module, q, k, v):
    s = module.norm(q) @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return torch.softmax(s, -1) @ v


def _counted(monkeypatch, owner, name: str):
    """A fresh memo, and a list that grows by one per call of owner.name."""
    tracememo.clear()
    count = []
    real = getattr(owner, name)

    def counted(*a, **kw):
        count.append(1)
        return real(*a, **kw)
    monkeypatch.setattr(owner, name, counted)
    return count


@pytest.fixture
def traces(monkeypatch):
    yield _counted(monkeypatch, guards, "_size_guards")
    tracememo.clear()


def bound(fn, module, S=16, H=2):
    q, k, v = (torch.randn(1, H, S, 8) for _ in range(3))
    return bind_example(fn, (module, q, k, v), {})


def fresh(fn, b):
    return guards._size_guards(fn, b, SEQ)


def test_layers_differing_in_unread_attributes_share_one_trace(traces):
    first = guards.size_guards(windowed, bound(windowed, Attn(0)), SEQ)
    second = guards.size_guards(windowed, bound(windowed, Attn(5)), SEQ)
    assert len(traces) == 1
    assert second == first == fresh(windowed, bound(windowed, Attn(5)))
    assert first  # the branch on S > window is a guard


@pytest.mark.parametrize("change", ["window", "scaling", "size", "missing"])
def test_what_the_trace_saw_changing_traces_again(traces, change):
    guards.size_guards(windowed, bound(windowed, Attn(0)), SEQ)
    m = Attn(1, window=32 if change == "window" else 8, scaling=0.5 if change == "scaling" else 0.125)
    if change == "missing":
        del m.window
        m.__dict__["scaling"] = 0.125
        # the spec fails there, so the trace does (None: the caller pins every size)
        assert guards.size_guards(windowed, bound(windowed, m), SEQ) is None
        assert len(traces) == 2
        return
    b = bound(windowed, m, S=24 if change == "size" else 16)
    got = guards.size_guards(windowed, b, SEQ)
    assert len(traces) == 2
    assert got == fresh(windowed, b)


def test_window_attribute_changes_the_guards(traces):
    short = guards.size_guards(windowed, bound(windowed, Attn(0, window=8)), SEQ)
    long = guards.size_guards(windowed, bound(windowed, Attn(0, window=32)), SEQ)
    assert short != long  # S > 8 against S <= 32: a memo ignoring the attribute would return `short`


def test_a_submodule_call_is_not_memoised(traces):
    for i in range(2):
        guards.size_guards(with_submodule, bound(with_submodule, Attn(i)), SEQ)
    assert len(traces) == 2


def test_rebinding_a_global_the_spec_reads_traces_again(traces):
    ns: dict = {"torch": torch, "W": 8}
    exec("def spec(q, k, v):\n"
         "    s = q @ k.transpose(-1, -2)\n"
         "    if q.shape[-2] > W:\n"
         "        s = s * 0.5\n"
         "    return torch.softmax(s, -1) @ v\n", ns)
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    b = bind_example(ns["spec"], (q, k, v), {})
    a = guards.size_guards(ns["spec"], b, SEQ)
    ns["W"] = 32
    c = guards.size_guards(ns["spec"], b, SEQ)
    assert len(traces) == 2 and a != c


# -- whole transfers (memoised_stage): a layer after the first takes the first's program ---------------

@pytest.fixture
def transfers(monkeypatch):
    import torch_cubridge.pipeline as pipeline
    yield _counted(monkeypatch, pipeline, "_transfer_stage")
    tracememo.clear()


def _serve(fn, module, q, k, v):
    """(compiled fn, what its program computes for this call): on a CPU the spec serves the call, so the
    program is run by the CuIR interpreter here."""
    import torch_cubridge as tc
    from torch_cubridge.ir.interpreter import run_program
    f = tc.compile(fn, fallback="silent")
    f(module, q, k, v)
    e = f.entries()[-1]
    assert e.result is not None, e.reason
    return f, run_program(e.result.program, module, q, k, v)


def test_layers_equal_in_what_the_spec_reads_share_one_transfer(transfers):
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    for i in range(4):  # one compiled table per layer, as the transformers drop-in keeps them
        f, out = _serve(windowed, Attn(i), q, k, v)
        assert torch.allclose(out, windowed(Attn(i), q, k, v), atol=1e-5)
    assert len(transfers) == 1


@pytest.mark.parametrize("change", ["window", "scaling"])
def test_a_layer_whose_read_attribute_differs_gets_its_own_program(transfers, change):
    """A memo ignoring the attributes would serve the second layer the first's window or scale: its
    output would be the first layer's spec's, not its own."""
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    _serve(windowed, Attn(0), q, k, v)
    other = Attn(1, window=4) if change == "window" else Attn(1, scaling=0.5)
    f, out = _serve(windowed, other, q, k, v)
    assert len(transfers) == 2
    assert torch.allclose(out, windowed(other, q, k, v), atol=1e-5)
    assert not torch.allclose(out, windowed(Attn(0), q, k, v), atol=1e-3)


def test_a_spec_calling_its_submodule_transfers_per_layer(transfers):
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    for i in range(2):
        _serve(with_submodule, Attn(i), q, k, v)
    assert len(transfers) == 2


def test_the_layers_of_a_transformers_model_transfer_once_per_kind_of_call(transfers):
    """8 layers, a prefill and decode steps: one transfer for the causal prefill and one for the masked
    decode step, where each layer took its own before (16)."""
    import torch_cubridge.integrations.transformers as tcx
    from tiny_models import pair
    tcx.register()
    tcx.clear_tables()
    ref, ours = pair("llama", layers=8)
    ids = torch.randint(1, 128, (1, 24))
    with torch.no_grad():
        want = ref.generate(ids, max_new_tokens=3, do_sample=False)
        got = ours.generate(ids, max_new_tokens=3, do_sample=False)
    assert torch.equal(got, want)
    assert len(transfers) == 2
    served = {id(c) for c in tcx.tables()}
    assert len(served) == 16  # the 8 layers' tables, causal and masked: each has its entry, sharing 2 programs


# -- the size-guard trace reused at other sizes (tracereuse) ---------------------------------------------

def branchy(q, k, v):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    S = q.shape[-2]
    if S > 64:  # a decision on a size: the trace holds only on its side of it
        i = torch.arange(S)
        s = s.masked_fill((i[:, None] - i[None, :]).abs() > 64, float("-inf"))
    return torch.softmax(s, -1) @ v


@pytest.fixture
def symbolic(monkeypatch):
    from torch_cubridge.capture import tracereuse
    tracereuse.clear()
    yield _counted(monkeypatch, guards, "make_fx")
    tracereuse.clear()


def _fresh(fn, b, seq=SEQ):
    from torch_cubridge.capture import tracereuse
    tracereuse.clear()
    return guards._size_guards(fn, b, seq)


def _plain(fn, *tensors):
    return bind_example(fn, tensors, {})


def test_a_trace_answers_at_other_sizes_where_its_decisions_hold(symbolic):
    def at(S, B=2):
        return _plain(branchy, *(torch.randn(B, 2, S, 8) for _ in range(3)))
    first = guards._size_guards(branchy, at(100), SEQ)
    reused = guards._size_guards(branchy, at(120, B=3), SEQ)
    assert len(symbolic) == 1  # the second call traced nothing
    other_side = guards._size_guards(branchy, at(32), SEQ)
    assert len(symbolic) == 2  # S > 64 fails at 32: traced again
    assert other_side != first
    assert reused == _fresh(branchy, at(120, B=3)) and other_side == _fresh(branchy, at(32))


def test_another_layout_or_a_size_of_one_traces_again(symbolic):
    q, k, v = (torch.randn(2, 2, 100, 8) for _ in range(3))
    guards._size_guards(branchy, _plain(branchy, q, k, v), SEQ)
    kt = torch.randn(2, 100, 2, 8).transpose(1, 2)  # same sizes, another stride order
    b = _plain(branchy, q, kt, v)
    got = guards._size_guards(branchy, b, SEQ)
    assert len(symbolic) == 2 and got == _fresh(branchy, b)
    one = _plain(branchy, *(torch.randn(1, 2, 100, 8) for _ in range(3)))  # a batch of one is a constant
    guards._size_guards(branchy, one, SEQ)
    assert len(symbolic) == 4  # (the fresh trace above counted one)


def test_a_paged_decode_at_a_new_batch_size_reuses_the_trace(symbolic):
    from torch_cubridge.integrations.flash_specs import paged_decode_attention as spec
    def at(B):
        return _plain(spec, torch.randn(B, 1, 8, 16), torch.randn(20, 16, 2, 16), torch.randn(20, 16, 2, 16),
                      torch.randint(0, 20, (B, 4)).int(), torch.randint(1, 64, (B,)).int(), 0.25, -1, 0.0, None, 1)
    seq = (("block_table", 1),)
    pinned = frozenset({("q", 0), ("block_table", 0), ("seq_lens", 0), ("k_pages", 0), ("v_pages", 0)})
    guards._size_guards(spec, at(2), seq, pinned)
    got = guards._size_guards(spec, at(5), seq, pinned)
    assert len(symbolic) == 1
    from torch_cubridge.capture import tracereuse
    tracereuse.clear()
    assert got == guards._size_guards(spec, at(5), seq, pinned)


def tied(q, k, v):
    """q's and k's lengths made equal by a broadcast: the trace records them as one size."""
    s = q @ q.transpose(-1, -2) + k @ k.transpose(-1, -2)
    return torch.softmax(s, -1) @ v


def test_sizes_the_trace_found_equal_must_stay_equal(symbolic):
    assert guards._size_guards(tied, _plain(tied, *(torch.randn(2, 2, 100, 8) for _ in range(3))), SEQ)
    apart = _plain(tied, torch.randn(2, 2, 100, 8), torch.randn(2, 2, 120, 8), torch.randn(2, 2, 120, 8))
    assert guards._size_guards(tied, apart, SEQ) is None  # traced again, and the spec fails there
    assert len(symbolic) == 2
