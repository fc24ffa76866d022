"""On a CUDA device: specs whose off-score values PyTorch computes (the prologue), and layouts beyond
[B, H, S, D] (rank-3 keys shared by all heads), served by the kernel and checked against the spec in
float64."""
import pytest
import torch

import torch_cubridge as tc
from helpers import assert_rows_close, first, rel_err, to64
from zoo import LAYOUTS, PROLOGUE

pytestmark = pytest.mark.gpu


def _cuda(args):
    return tuple(a.cuda() if isinstance(a, (torch.Tensor, torch.nn.Module)) else a for a in args)


def _cpu64(args):
    return to64(tuple(a.cpu() if isinstance(a, (torch.Tensor, torch.nn.Module)) else a for a in args))


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("case", PROLOGUE + LAYOUTS, ids=[c.name for c in PROLOGUE + LAYOUTS])
def test_served_by_kernel(case, D):
    f = tc.compile(case.fn, fallback="raise")
    for seed in (0, 1):  # the second call: new values, the same kernel, the prologue run again
        torch.manual_seed(seed)
        args = _cuda(case.make(2, 4, 2, 333, D, torch.bfloat16))
        with torch.no_grad():
            out = first(f(*args))
        assert f.served["spec"] == 0 and f.served["kernel"] == seed + 1, [e.reasons or e.reason for e in f.entries()]
        ref = first(case.fn(*_cpu64(args)))
        assert rel_err(out.float().cpu(), ref) < 1e-2


@pytest.mark.parametrize("new", [1, 4])
def test_growing_cache_concatenated_in_the_spec_is_one_program(new):
    """A decode loop whose spec concatenates its KV cache with the new keys: every step is served by
    the decode kernel under one program (its length tied to the cache's), none captured again, and the
    kernel reads the cache and the new keys where they lie (no joined copy): a view of one buffer
    growing by a key per step, as a cache preallocated for the whole generation is."""
    from zoo import kv_cache_concat
    f = tc.compile(kv_cache_concat, fallback="raise")
    B, H, D = 2, 8, 128
    kbuf, vbuf = (torch.randn(B, H, 3100, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for step, cached in enumerate((1500, 1501, 1502, 2047, 3001)):
        torch.manual_seed(step)
        q, kn, vn = (torch.randn(B, H, new, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        args = (q, kn, vn, kbuf[:, :, :cached], vbuf[:, :, :cached])
        with torch.no_grad():
            out = f(*args)
        assert f.served["spec"] == 0 and f.served["kernel"] == step + 1, [e.reasons or e.reason for e in f.entries()]
        assert_rows_close(out, kv_cache_concat(*_cpu64(args)), out.dtype)
    assert len(f.entries()) == 1, [e.reason for e in f.entries()]
    (runner,) = f.kernels()
    assert runner.low.segmented and runner.segments is not None


def test_memory_and_cache_pieces_through_the_decode_kernel():
    """Three pieces of K and V, one of them broadcast over the batch (a learned memory), one not
    16-byte aligned on purpose in the second call (joined by the runner, as the spec joins it)."""
    def memory_cache(q, k_new, v_new, k_cache, v_cache, mem_k, mem_v):
        B = q.shape[0]
        k = torch.cat([mem_k.expand(B, -1, -1, -1), k_cache, k_new], dim=2)
        v = torch.cat([mem_v.expand(B, -1, -1, -1), v_cache, v_new], dim=2)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    f = tc.compile(memory_cache, fallback="raise")
    B, H, Hkv, D = 3, 16, 4, 64
    dev, dt = "cuda", torch.bfloat16
    mem = [torch.randn(1, Hkv, 7, D, device=dev, dtype=dt) for _ in range(2)]
    for step, cached in enumerate((900, 901)):
        q = torch.randn(B, H, 1, D, device=dev, dtype=dt)
        kn, vn = (torch.randn(B, Hkv, 1, D, device=dev, dtype=dt) for _ in range(2))
        kc, vc = (torch.randn(B, Hkv, cached, D + step, device=dev, dtype=dt)[..., step:] for _ in range(2))
        args = (q, kn, vn, kc, vc, *mem)
        with torch.no_grad():
            out = f(*args)
        assert f.served["spec"] == 0 and f.served["kernel"] == step + 1, [e.reasons or e.reason for e in f.entries()]
        assert_rows_close(out, memory_cache(*_cpu64(args)), out.dtype)
    assert f.kernels()[0].low.segmented
