"""@torch_cubridge.compile without CUDA: the spec's own result, one warning, clear errors."""
import warnings

import pytest
import torch

import torch_cubridge as tc
import torch_cubridge.pipeline as pipeline
from helpers import count_captures
from zoo import causal_sdpa, softcap_causal


def qkv(B=1, H=2, S=24, D=16, dtype=torch.float32):
    return tuple(torch.randn(B, H, S, D, dtype=dtype) for _ in range(3))


def test_bare_and_with_options():
    f = tc.compile(softcap_causal)
    g = tc.compile(fallback="raise")(softcap_causal)
    args = qkv()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.equal(f(*args), softcap_causal(*args))
    assert g.options.fallback == "raise"
    with pytest.raises(ValueError):
        tc.compile(fallback="sometimes")(softcap_causal)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_warns_once_and_returns_spec_result():
    f = tc.compile(softcap_causal)
    args = qkv()
    with pytest.warns(RuntimeWarning, match="CUDA is not available"):
        out = f(*args)
    assert torch.equal(out, softcap_causal(*args))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second call must not warn again
        f(*qkv())


def test_new_batch_and_length_do_not_recapture(monkeypatch):
    f = tc.compile(causal_sdpa, fallback="silent")
    f(*qkv(B=2, S=24))
    calls = count_captures(monkeypatch)
    for B, S in ((3, 40), (2, 17), (5, 64)):
        out = f(*qkv(B=B, S=S))
        assert out.shape == (B, 2, S, 16)
    assert calls == []  # a dictionary hit, not a new capture


def test_new_dtype_or_rank_pattern_gets_its_own_program(monkeypatch):
    f = tc.compile(causal_sdpa, fallback="silent")
    f(*qkv(B=2))
    calls = count_captures(monkeypatch)
    f(*qkv(B=2, dtype=torch.float64))
    assert calls  # float64 is a new signature


@pytest.mark.parametrize("args, exc, words", [
    (lambda: (torch.randn(2, 16),) + qkv()[1:], ValueError, "3-D or 4-D"),
    (lambda: (torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16, device="meta"), torch.randn(1, 2, 8, 16)),
     ValueError, "different devices"),
    (lambda: tuple(torch.randint(0, 3, (1, 2, 8, 16)) for _ in range(3)), TypeError, "tensor"),
    (lambda: qkv()[:2], TypeError, "missing"),
    (lambda: (torch.randn(1, 2, 8, 16, dtype=torch.complex64),) + qkv()[1:], TypeError, "dtype"),
])
def test_bad_input_is_refused_before_any_work(monkeypatch, args, exc, words):
    """Our clear error where the spec refuses the call too; the spec's own answer (and a warning) where it does not."""
    called = []
    monkeypatch.setattr(pipeline, "capture", lambda *a, **k: called.append(1))
    f = tc.compile(causal_sdpa)
    a = args()
    try:
        want = causal_sdpa(*a)
    except Exception:
        want = None
    if want is None:
        with pytest.raises(exc, match=words):
            f(*a)
    else:
        with pytest.warns(RuntimeWarning, match=words):
            assert torch.equal(f(*a), want)
    assert called == []


@pytest.mark.parametrize("shape", [(0, 2, 8, 16), (1, 2, 0, 16)])
def test_empty_batch_or_length_is_the_specs_answer(shape):
    f = tc.compile(causal_sdpa)
    a = tuple(torch.randn(shape) for _ in range(3))
    with pytest.warns(RuntimeWarning, match="empty"):
        out = f(*a)
    assert out.shape == causal_sdpa(*a).shape


def test_new_rank_gets_its_own_program_and_the_spec_answer():
    f = tc.compile(causal_sdpa, fallback="silent")
    f(*qkv())
    args = (torch.randn(2, 24, 16), torch.randn(2, 24, 16), torch.randn(2, 24, 16))
    assert torch.equal(f(*args), causal_sdpa(*args))  # 3-D is another signature, never the 4-D program
    assert len(f.entries()) == 2


def test_unsupported_spec_falls_back_with_warning_or_raises():
    def topk_attn(q, k, v):
        s = q @ k.transpose(-1, -2)
        return s.masked_fill(s < s.topk(2, -1).values[..., -1:], float("-inf")).softmax(-1) @ v
    args = qkv()
    with pytest.warns(RuntimeWarning, match="topk"):
        out = tc.compile(topk_attn)(*args)
    assert torch.equal(out, topk_attn(*args))
    with pytest.raises(tc.UnsupportedSpec, match="topk"):
        tc.compile(topk_attn, fallback="raise")(*args)
