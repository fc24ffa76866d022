"""GPU: loss.backward() through tc.compile'd attention against float64 autograd of the spec, row by row; who
served each backward (the kernel once verified, else the reference); NaN-free gradients for fully masked
rows; a backward kernel that is wrong is caught on its first backward and the reference serves, with a warning."""
from __future__ import annotations

import math
import warnings

import pytest
import torch

import torch_cubridge as tc
from torch_cubridge.ops import backward_runner
from torch_cubridge.verify.judge import delta_rounding_allowance, judge_rows
from zoo import empty_rows_causal, empty_rows_reference
from zoo import CASES, PROLOGUE

pytestmark = pytest.mark.gpu
ROW_TOL = 0.05  # a row's error over its own scale: bf16 inputs and outputs, float32 inside
NAMES = ["causal_sdpa", "full_matmul", "softcap_causal", "sliding_window", "gqa_expand", "document_causal",
         "alibi_tensor", "sinks_column", "empty_rows", "rel_bias_table", "rel_bias_clamped", "t5_relative_bias",
         "key_bias", "rel_bias_reversed_causal"]
# learnable tensors the score reads: the kernel's learnable sites give their gradients (lower/sites.py): a slope
# per head (a point site), relative tables over the tile's diagonals (slopes -1, +1, and 0: a bias per key), a
# clamped one (a window)
LEARNABLE_SCORE = {"alibi_tensor", "rel_bias_table", "rel_bias_clamped", "t5_relative_bias", "key_bias",
                   "rel_bias_reversed_causal"}


def key_bias(q, k, v, kb):
    """A learnable bias per head and key: a diagonal site of slope 0 (a column of the tile)."""
    return (q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 + kb[:, None, :]).softmax(-1) @ v


def rel_bias_reversed_causal(q, k, v, table):
    """A relative table read at q - kv (a diagonal of slope +1), under a causal mask (tiles above the diagonal
    skipped, the diagonal's half masked)."""
    S = q.shape[-2]
    i = torch.arange(S, device=q.device)
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 + table[:, i[:, None] - i[None, :] + S - 1]
    return s.masked_fill(i[None, :] > i[:, None], float("-inf")).softmax(-1) @ v


LOCAL = {"key_bias": (key_bias, lambda S: (4, S)), "rel_bias_reversed_causal": (rel_bias_reversed_causal,
                                                                                lambda S: (4, 2 * S - 1))}


def _case(name, D=64):
    if name in LOCAL:
        fn, shape = LOCAL[name]
        return fn, lambda: (*(torch.randn(2, 4, 257, D) for _ in range(3)), torch.randn(shape(257))), fn
    if name == "empty_rows":
        return empty_rows_causal, lambda: tuple(torch.randn(2, 4, 257, D) for _ in range(3)), empty_rows_reference
    c = next(c for c in CASES + PROLOGUE if c.name == name)
    if name == "t5_relative_bias":
        # T5 does not scale its scores: with unit-normal q and k they reach +-30, a one-hot softmax where dQ and
        # dK of any flash-style backward are the rounding of delta (from the bf16 O) alone; q at a trained
        # model's scale
        return c.fn, lambda: (lambda a: (a[0] * D ** -0.5, *a[1:]))(c.make(2, 4, 4, 257, D, torch.float32)), c.fn
    return c.fn, lambda: c.make(2, 4, 2 if name == "gqa_expand" else 4, 257, D, torch.float32), c.fn


def _leaves(args, dtype, learnable=True):
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            a = a.to("cuda", dtype if a.is_floating_point() and a.dim() == 4 else a.dtype)
            if a.is_floating_point() and learnable:
                a = a.detach().requires_grad_()
        out.append(a)
    return out


def _dq_allowance(q, k, out, dout):
    """What dQ may differ from the spec's float64 gradient by, beyond ROW_TOL, per row: delta = rowsum(dO * O)
    is formed from O in bf16 (as in every flash-style backward), off by up to u * sum|dO * O|, and that reaches dQ
    through dS = P (dP - delta) dscore/ds (here at most D^-0.5) summed over the row's keys, each at most max|K|.
    A row that keeps two or three keys has a tiny dQ, and this term is then most of it."""
    u = 2.0 ** -8  # bf16's unit roundoff (2^-9) with a factor 2 to spare
    d_err = u * (dout.double() * out.double().nan_to_num()).abs().sum(-1)
    return 4 * d_err * q.shape[-1] ** -0.5 * k.double().abs().max()


def _assert_grads(got, want, args, out, dout):
    """dQ, dK, dV (and any more) against float64's, row by row; dQ with delta's rounding allowed for."""
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.isfinite(g).all()
        if i == 0:  # dQ: the spec's O against the kernel's bf16 O, bounded per row
            err = (g.double() - w).abs().amax(-1)
            bound = ROW_TOL * w.abs().amax(-1) + _dq_allowance(args[0], args[1], out, dout)
            assert (err <= bound).all(), (float((err / bound).max()), int((err > bound).sum()))
            continue
        v = judge_rows(g.float().reshape(1, -1) if g.dim() == 1 else g.float(),
                       w.reshape(1, -1) if w.dim() == 1 else w, ROW_TOL)  # a learnable vector: one row
        assert v.ok, v


def _run(f, args, dout):
    leaves = [a.detach().clone().requires_grad_() if isinstance(a, torch.Tensor) and a.requires_grad else a
              for a in args]
    f(*leaves).backward(dout)
    return [a.grad for a in leaves if isinstance(a, torch.Tensor) and a.requires_grad]


def _check_against_float64(name, D=64):
    """The compiled function's gradients against float64 autograd of the spec; the backward's runner."""
    fn, make, ref_fn = _case(name, D)
    f = tc.compile(fn)
    args = _leaves(make(), torch.bfloat16)
    with torch.no_grad():
        out = f(*args)  # builds and verifies the forward
    dout = torch.randn_like(args[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = _run(f, args, dout)
    want = _run(ref_fn, [a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                         for a in _leaves(args, torch.float64)], dout.double())
    _assert_grads(got, want, args, out, dout)
    assert f.served["kernel"] == 2 and f.served["spec"] == 0, f.served
    return backward_runner.backward_for(f.kernels()[-1].kernel_id)


@pytest.mark.parametrize("name", NAMES)
def test_backward_matches_float64(name):
    bw = _check_against_float64(name)
    assert sum(bw.served.values()) == 1 and set(bw.served) <= {"kernel", "reference"}, bw.served
    if name in LEARNABLE_SCORE or name == "sinks_column":  # learnable sinks: the kernel, their gradient beside it
        assert bw.served == {"kernel": 1}


@pytest.mark.parametrize("name, D", [("sliding_window", 8), ("causal_sdpa", 24), ("softcap_causal", 80),
                                     ("gqa_expand", 104), ("full_matmul", 112), ("document_causal", 120)])
def test_the_backward_kernel_serves_head_dims_in_steps_of_8(name, D):
    """Head dims short of a k16 step (8, 24, 120) compute on zeroed padding columns, never stored."""
    assert _check_against_float64(name, D).served == {"kernel": 1}


@pytest.mark.parametrize("name", ["full_matmul", "rel_bias_table"])
def test_wrong_backward_kernel_falls_back_with_a_warning(monkeypatch, name):
    """A row of dQ off, or one element of a learnable table's gradient (the kernel's learnable sites)."""
    real = backward_runner.build_kernel

    def wrong(*a):
        kern = real(*a)

        def run(*b):
            dq, dk, dv, sites = kern(*b)
            if sites:
                for g in sites.values():
                    g.view(-1)[g.numel() // 2] += 1.0 + 4 * float(g.abs().max())
            else:
                dq[0, 0, 7] += 1.0
            return dq, dk, dv, sites
        return run
    monkeypatch.setattr(backward_runner, "build_kernel", wrong)
    fn, make, ref_fn = _case(name)
    f = tc.compile(fn)
    args = _leaves(make(), torch.bfloat16)
    with torch.no_grad():
        f(*args)
    # this program's backward as in a fresh process: another test in this worker may have built and
    # verified the same program's (a right) kernel already
    backward_runner._RUNNERS.pop(f.kernels()[-1].kernel_id, None)
    dout = torch.randn_like(args[0])
    with pytest.warns(RuntimeWarning, match="reference backward"):
        got = _run(f, args, dout)
    bw = backward_runner.backward_for(f.kernels()[-1].kernel_id)
    assert bw.served == {"reference": 1}, bw.served
    want = _run(ref_fn, [a.double() for a in _leaves(args, torch.float64)], dout.double())
    for g, w in zip(got, want):
        assert judge_rows(g.float(), w, ROW_TOL).ok


def _calls_match_float64(f, spec, qkv, dout, masks):
    """One call of f per mask, in order: each call's gradients against float64 autograd of the spec (a float
    mask in float64 too, a bool one as it is)."""
    for m in masks:
        args = _leaves(qkv, torch.bfloat16)
        with torch.no_grad():
            out = f(*args, m)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = _run(lambda q, k, v: f(q, k, v, m), args, dout)
        m64 = m.double() if m.is_floating_point() else m
        want = _run(lambda q, k, v: spec(q, k, v, m64), _leaves(args, torch.float64), dout.double())
        _assert_grads(got, want, args, out, dout)


def finfo_padded(q, k, v, mask):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + mask
    return torch.softmax(s, dim=-1) @ v


def test_rows_a_finite_fill_fills_whole_get_softmax_gradients_from_the_kernel():
    """Left padding under bf16's finfo.min: the padded query rows hold the fill on every key, their softmax
    is uniform, and their float32 LSE is the fill (log(count) absorbed; m * log2(e) overflows there). The
    backward kernel serves them (dO divided by P's row sum), after a call without such rows verified it and
    before one: every call's gradients match float64."""
    f = tc.compile(finfo_padded)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 4, 257, 64, generator=g).to("cuda", torch.bfloat16) for _ in range(3))
    clean = torch.zeros(2, 1, 257, 257, device="cuda", dtype=torch.bfloat16)
    padded = clean.clone()
    padded[0, :, :40] = torch.finfo(torch.bfloat16).min  # sample 0's first 40 query rows: every key filled
    padded[0, :, :, :40] = torch.finfo(torch.bfloat16).min  # and no real row of it sees a padded key
    dout = torch.randn(q.shape, generator=g).to("cuda", torch.bfloat16)
    _calls_match_float64(f, finfo_padded, (q, k, v), dout, (clean, padded, clean, padded))
    bw = backward_runner.backward_for(f.kernels()[-1].kernel_id)
    assert bw.served == {"kernel": 4}, bw.served


def keep_or_finfo(q, k, v, keep):
    s = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~keep, torch.finfo(q.dtype).min)
    return torch.softmax(s, dim=-1) @ v


def test_a_mean_of_v_program_takes_the_kernel_unless_a_row_keeps_no_key():
    """finfo.min fills make an empty row the mean of V (no backward kernel for that): the calls whose rows all
    keep a key are the kernel's, one with an empty row the reference's, each right."""
    f = tc.compile(keep_or_finfo)
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, 4, 257, 64, generator=g).to("cuda", torch.bfloat16) for _ in range(3))
    keep = torch.ones(2, 1, 257, 257, dtype=torch.bool, device="cuda").tril()
    empty = keep.clone()
    empty[1, :, 100] = False
    dout = torch.randn(q.shape, generator=g).to("cuda", torch.bfloat16)
    _calls_match_float64(f, keep_or_finfo, (q, k, v), dout, (keep, empty, keep))
    assert backward_runner.backward_for(f.kernels()[-1].kernel_id).served == {"kernel": 2, "reference": 1}


def test_gradients_through_ops_after_the_attention_on_the_kernel():
    """Heads merged and projected after the attention: the kernel's forward and backward for the attention,
    the spec's own ops after it by autograd (the projection's weight included), against float64."""
    import epilogue_specs as es
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 4, 300, 64, generator=g).to("cuda", torch.bfloat16) for _ in range(3))
    w_o = (torch.randn(256, 256, generator=g) / 16).to("cuda", torch.bfloat16)
    f = tc.compile(es.merged_and_projected)
    with torch.no_grad():
        f(q, k, v, w_o)
    leaves = [t.detach().requires_grad_() for t in (q, k, v, w_o)]
    dout = torch.randn(2, 300, 256, device="cuda", dtype=torch.bfloat16)
    f(*leaves).backward(dout)
    ref = [t.detach().double().requires_grad_() for t in leaves]
    es.merged_and_projected(*ref).backward(dout.double())
    assert f.served == {"kernel": 2} or (f.served["kernel"] == 2 and f.served["spec"] == 0), f.served
    assert backward_runner.backward_for(f.kernels()[-1].kernel_id).served == {"kernel": 1}
    # dQ's rows with the rounding of delta = rowsum(dO O) from the kernel's bf16 O allowed, as every flash-style
    # backward forms it: dO and O of the attention, before the merge and the projection
    B, H, S, D = q.shape
    with torch.no_grad():
        o = f(q, k, v, torch.eye(H * D, device="cuda", dtype=torch.bfloat16)).view(B, S, H, D).transpose(1, 2)
    do = (dout.double() @ w_o.double().T).view(B, S, H, D).transpose(1, 2)
    allow = delta_rounding_allowance(o, do, k, D ** -0.5)
    for i, (got, want) in enumerate(zip(leaves, ref)):
        v = judge_rows(got.grad.float(), want.grad, ROW_TOL, allowance=allow if i == 0 else None)
        assert v.ok, (i, v)


def _gated_rows(q, k, v, gate):
    return (torch.softmax(q @ k.transpose(-1, -2) * 0.125, dim=-1) * gate[..., None].to(q.dtype)) @ v


def _row_sinks(q, k, v, c):
    s = q @ k.transpose(-1, -2) * 0.125
    s = torch.cat([s, c[..., None].to(s.dtype)], -1)
    return s.softmax(-1)[..., :-1] @ v


@pytest.mark.parametrize("fn", [_gated_rows, _row_sinks], ids=["gate", "row_sink"])
def test_a_row_scaled_program_trains_on_the_forward_kernel(fn):
    """A factor per query row after the softmax (a learnable gate; a sink per row, read through the LSE): the
    op's forward on the kernel gives O unscaled and PyTorch scales it, so every gradient, the factor's too,
    is float64's. The op's backward is the attention's alone: the kernel's for the gate; the reference's for the
    sink, whose scale gives the LSE a gradient."""
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, 4, 257, 64, generator=g) for _ in range(3))
    extra = torch.rand(2, 4, 257, generator=g) + 0.5 if fn is _gated_rows else torch.randn(2, 4, 257, generator=g)
    args = _leaves((q, k, v, extra), torch.bfloat16)
    f = tc.compile(fn)
    with torch.no_grad():
        out = f(*args)
    dout = torch.randn_like(args[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = _run(f, args, dout)
    want = _run(fn, [a.double() for a in _leaves(args, torch.float64)], dout.double())
    _assert_grads(got, want, args, out, dout)
    assert f.served["kernel"] == 2 and f.served["spec"] == 0, f.served
    assert f.kernels()[-1].p.row_scale is not None
    who = "kernel" if fn is _gated_rows else "reference"
    assert backward_runner.backward_for(f.kernels()[-1].kernel_id).served == {who: 1}


@pytest.mark.parametrize("name, D", [("causal_sdpa", 128), ("gqa_expand", 64), ("document_causal", 96)])
def test_a_deterministic_backward_is_bitwise_equal_run_to_run(name, D):
    """compile(deterministic=True): on the Hopper kernel dQ's shares are added in a fixed key order (the
    warpgroups split dQ's columns at 96 and 128, its keys at 64), so three backwards give the same bits, and
    each holds to float64; the default mode may differ in dQ's last bits, never in dK and dV (summed in
    registers)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the deterministic mode is the Hopper kernel's")
    fn, make, ref_fn = _case(name, D)
    args = _leaves(make(), torch.bfloat16)
    f = tc.compile(fn, deterministic=True)
    with torch.no_grad():
        out = f(*args)
    dout = torch.randn_like(args[0])
    runs = [_run(f, args, dout) for _ in range(3)]
    for other in runs[1:]:
        for g, h in zip(runs[0], other):
            assert torch.equal(g, h)
    want = _run(ref_fn, [a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                         for a in _leaves(args, torch.float64)], dout.double())
    _assert_grads(runs[0], want, args, out, dout)
    assert backward_runner.backward_for(f.kernels()[-1].kernel_id).served == {"kernel": 3}


@pytest.mark.parametrize("D, DV", [(64, 128), (128, 64), (96, 40)])
def test_a_value_head_dim_of_its_own_trains_on_the_hopper_kernel(D, DV):
    """V wider or narrower than Q (multi-head latent attention one way, a wide V the other): every gradient
    float64's, the backward on the Hopper kernel (the FA2-class kernel refuses it)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("V's own head dim is the Hopper kernel's")

    def spec(q, k, v):
        return torch.softmax((q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5, dim=-1) @ v
    g = torch.Generator().manual_seed(D + DV)
    args = _leaves((torch.randn(2, 4, 257, D, generator=g), torch.randn(2, 4, 257, D, generator=g),
                    torch.randn(2, 4, 257, DV, generator=g)), torch.bfloat16)
    f = tc.compile(spec)
    with torch.no_grad():
        out = f(*args)
    dout = torch.randn_like(out)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = _run(f, args, dout)
    want = _run(spec, [a.double() for a in _leaves(args, torch.float64)], dout.double())
    _assert_grads(got, want, args, out, dout)
    assert backward_runner.backward_for(f.kernels()[-1].kernel_id).served == {"kernel": 1}


def test_a_first_training_call_has_its_backward_built_beside_the_forward():
    """A new program's first call that wants gradients starts its backward kernel's build on the build helper
    while the forward is built and verified (build/early.py); its first backward takes that build."""
    import os
    scale = 0.05 + (os.getpid() % 997) * 1e-5  # a program no earlier run of this machine's cache holds

    def spec(q, k, v):
        return torch.softmax(torch.tanh(q @ k.transpose(-1, -2) * scale / 9.0) * 9.0, dim=-1) @ v
    f = tc.compile(spec)
    args = _leaves(tuple(torch.randn(2, 4, 257, 64) for _ in range(3)), torch.bfloat16)
    out = f(*args)
    out.backward(torch.randn_like(out))
    bw = backward_runner.backward_for(f.kernels()[-1].kernel_id)
    assert bw.served == {"kernel": 1}, bw.served
    kern = next(k for k in bw._kernels.values() if k is not None)
    assert kern.info.get("early"), kern.info


@pytest.mark.parametrize("name, deterministic", [("document_causal", False), ("alibi_tensor", False),
                                                 ("gqa_expand", False), ("rel_bias_clamped", False),
                                                 ("causal_sdpa", True)])
def test_a_backward_split_into_shares_gives_the_whole_calls_gradients(monkeypatch, name, deterministic):
    """A call's backward run as one launch per (batch, KV head) pair, on two streams (ops/backward_shares.py):
    dK and dV bitwise the unsplit call's (summed in registers per CTA), dQ and a learnable tensor's gradient
    within float64's row rule; hooks reading the batch (document ids), the head (ALiBi's slopes) and a KV head's
    query heads (GQA) see the call's own indices. rel_bias_clamped takes the FA2-class kernel (a window site)."""
    from torch_cubridge.ops import backward_gpu
    if deterministic and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the deterministic mode is the Hopper kernel's")
    fn, make, ref_fn = _case(name)
    args = _leaves(make(), torch.bfloat16)
    dout = torch.randn_like(args[0])
    counts: list[int] = []
    plan = backward_gpu.plan_shares
    monkeypatch.setattr(backward_gpu, "plan_shares", lambda *a: (lambda s: counts.append(len(s)) or s)(plan(*a)))
    runs = []
    for split in (False, True):
        monkeypatch.setattr(backward_runner, "_RUNNERS", {})  # a runner, and its kernel, made at these settings
        monkeypatch.setattr(backward_gpu, "SCRATCH_OF_Q", 0.0 if split else 1e9)
        monkeypatch.setattr(backward_gpu, "WAVES", 0)
        f = tc.compile(fn, deterministic=deterministic)
        with torch.no_grad():
            out = f(*args)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            runs.append(_run(f, args, dout))
        assert backward_runner.backward_for(f.kernels()[-1].kernel_id).served == {"kernel": 1}
    pairs = args[1].shape[0] * args[1].shape[1]
    assert counts[0] == 1 and counts[-1] == pairs, counts
    whole, split = runs
    assert torch.equal(whole[1], split[1]) and torch.equal(whole[2], split[2])
    want = _run(ref_fn, [a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                         for a in _leaves(args, torch.float64)], dout.double())
    _assert_grads(split, want, args, out, dout)


def test_the_backward_reads_the_row_flags_its_forward_noted(monkeypatch):
    """The backward's gate (rows a finite fill fills whole, rows with no key) reads the flags its forward made
    and copied behind itself (ops/row_flags.py), computing none itself: no host wait in the backward."""
    from torch_cubridge.ops import row_flags
    made = []
    flags = row_flags._flags
    monkeypatch.setattr(row_flags, "_flags", lambda lse: made.append(lse.shape) or flags(lse))
    fn, make, _ = _case("causal_sdpa")
    args = _leaves(make(), torch.bfloat16)
    f = tc.compile(fn)
    with torch.no_grad():
        f(*args)  # built and verified
    made.clear()
    before = set(row_flags._NOTES)
    out = f(*args)
    noted = set(row_flags._NOTES) - before
    assert len(made) == 1 and len(noted) == 1
    out.backward(torch.randn_like(out))
    assert len(made) == 1  # the backward made none
    assert not noted & set(row_flags._NOTES)  # it read the note
    assert backward_runner.backward_for(f.kernels()[-1].kernel_id).served == {"kernel": 1}
