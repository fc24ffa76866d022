"""On a CUDA device: paged decode specs are served by the decode kernel reading K and V from their
pages through the block table (no gather), every output against float64."""
import pytest
import torch

import paged_specs as ps
import torch_cubridge as tc
from helpers import graph_replay, rel_err, to64

pytestmark = pytest.mark.gpu


def _serve(fn, args):
    f = tc.compile(fn, fallback="raise")
    cuda = tuple(a.cuda() for a in args)
    out = f(*cuda)
    torch.cuda.synchronize()
    assert f.served["spec"] == 0, [e.reasons or e.reason for e in f.entries()]
    r = f.kernels()[-1]
    assert r.low.tile.kernel == "decode" and r.low.paged and r.paged is not None
    ref = fn(*to64(args))
    assert rel_err(out.float().cpu(), ref) < 1e-2
    return f, cuda, out


@pytest.mark.parametrize("D,P", [(128, 16), (128, 256), (64, 64), (64, 24), (48, 16)])
def test_heads_first_pages_with_lengths(D, P):
    """Page sizes a power of two and not (24); D 48 takes the loader with no fixed column per thread."""
    _serve(ps.vllm_heads_first, ps.pages(3, 8, 2, 3000, D, P, torch.bfloat16))


def test_slots_first_int32_table_negative_tail_and_a_second_call():
    args = ps.pages(2, 16, 4, 5000, 128, 16, torch.bfloat16, slots_first=True, table_dtype=torch.int32,
                    negative_tail=True)
    f, cuda, _ = _serve(ps.flash_slots_first, args[:4])
    kp = cuda[1]
    kp.normal_()  # the cache changes between steps: the kernel reads it again, in place
    out = f(*cuda)
    ref = ps.flash_slots_first(*to64(tuple(t.cpu() for t in cuda)))
    assert rel_err(out.float().cpu(), ref) < 1e-2


def test_paged_decode_under_cuda_graph():
    args = tuple(a.cuda() for a in ps.pages(2, 8, 2, 2000, 128, 16, torch.bfloat16))
    f = tc.compile(ps.vllm_heads_first, fallback="raise")
    ref = f(*args).clone()
    assert f.kernels()[-1].low.paged
    assert torch.equal(graph_replay(f, *args), ref)


def test_a_paged_program_held_at_its_shape_verifies_on_the_gpu():
    """Paged operands are computed, so the program is held at the call's shape and verified there in
    float64: trials that large run the spec and the interpreter on the call's GPU (the CPU took 35 s of
    a 4k first call), and the kernel's own check compares there too."""
    from torch_cubridge.verify.reference import DEVICE_MIN_SCORES
    args = ps.pages(4, 32, 8, 8192, 128, 16, torch.bfloat16)
    f, _, _ = _serve(ps.vllm_heads_first, args)
    e = f.entries()[-1]
    assert not e.result.generic
    big = [t for t in e.result.report.trials
           if t.sizes["B"] * t.sizes["H"] * t.sizes["Sq"] * t.sizes["Skv"] >= DEVICE_MIN_SCORES]
    assert big and all(t.device.startswith("cuda") and t.ok for t in big), e.result.report.summary()
    gpu = f.kernels()[-1].info["verification"]
    assert any(t.device.startswith("cuda") for t in gpu.trials), gpu.summary()


@pytest.mark.parametrize("D,DV", [(192, 128), (64, 128)])
def test_value_pages_of_their_own_head_dim(D, DV):
    """Multi-head latent attention's paged cache (V 128 under Q and K 192), and V wider than K: read in
    place, V through its own row pitch."""
    q, kp, vp, table, _ = ps.pages(3, 8, 2, 2000, D, 16, torch.bfloat16, slots_first=True)
    vp = torch.randn(*vp.shape[:-1], DV, dtype=torch.bfloat16)
    f, _, out = _serve(ps.flash_slots_first, (q, kp, vp, table))
    assert out.shape[-1] == DV and f.kernels()[-1].value_dim == DV
