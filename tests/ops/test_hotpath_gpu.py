"""On a CUDA device: the host fast path (ops/hotpath.py) replays a served call's launch from C for calls of
exactly its layout. Every replayed call gets fresh tensors (new pointers) and is checked against float64;
calls it must not replay (another stream, misaligned rows, grad, a CUDA graph, a rebound global) are
served correctly by the Python path."""
import math

import pytest
import torch

import torch_cubridge as tc
from helpers import graph_replay, rel_err, to64
from torch_cubridge.ops import hotpath

pytestmark = pytest.mark.gpu

WINDOW = 48


def causal(q, k, v):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    n = q.shape[-2]
    keep = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    return s.masked_fill(~keep, float("-inf")).softmax(-1) @ v


def windowed(q, k, v):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    i = torch.arange(q.shape[-2], device=q.device)
    keep = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < WINDOW)
    return s.masked_fill(~keep, float("-inf")).softmax(-1) @ v


def decode_gqa(q, k, v):
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    return (q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5).softmax(-1) @ v


def _qkv(B, H, Hkv, Sq, Skv, D):
    return (torch.randn(B, H, Sq, D, device="cuda", dtype=torch.bfloat16),
            torch.randn(B, Hkv, Skv, D, device="cuda", dtype=torch.bfloat16),
            torch.randn(B, Hkv, Skv, D, device="cuda", dtype=torch.bfloat16))


def _hits(f) -> int:
    return sum(r.hits for r in f._hot)


def _warm(f, shape):
    """Serve one call, wait for the C module, serve another (recorded now)."""
    f(*_qkv(*shape))
    assert hotpath.wait(120) is not None, hotpath.failure
    f(*_qkv(*shape))
    torch.cuda.synchronize()
    assert f._hot, "no record was made"


@pytest.mark.parametrize("spec,shape", [
    (causal, (1, 2, 2, 128, 128, 64)),          # prefill, the Hopper kernel's tensor maps on sm_90
    (windowed, (2, 4, 4, 200, 200, 128)),
    (decode_gqa, (2, 8, 2, 1, 4096, 128)),      # decode, several splits: the scratch the record keeps
    (decode_gqa, (1, 4, 4, 3, 77, 64)),         # decode, one split
])
def test_replayed_calls_match_float64(spec, shape):
    f = tc.compile(spec, fallback="raise")
    _warm(f, shape)
    for _ in range(4):
        args = _qkv(*shape)
        before = _hits(f)
        out = f(*args)
        assert _hits(f) == before + 1, "the call was not replayed"
        assert rel_err(out, spec(*to64(args))) < 2e-2
    assert f.served["spec"] == 0


def test_the_fa2_kernel_is_replayed(monkeypatch):
    monkeypatch.setenv("CUBRIDGE_KERNEL", "sm80")
    f = tc.compile(causal, fallback="raise")
    shape = (1, 2, 2, 96, 96, 64)
    _warm(f, shape)
    args = _qkv(*shape)
    before = _hits(f)
    out = f(*args)
    assert _hits(f) == before + 1
    assert rel_err(out, causal(*to64(args))) < 2e-2


def test_calls_it_must_not_replay_are_served_right():
    f = tc.compile(causal, fallback="raise")
    shape = (1, 2, 2, 128, 128, 64)
    _warm(f, shape)
    hits = _hits(f)
    # rows not 16-byte aligned: same shape and strides, the pointer one element off
    buf = torch.randn(1 * 2 * 128 * 64 + 1, device="cuda", dtype=torch.bfloat16)
    q = buf[1:].view(1, 2, 128, 64)
    _, k, v = _qkv(*shape)
    assert rel_err(f(q, k, v), causal(*to64((q, k, v)))) < 2e-2
    # another stream
    s = torch.cuda.Stream()
    args = _qkv(*shape)
    with torch.cuda.stream(s):
        out = f(*args)
    s.synchronize()
    assert rel_err(out, causal(*to64(args))) < 2e-2
    # another shape
    args = _qkv(1, 2, 2, 64, 64, 64)
    assert rel_err(f(*args), causal(*to64(args))) < 2e-2
    assert _hits(f) == hits
    # inputs that require grad: through the custom op, with its gradient
    q, k, v = (t.requires_grad_() for t in _qkv(*shape))
    out = tc.compile(causal)(q, k, v)
    out.float().sum().backward()
    assert q.grad is not None


def test_decode_in_a_cuda_graph_after_replays():
    f = tc.compile(decode_gqa, fallback="raise")
    shape = (2, 8, 2, 1, 4096, 128)
    _warm(f, shape)
    args = _qkv(*shape)
    ref = decode_gqa(*to64(args))
    out = graph_replay(f, *args)
    assert rel_err(out, ref) < 2e-2
    args2 = _qkv(*shape)  # a replay outside the graph still uses the stream's own scratch
    assert rel_err(f(*args2), decode_gqa(*to64(args2))) < 2e-2


def test_a_rebound_global_retires_the_records():
    global WINDOW
    f = tc.compile(windowed, fallback="raise")
    shape = (1, 2, 2, 160, 160, 64)
    _warm(f, shape)
    try:
        WINDOW = 9
        args = _qkv(*shape)
        out = f(*args)
        assert rel_err(out, windowed(*to64(args))) < 2e-2
    finally:
        WINDOW = 48


def test_records_stop_where_layouts_never_repeat():
    """A decode loop over a growing cache: every call a new length; after eight records none is made."""
    f = tc.compile(decode_gqa, fallback="raise")
    f(*_qkv(1, 4, 4, 1, 500, 64))
    hotpath.wait(120)
    for n in range(501, 521):
        args = _qkv(1, 4, 4, 1, n, 64)
        assert rel_err(f(*args), decode_gqa(*to64(args))) < 2e-2
    assert f._hot_made == hotpath.MAX_RECORDS
