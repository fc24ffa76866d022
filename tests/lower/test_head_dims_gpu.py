"""On a CUDA device: head dims in steps of 8 (padded to 64-column chunks on Hopper), a value head dim
other than the query's, and the FA2 kernel's added head dims, checked in float64."""
import os
import warnings

import pytest
import torch

import torch_cubridge as tc
from helpers import assert_rows_close, first, to64
from zoo import CASES

pytestmark = pytest.mark.gpu

NAMES = ["causal_sdpa", "softcap_causal", "document_causal", "sliding_window", "empty_rows_finite_fill",
         "alibi_tensor", "gqa_sdpa"]
DIMS = [(32, 32), (40, 40), (80, 80), (96, 96), (192, 192), (40, 72), (128, 64), (64, 256), (256, 64)]


def _with_value_dim(args: tuple, D: int, Dv: int) -> tuple:
    """The zoo's arguments with V (the third tensor) redrawn with head dim Dv."""
    out, seen = [], 0
    for a in args:
        if isinstance(a, torch.Tensor) and a.is_floating_point() and a.dim() >= 3 and a.shape[-1] == D:
            seen += 1
            if seen == 3 and Dv != D:
                a = torch.randn(*a.shape[:-1], Dv, dtype=a.dtype)
        out.append(a)
    return tuple(out)


def _check(fn, args, kernel: str) -> None:
    f = tc.compile(fn, fallback="raise")
    dev = tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)
    out = first(f(*dev))
    assert f.served["spec"] == 0 and f.served["kernel"] > 0, [e.reasons or e.reason for e in f.entries()]
    assert f.kernels()[-1].low.tile.kernel == kernel
    ref = first(fn(*to64(args)))
    assert out.shape == ref.shape
    assert_rows_close(out, ref, out.dtype)  # each row at this head dim, not only the tensor's norm


needs_hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0)
                                  or os.environ.get("CUBRIDGE_KERNEL") == "sm80", reason="needs an H100/H200")


@needs_hopper
@pytest.mark.parametrize("dims", DIMS, ids=lambda d: f"{d[0]}x{d[1]}")
@pytest.mark.parametrize("name", NAMES)
def test_hopper_head_dims(name, dims):
    D, Dv = dims
    case = next(c for c in CASES if c.name == name)
    args = _with_value_dim(case.make(2, 4, 2, 333, D, torch.bfloat16), D, Dv)
    _check(case.fn, args, "sm90")


def gqa_softcap_decode(q, k, v):
    """Grouped heads, a softcap and the causal pattern aligned bottom-right: a decode step's spec."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    s = 30.0 * torch.tanh(s / 30.0)
    i = torch.arange(q.shape[-2], device=q.device)[:, None] + (k.shape[-2] - q.shape[-2])
    s = s.masked_fill(torch.arange(k.shape[-2], device=q.device)[None, :] > i, float("-inf"))
    return torch.softmax(s, -1) @ v


@needs_hopper
@pytest.mark.parametrize("Sq", [1, 4])
@pytest.mark.parametrize("dims", [(192, 128), (48, 32), (64, 128)], ids=lambda d: f"{d[0]}x{d[1]}")
def test_decode_kernel_with_a_value_head_dim_of_its_own(dims, Sq):
    """Multi-head latent attention's decode (deepseek: Q and K 192, V 128): the split-KV decode kernel,
    several splits, GQA packing, against fp64."""
    D, Dv = dims
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 16, Sq, D, generator=g, dtype=torch.bfloat16)
    k = torch.randn(2, 4, 2100, D, generator=g, dtype=torch.bfloat16)
    v = torch.randn(2, 4, 2100, Dv, generator=g, dtype=torch.bfloat16)
    _check(gqa_softcap_decode, (q, k, v), "decode")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("Sq", [1, 4])
@pytest.mark.parametrize("dims", [(40, 40), (40, 64), (72, 72), (200, 200), (24, 24), (72, 40)],
                         ids=lambda d: f"{d[0]}x{d[1]}")
def test_decode_kernel_head_dims_in_steps_of_8(dims, Sq):
    """Few queries with head dims that are not multiples of 16: the decode kernel computes over zeroed pad
    columns (a pad column left unzeroed would add garbage to Q.K or to O), several splits, GQA packing."""
    D, Dv = dims
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 16, Sq, D, generator=g, dtype=torch.bfloat16)
    k = torch.randn(2, 4, 2100, D, generator=g, dtype=torch.bfloat16)
    v = torch.randn(2, 4, 2100, Dv, generator=g, dtype=torch.bfloat16)
    _check(gqa_softcap_decode, (q, k, v), "decode")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("D", [32, 160, 192, 224, 40, 72, 200, 8])
@pytest.mark.parametrize("name", ["causal_sdpa", "document_causal", "empty_rows_finite_fill"])
def test_fa2_kernel_head_dims(name, D, monkeypatch):
    """The FA2-class kernel (A100s) at head dims in steps of 8: those not a multiple of 16 over zeroed pad
    columns; finite-fill rows take the mean of V (the row pad sits past the padded columns)."""
    monkeypatch.setenv("CUBRIDGE_KERNEL", "sm80")
    case = next(c for c in CASES if c.name == name)
    _check(case.fn, case.make(2, 4, 2, 333, D, torch.bfloat16), "sm80")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dims", [(192, 128), (96, 64), (64, 32), (64, 128), (40, 72), (64, 256), (72, 40)],
                         ids=lambda d: f"{d[0]}x{d[1]}")
@pytest.mark.parametrize("name", ["causal_sdpa", "document_causal", "empty_rows_finite_fill"])
def test_fa2_kernel_value_head_dim(name, dims, monkeypatch):
    """Multi-head latent attention's prefill on the FA2-class kernel (A100s), and V wider than Q (O staged
    in Q's rows at the wider pitch); rows of finite fills take the mean of V (the row pad moves past O's
    columns)."""
    monkeypatch.setenv("CUBRIDGE_KERNEL", "sm80")
    D, Dv = dims
    case = next(c for c in CASES if c.name == name)
    _check(case.fn, _with_value_dim(case.make(2, 4, 2, 333, D, torch.bfloat16), D, Dv), "sm80")


def merged_heads_output(q, k, v):
    """The output as [B, S, H * Dv]: the padded kernel's output is cut back through a merged dim."""
    o = torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, -1) @ v
    return o.transpose(1, 2).reshape(o.shape[0], o.shape[2], -1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
# 12 rather than a tiny model's 4: at 4 a row's largest of four values understates what its P rounding averages,
# and the row rule (verify/judge.py) fails a correct kernel (simulated_kernel.py: 1.77 of the bound at D 4, 0.50
# at 8, 0.46 at 12; the padded kernel measured 1.00 once, softcap at 4)
@pytest.mark.parametrize("dims", [(12, 12), (30, 30), (36, 36), (60, 60), (100, 100), (30, 60), (60, 36)],
                         ids=lambda d: f"{d[0]}x{d[1]}")
@pytest.mark.parametrize("name", ["causal_sdpa", "softcap_causal", "gqa_sdpa", "empty_rows_finite_fill"])
def test_head_dims_off_the_step_of_8_are_served_padded(name, dims):
    """Swin2SR's 30, MobileViT's 36 and 60: q, k and v copied zero-padded to a multiple
    of 8, the output cut back to the call's head dim, every row against float64."""
    D, Dv = dims
    case = next(c for c in CASES if c.name == name)
    args = _with_value_dim(case.make(2, 4, 2, 333, D, torch.bfloat16), D, Dv)
    _check(case.fn, args, "sm90" if torch.cuda.get_device_capability() == (9, 0) else "sm80")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("Sq", [1, 200])
def test_padded_head_dims_with_few_queries_merged_heads_and_gradients(Sq):
    """A decode-sized call (the prefill kernel: the decode kernel reads K and V in place), an output whose
    heads and head dim are merged, and a call that needs gradients (the custom op's forward padded, its
    backward the reference: the backward kernel takes steps of 8)."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, Sq, 30, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(2, 4, 700, 30, generator=g).to(torch.bfloat16) for _ in range(2))
    _check(merged_heads_output, (q, k, v), "sm90" if torch.cuda.get_device_capability() == (9, 0) else "sm80")
    f = tc.compile(merged_heads_output, fallback="raise")
    leaves = [t.cuda().requires_grad_() for t in (q, k, v)]
    dout = torch.randn(2, Sq, 120, device="cuda", dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        f(*leaves).backward(dout)
    ref = [t.detach().double().requires_grad_() for t in leaves]
    merged_heads_output(*ref).backward(dout.double())
    for got, want in zip(leaves, ref):
        assert_rows_close(got.grad, want.grad, torch.bfloat16)


def key_given_transposed(q, k_t, v):
    """K handed as [B, H, D, S] (a model that stores it transposed, or einsum's copy of it): contiguous in S."""
    return torch.softmax(q @ k_t * q.shape[-1] ** -0.5, -1) @ v


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("D", [64, 30])
def test_an_operand_whose_head_dim_is_not_contiguous_is_read_from_a_copy(D):
    """K's rows of D are strided (S is its contiguous dim): the kernels read 16-byte rows of D (TMA refused the
    tensor map, CUDA_ERROR_INVALID_VALUE), so the runner reads a [B, H, S, D] copy, padded where D asks."""
    g = torch.Generator().manual_seed(8)
    q, v = (torch.randn(2, 6, 50, D, generator=g).to(torch.bfloat16) for _ in range(2))
    k_t = torch.randn(2, 6, D, 50, generator=g).to(torch.bfloat16)
    _check(key_given_transposed, (q, k_t, v), "sm90" if torch.cuda.get_device_capability() == (9, 0) else "sm80")
