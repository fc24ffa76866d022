"""Extra tensors read at an index read from data (`table[tq[b, q], tk[b, kv]]`).

Such a read has no static bound, so the kernel wraps a negative index as torch indexing does and
clamps it into the tensor (`cubridge::cb_index`); the runner's bounds check skips those sites and
still checks the rest. The transfer reads a pairwise gather (one spanning a query-length and a
key-length axis) through the ids instead of leaving PyTorch to build a [B, Sq, Skv] table per call.
"""

import pytest
import torch

import torch_cubridge as tc
from torch_cubridge.capture.trace import bind_example
from torch_cubridge.ir.bounds import data_indexed_dims, load_sites, out_of_bounds
from torch_cubridge.lower import lower
from torch_cubridge.verify.cpu import verify_program
from test_lower import needs_nvcc, tc_cubin


def type_bias(q, k, v, tq, tk, table):
    """A learned bias between token types (segments, modalities), looked up by each pair's types."""
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    s = s + table[tq[:, :, None], tk[:, None, :]][:, None]
    return torch.softmax(s, -1) @ v


def make(B=2, H=4, Sq=70, Skv=70, D=64, T=5, dtype=torch.float32, device="cpu", lo=0):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, Sq, D, generator=g).to(device, dtype)
    k, v = (torch.randn(B, H, Skv, D, generator=g).to(device, dtype) for _ in range(2))
    tq, tk = torch.randint(lo, T, (B, Sq), generator=g), torch.randint(lo, T, (B, Skv), generator=g)
    return q, k, v, tq.to(device), tk.to(device), torch.randn(T, T, generator=g).to(device)


def test_a_pairwise_gather_is_read_through_the_ids():
    p = tc.transfer(type_bias, *make())
    assert not p.prologue and data_indexed_dims(p) == {("table", 0), ("table", 1)}
    assert "table[tq[b, q], tk[b, kv]]" in str(p)
    assert not p.requires  # generic in batch, heads and lengths, as any program without a prologue


def test_short_lengths_and_decode_leave_the_gather_to_pytorch():
    """A [B, 1, Skv] table is no burden: the prologue keeps computing it (exactly the spec's ops)."""
    assert tc.transfer(type_bias, *make(Sq=1, Skv=300)).prologue
    assert tc.transfer(type_bias, *make(Sq=8, Skv=8)).prologue


def test_the_interpreter_follows_the_spec_through_data_indices():
    args = make()
    p = tc.transfer(type_bias, *args)
    assert data_indexed_dims(p) == {("table", 0), ("table", 1)}
    want = type_bias(*[a.double() if a.is_floating_point() else a for a in args])
    assert torch.allclose(p.run(*args).double(), want, atol=1e-4)
    neg = make(lo=-5)  # negative ids count from the end, as torch indexing does
    want = type_bias(*[a.double() if a.is_floating_point() else a for a in neg])
    assert torch.allclose(p.run(*neg).double(), want, atol=1e-4)


def test_the_program_passes_verification():
    args = make()
    rep = verify_program(type_bias, tc.transfer(type_bias, *args), bind_example(type_bias, args, {}), generic=False)
    assert rep.ok and len(rep.trials) > 1, rep.summary()


def test_bounds_check_skips_clamped_reads_and_keeps_the_others():
    p = tc.transfer(type_bias, *make())
    sites = load_sites(p)
    sizes = {"B": 2, "H": 4, "Hkv": 4, "Sq": 70, "Skv": 70, "D": 64}
    assert out_of_bounds(sites, sizes, {}, {"tq": (2, 70), "tk": (2, 70), "table": (5, 5)}) is None
    # the ids themselves are read at (b, q) and (b, kv): a short ids tensor is still refused
    assert "tk" in out_of_bounds(sites, sizes, {}, {"tq": (2, 70), "tk": (2, 60), "table": (5, 5)})


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("decode", [False, True])
def test_clamped_reads_lower_and_compile(arch, decode):
    p = tc.transfer(type_bias, *make())
    low = lower(p, arch=arch, head_dim=64, decode=decode)
    assert "cubridge::cb_index(" in low.source and "p.table_n0" in low.source
    assert {f.name for f in low.params if f.kind == "size"} == {"table_n0", "table_n1"}
    assert "long long table_n0;" in low.source  # packed as int64 (a double here read garbage on the H100)
    assert tc_cubin(low.source, arch)[:4] == b"\x7fELF"
