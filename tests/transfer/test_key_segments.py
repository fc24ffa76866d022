"""Layouts the spec makes itself: keys joined along the key axis from a learned memory (an nn.Parameter with no
batch dim, expanded or repeated over the batch, then einsum's views) become key/value pieces; heads packed with
the head dim, or with the batch, are taken as the spec's split view of the argument (a view, no copy)."""
import types

import pytest
import torch

import torch_cubridge as tc
from corpus.layout_styles import (MemoryKV, _folded_query, _mem, _mem_packed, _packed_latents, _perceiver_module,
                                  diffusion_mem_kv, folded_query_heads, perceiver_pytorch_cross,
                                  perceiver_pytorch_module, xtransformers_mem_kv)
from corpus_index import reference
from helpers import first, rel_err
from torch_cubridge.ir.segments import segment_operands


def _matches(prog, fn, args):
    """The program against the spec in float64 (a module's float32 weights: in float32, as the corpus does)."""
    ref = reference(types.SimpleNamespace(fn=fn), args)
    return rel_err(first(prog.run(*args)).detach(), ref.detach()) < 2e-5


def test_a_parameter_memory_joined_through_einsum_is_the_first_piece():
    torch.manual_seed(0)
    args = _mem(2, 4, 4, 40, 32, torch.float32)
    prog = tc.transfer(xtransformers_mem_kv, *args)
    assert prog.k.dims == ("b", "h", "s", "d")  # the joined keys as PyTorch made them, no unit dim of einsum's
    segs = segment_operands(prog)
    assert segs is not None and segs.k[1] == ("@arg", "k") and segs.v[1] == ("@arg", "v")
    (first_k,) = [s for s in prog.prologue if s.name == segs.k[0][1]]  # the memory, expanded over the batch
    assert first_k.op == "aten.expand.default" and any(
        s.args[0] == ("@arg", "module.mem_k") for s in prog.prologue if s.name == first_k.args[0][1])
    torch.manual_seed(1)
    assert _matches(prog, xtransformers_mem_kv, _mem(2, 4, 4, 40, 32, torch.float32))


def test_a_memory_repeated_over_the_batch_serves_other_lengths():
    torch.manual_seed(0)
    prog = tc.transfer(diffusion_mem_kv, *_mem_packed(2, 4, 4, 40, 32, torch.float32))
    segs = segment_operands(prog)
    assert segs is not None and segs.k[1] == ("@arg", "k")
    assert prog.k.length is not None and prog.k.length[:3] == ("k", 2, 4)  # the argument's keys plus 4 of memory
    for S in (40, 57):
        assert _matches(prog, diffusion_mem_kv, _mem_packed(2, 4, 4, S, 32, torch.float32)), S


def test_a_memory_argument_with_no_batch_dim_is_a_piece():
    """The memory passed as a tensor [heads, n, dim] (not a module's parameter), expanded over the batch."""
    def mem_arg(q, k, v, mem_k, mem_v):
        b = q.shape[0]
        k = torch.cat((mem_k.expand(b, -1, -1, -1), k), dim=-2)
        v = torch.cat((mem_v.expand(b, -1, -1, -1), v), dim=-2)
        sim = torch.einsum("b h i d, b h j d -> b h i j", q, k) * q.shape[-1] ** -0.5
        return torch.einsum("b h i j, b h j d -> b h i d", sim.softmax(-1), v)

    def make():
        mem = MemoryKV(4, 32)
        return _mem(2, 4, 4, 30, 32, torch.float32)[1:4] + (mem.mem_k.detach(), mem.mem_v.detach())
    torch.manual_seed(0)
    prog = tc.transfer(mem_arg, *make())
    segs = segment_operands(prog)
    assert segs is not None and segs.k[1] == ("@arg", "k")
    torch.manual_seed(1)
    assert _matches(prog, mem_arg, make())


@pytest.mark.parametrize("B", [1, 2])
def test_heads_packed_with_the_head_dim_are_split_as_views(B):
    """perceiver-pytorch's 'b n (h d) -> (b h) n d' on arguments: each operand is the spec's own view of its
    argument ([b, n, h, d]), read in place; the lengths move with the arguments."""
    torch.manual_seed(0)
    prog = tc.transfer(perceiver_pytorch_cross, *_packed_latents(B, 4, 4, 40, 32, torch.float32))
    steps = {s.name: s for s in prog.prologue}
    for op, arg in ((prog.q, "q"), (prog.k, "k"), (prog.v, "v")):
        assert steps[op.step].op == "aten.view.default" and steps[op.step].args[0] == ("@arg", arg)
        assert sorted(op.dims) == ["b", "d", "h", "s"]
    for S in (40, 61):
        assert _matches(prog, perceiver_pytorch_cross, _packed_latents(B, 4, 4, S, 32, torch.float32)), S


def test_heads_packed_after_the_projections_are_kept_apart():
    """The whole perceiver-pytorch Attention (to_q, to_kv, chunk, split heads, to_out): q, k and v made by the
    prologue with batch and heads apart, the output projection after the kernel."""
    torch.manual_seed(0)
    args = _perceiver_module(2, 4, 4, 40, 32, torch.float32)
    prog = tc.transfer(perceiver_pytorch_module, *args)
    assert all(len(op.dims) == 4 for op in (prog.q, prog.k, prog.v)) and prog.epilogue
    torch.manual_seed(1)
    fresh = _perceiver_module(2, 4, 4, 40, 32, torch.float32)
    assert _matches(prog, perceiver_pytorch_module, (args[0],) + fresh[1:])


def test_a_query_with_batch_and_heads_folded_is_split_against_keys_that_keep_them_apart():
    torch.manual_seed(0)
    prog = tc.transfer(folded_query_heads, *_folded_query(2, 4, 4, 40, 32, torch.float32))
    (view,) = [s for s in prog.prologue if s.name == prog.q.step]
    assert view.op == "aten.view.default" and view.args[0] == ("@arg", "q") and prog.q.dims == ("b", "h", "s", "d")
    torch.manual_seed(1)
    assert _matches(prog, folded_query_heads, _folded_query(2, 4, 4, 40, 32, torch.float32))
