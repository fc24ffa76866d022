"""Autograd through the custom op on the CPU: the op's forward by the interpreter (interpreted_op.py), its
backward by the backward runner, against float64 autograd of the spec, in eager, torch.compile(fullgraph),
activation checkpointing and autocast; the GPU kernel's gate exercised with stand-in kernels."""
from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import torch_cubridge as tc
from torch_cubridge.ops import backward_gpu, backward_runner
from torch_cubridge.ops.backward_reference import reference_backward
from torch_cubridge.verify.judge import judge_rows
from interpreted_op import serve_by_op
from zoo import CASES, empty_rows_causal, empty_rows_reference

NAMES = ["causal_sdpa", "full_matmul", "softcap_causal", "sliding_window", "gqa_expand", "document_causal",
         "alibi_tensor", "sinks_column", "rel_bias_table"]
ROW_TOL = 1e-4  # float32 against float64, a row's error over its own scale


def _case(name):
    c = next(c for c in CASES if c.name == name)
    return c.fn, lambda: c.make(2, 4, 2 if name == "gqa_expand" else 4, 37, 16, torch.float32), c.fn


def _grads(fn, args, dout):
    """The outputs' gradients of every floating tensor argument (and the output), in float64 where args are."""
    leaves = [a.detach().clone().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
              for a in args]
    out = fn(*leaves)
    out.backward(dout.to(out.dtype))
    return out, [a.grad for a in leaves if isinstance(a, torch.Tensor) and a.is_floating_point()]


def _check(got, want, tol=ROW_TOL):
    for g, w in zip(got, want):
        assert g is not None and torch.isfinite(g).all()
        v = judge_rows(g, w, tol)
        assert v.ok, v


def _reference(fn, args, dout):
    return _grads(fn, tuple(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                            for a in args), dout.double())


@pytest.mark.parametrize("name", NAMES + ["empty_rows"])
def test_eager_backward_matches_float64_autograd(monkeypatch, name):
    made = serve_by_op(monkeypatch)
    if name == "empty_rows":
        fn, make, ref_fn = empty_rows_causal, lambda: tuple(torch.randn(2, 4, 37, 16) for _ in range(3)), \
            empty_rows_reference
    else:
        fn, make, ref_fn = _case(name)
    f = tc.compile(fn)
    args = make()
    dout = torch.randn(args[0].shape[:-1] + (args[2].shape[-1],))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out, got = _grads(f, args, dout)
    assert out.grad_fn is not None and f.served["kernel"] == 1 and f.served["spec"] == 0, f.served
    runner = made[-1]
    assert runner.forward_calls == 1
    assert backward_runner.backward_for(runner.kernel_id).served == {"reference": 1}
    assert any("reference backward" in str(w.message) for w in seen)  # on the CPU the kernel is refused, said
    _, want = _reference(ref_fn, args, dout)
    _check(got, want)


def _compiled_pair(monkeypatch, name="softcap_causal"):
    serve_by_op(monkeypatch)
    fn, make, _ = _case(name)
    f = tc.compile(fn, fallback="silent")
    args = make()
    with torch.no_grad():
        f(*args)  # builds (here: registers) the runner eagerly, before any trace
    return f, fn, args


def test_torch_compile_fullgraph_backward(monkeypatch):
    torch._dynamo.reset()
    f, fn, args = _compiled_pair(monkeypatch, "alibi_tensor")
    model = torch.compile(lambda q, k, v, s: f(q, k, v, s) * 2, fullgraph=True)
    dout = torch.randn_like(args[0])
    _, got = _grads(model, args, dout)
    _, want = _reference(lambda *a: fn(*a) * 2, args, dout)
    _check(got, want)
    assert backward_runner.backward_for(f.kernels()[-1].kernel_id).served["reference"] >= 1


def test_checkpointed_backward(monkeypatch):
    f, fn, args = _compiled_pair(monkeypatch)
    dout = torch.randn_like(args[0])
    _, got = _grads(lambda *a: checkpoint(f, *a, use_reentrant=False), args, dout)
    _, want = _reference(fn, args, dout)
    _check(got, want)
    assert f.kernels()[-1].forward_calls == 2  # the forward and its recompute (the no-grad call: no op)


def test_autocast_backward(monkeypatch):
    """Forward under autocast, backward after it (as a training step does): the gradients are the inputs'
    dtype and as close to float64 as the spec's own under autocast."""
    f, fn, args = _compiled_pair(monkeypatch)
    dout = torch.randn_like(args[0])
    errs = []
    _, want = _reference(fn, args, dout)
    for g in (f, fn):
        leaves = [a.detach().clone().requires_grad_() for a in args]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = g(*leaves)
        out.backward(dout.to(out.dtype))
        assert all(a.grad.dtype == a.dtype for a in leaves)
        errs.append(max(float((a.grad.double() - w).norm() / w.norm()) for a, w in zip(leaves, want)))
    assert errs[0] <= 2 * errs[1] + 1e-4, errs
    assert f.served["kernel"] == 2 and f.served["spec"] == 0  # the no-grad build call, and this one


def test_no_grad_keeps_the_kernel_path(monkeypatch):
    f, fn, args = _compiled_pair(monkeypatch)
    leaves = [a.requires_grad_() for a in args]
    for ctx in (torch.no_grad, torch.inference_mode):
        with ctx():
            out = f(*leaves)
        assert out.grad_fn is None
    assert f.kernels()[-1].forward_calls == 0  # served by the kernel path: no op call, nothing saved


def test_double_backward_raises_clearly(monkeypatch):
    f, fn, args = _compiled_pair(monkeypatch)
    q = args[0].clone().requires_grad_()
    out = f(q, *args[1:])
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(out.square().sum(), q, create_graph=True)


def _stand_in(spoil=None):
    """A stand-in 'GPU kernel': the float32 reference's dQ, dK, dV, with spoil(dq, q, lse) making dQ wrong in
    place where a test asks."""
    def build(p, arch, dtype, head_dim, value_dim=None, deterministic=False, learnable=()):
        def kern(q, k, v, extras, scalars, out, lse, dout):
            dq, dk, dv, _ = reference_backward(p, q, k, v, extras, scalars, dout, None, [])
            if spoil is not None:
                spoil(dq, q, lse)
            return dq, dk, dv, {}
        return kern
    return build


def _scale_a_row(dq, q, lse):
    dq[0, 0, 5] *= 1.2


@pytest.mark.parametrize("wrong", [False, True], ids=["right", "wrong"])
def test_kernel_gate_serves_a_verified_kernel_and_refuses_a_wrong_one(monkeypatch, wrong):
    monkeypatch.setattr(backward_gpu, "refusal", lambda *a: None)
    monkeypatch.setattr(backward_runner, "build_kernel", _stand_in(_scale_a_row if wrong else None))
    f, fn, args = _compiled_pair(monkeypatch)
    dout = torch.randn_like(args[0])
    bw, first = None, None
    for _ in range(2):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            _, got = _grads(f, args, dout)
        first = seen if first is None else first
        bw = backward_runner.backward_for(f.kernels()[-1].kernel_id)
        _, want = _reference(fn, args, dout)
        _check(got, want)  # right either way: a wrong kernel is caught on its first backward
    if wrong:
        assert bw.served == {"reference": 2}
        assert any("failed its check" in str(w.message) and "dQ" in str(w.message) for w in first)
    else:
        assert bw.served == {"kernel": 2}


def _site_stand_in(forget: bool):
    """A stand-in kernel that also gives the gradients of the learnable tensors the score reads (the real
    kernel's learnable sites), as float32 by name; or forgets them (an empty dict: zero gradients)."""
    def build(p, arch, dtype, head_dim, value_dim=None, deterministic=False, learnable=()):
        def kern(q, k, v, extras, scalars, out, lse, dout):
            learn = [i for i, x in enumerate(p.extras) if x.name in learnable]
            dq, dk, dv, g = reference_backward(p, q, k, v, extras, scalars, dout, None, learn)
            return dq, dk, dv, {} if forget else {p.extras[i].name: t.float() for i, t in zip(learn, g)}
        return kern
    return build


@pytest.mark.parametrize("forget", [False, True], ids=["right", "forgets"])
def test_learnable_score_tensors_get_their_gradients_from_the_kernel_checked(monkeypatch, forget):
    """ALiBi slopes held as a parameter: the kernel's gradient of them serves once checked against float64; a
    kernel that leaves them out (zero) fails its check on the slopes, and the reference serves."""
    monkeypatch.setattr(backward_gpu, "refusal", lambda *a: None)
    monkeypatch.setattr(backward_runner, "build_kernel", _site_stand_in(forget))
    f, fn, args = _compiled_pair(monkeypatch, "alibi_tensor")
    dout = torch.randn_like(args[0])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _, got = _grads(f, args, dout)
    assert got[3] is not None  # the slopes' gradient
    served = backward_runner.backward_for(f.kernels()[-1].kernel_id).served
    assert served == ({"reference": 1} if forget else {"kernel": 1}), served
    if forget:
        assert any("gradient of" in str(w.message) and "failed its check" in str(w.message) for w in seen)
    _, want = _reference(fn, args, dout)
    _check(got, want)


def finfo_padded(q, k, v, mask):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + mask
    return torch.softmax(s, dim=-1) @ v


def _kernel_math_stand_in(p, arch, dtype, head_dim, value_dim=None, deterministic=False, learnable=()):
    """A stand-in for the backward kernel of finfo_padded that computes as the kernel does, in float32: P
    recomputed as exp(X - LSE) from the forward's LSE (zero on rows with no key), delta = rowsum(dO O) from
    the forward's O."""
    def kern(q, k, v, extras, scalars, out, lse, dout):
        x = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + extras[0]
        row = lse.reshape(x.shape[:-1]).unsqueeze(-1)
        pr = torch.exp(x - row).masked_fill(torch.isneginf(row), 0.0)  # a row with no key: P zero
        dp = dout @ v.transpose(-1, -2)
        ds = pr * (dp - (dout * out).sum(-1, keepdim=True)) / math.sqrt(q.shape[-1])
        return ds @ k, ds.transpose(-1, -2) @ q, pr.transpose(-1, -2) @ dout, {}
    return kern


def test_rows_filled_whole_by_a_finite_fill_are_right_on_the_kernel(monkeypatch):
    """A row every key of which holds finfo.min has its float32 LSE at the fill (log(count) absorbed), so the
    kernel's P = exp(X - LSE) is 1 on every key, count times softmax's: the runner hands it dO divided by that
    row sum, and the gradients are softmax's (a stand-in computing the kernel's math, which without the
    division gives dV 5 times too large in those rows)."""
    monkeypatch.setattr(backward_gpu, "refusal", lambda *a: None)
    monkeypatch.setattr(backward_runner, "build_kernel", _kernel_math_stand_in)
    made = serve_by_op(monkeypatch)
    f = tc.compile(finfo_padded)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 37, 16, generator=g) for _ in range(3))
    mask = torch.zeros(2, 1, 37, 37)
    with torch.no_grad():
        f(q, k, v, mask)
    dout = torch.randn_like(q)
    mask[0, :, :5] = torch.finfo(torch.float32).min  # five padded query rows, filled whole
    mask[1, :, :, 30:] = torch.finfo(torch.float32).min  # and rows with some keys filled: LSE as usual
    for m in (mask, torch.zeros_like(mask)):
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            _, got = _grads(lambda q, k, v: f(q, k, v, m), (q, k, v), dout)  # the mask needs no gradient
        _, want = _reference(lambda q, k, v: finfo_padded(q, k, v, m.double()), (q, k, v), dout)
        _check(got, want)
    assert backward_runner.backward_for(made[-1].kernel_id).served == {"kernel": 2}


def keep_or_finfo(q, k, v, keep):
    s = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~keep, torch.finfo(q.dtype).min)
    return torch.softmax(s, dim=-1) @ v


def test_a_mean_of_v_program_is_on_the_kernel_for_calls_whose_rows_all_keep_a_key(monkeypatch):
    """A finfo.min fill makes a row with no key the mean of V, whose gradient the backward kernel does not
    give: a call with such a row takes the reference, a call without one the kernel (the program's other rows
    are the zero-empty-row program's)."""
    monkeypatch.setattr(backward_gpu, "refusal", lambda *a: None)
    monkeypatch.setattr(backward_runner, "build_kernel", _stand_in(None))
    made = serve_by_op(monkeypatch)
    f = tc.compile(keep_or_finfo)
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 4, 37, 16, generator=g) for _ in range(3))
    keep = torch.ones(2, 1, 37, 37, dtype=torch.bool).tril()
    with torch.no_grad():
        f(q, k, v, keep)
    assert made[-1].p.empty_rows == "mean_v"
    dout = torch.randn_like(q)
    empty = keep.clone()
    empty[1, :, 3] = False  # query row 3 of batch 1 keeps no key
    for m in (keep, empty):
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            _, got = _grads(lambda q, k, v: f(q, k, v, m), (q, k, v), dout)
        _, want = _reference(lambda q, k, v: keep_or_finfo(q, k, v, m), (q, k, v), dout)
        _check(got, want)
    assert backward_runner.backward_for(made[-1].kernel_id).served == {"kernel": 1, "reference": 1}


def test_a_kernel_that_cannot_be_built_keeps_its_reason_on_later_calls(monkeypatch):
    """The reference serves every backward of a program whose kernel failed to build, warning once with the
    build's own reason, on later calls too."""
    def fails(*a):
        raise RuntimeError("no compiler here")
    monkeypatch.setattr(backward_gpu, "refusal", lambda *a: None)
    monkeypatch.setattr(backward_runner, "build_kernel", fails)
    f, fn, args = _compiled_pair(monkeypatch)
    dout = torch.randn_like(args[0])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):
            _, got = _grads(f, args, dout)
    reasons = {str(w.message) for w in seen if "reference backward" in str(w.message)}
    assert len(reasons) == 1 and "no compiler here" in reasons.pop()
    assert backward_runner.backward_for(f.kernels()[-1].kernel_id).served == {"reference": 2}
    _, want = _reference(fn, args, dout)
    _check(got, want)


def _sink_kernel_stand_in(scores_alone: bool):
    """A stand-in for the backward kernel of sinks_column computing as the kernel does: P = exp(X - LSE) from
    the forward's LSE, which has the sink joined. scores_alone: P from the LSE of the scores without the sink
    (a kernel that drops the sink's share of each row), which the first backward's check must catch."""
    def build(p, arch, dtype, head_dim, value_dim=None, deterministic=False, learnable=()):
        def kern(q, k, v, extras, scalars, out, lse, dout):
            x = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
            row = torch.logsumexp(x, -1, keepdim=True) if scores_alone else lse.reshape(x.shape[:-1]).unsqueeze(-1)
            pr = torch.exp(x - row)
            ds = pr * (dout @ v.transpose(-1, -2) - (dout * out).sum(-1, keepdim=True)) / math.sqrt(q.shape[-1])
            return ds @ k, ds.transpose(-1, -2) @ q, pr.transpose(-1, -2) @ dout, {}
        return kern
    return build


@pytest.mark.parametrize("wrong", [False, True], ids=["kernel_math", "sink_dropped"])
def test_learnable_sinks_are_served_beside_the_kernel(monkeypatch, wrong):
    """gpt-oss's learnable sinks: the kernel's dQ, dK, dV from P over the LSE with the sink joined, and the
    sinks' gradient, -sum over rows of rowsum(dO O) exp(c - LSE), by PyTorch beside it, all against float64
    autograd of the spec. A kernel whose P leaves the sink out fails its first check, and the reference serves."""
    monkeypatch.setattr(backward_gpu, "refusal", lambda *a: None)
    monkeypatch.setattr(backward_runner, "build_kernel", _sink_kernel_stand_in(wrong))
    made = serve_by_op(monkeypatch)
    fn, make, _ = _case("sinks_column")
    f = tc.compile(fn)
    args = make()
    args = args[:3] + (4.0 + args[3] * 0.5,)  # sinks that take about half of each row (e^4 against 37 keys)
    with torch.no_grad():
        f(*args)
    dout = torch.randn_like(args[0])
    for _ in range(2):
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            _, got = _grads(f, args, dout)
        _, want = _reference(fn, args, dout)
        assert got[3] is not None and got[3].abs().max() > 1e-2  # the sinks' gradient
        _check(got, want)
    served = backward_runner.backward_for(made[-1].kernel_id).served
    assert served == ({"reference": 2} if wrong else {"kernel": 2})


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "torch_compile"])
def test_gradients_through_ops_after_the_attention(monkeypatch, compiled):
    """A spec that merges the heads and projects them (and one that layer-norms after): the op gives the
    attention, the spec's own ops after it run outside the op, so the projection's weight gets its gradient
    from autograd and q, k, v theirs from the op's backward, in eager and under torch.compile(fullgraph)."""
    import epilogue_specs as es
    torch._dynamo.reset()
    made = serve_by_op(monkeypatch)
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, 4, 37, 16, generator=g) for _ in range(3))
    w_o = torch.randn(64, 64, generator=g) / 8
    f = tc.compile(es.merged_and_projected)
    with torch.no_grad():
        f(q, k, v, w_o)
    assert made and made[-1].p.epilogue
    run = torch.compile(f, fullgraph=True) if compiled else f
    dout = torch.randn(2, 37, 64, generator=g)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _, got = _grads(run, (q, k, v, w_o), dout)
    assert not [str(w.message) for w in seen if "the spec" in str(w.message)]  # the op served, not the spec
    _, want = _reference(es.merged_and_projected, (q, k, v, w_o), dout)
    assert len(got) == 4 and got[3] is not None  # the projection's gradient too
    _check(got[:3], want[:3])
    assert judge_rows(got[3], want[3], ROW_TOL).ok
    assert backward_runner.backward_for(made[-1].kernel_id).served["reference"] >= 1


def _gated_rows(q, k, v, gate):
    p = torch.softmax(q @ k.transpose(-1, -2) * 0.25, dim=-1)
    return (p * gate[..., None]) @ v


def _divided_rows(q, k, v, temp):
    p = (q @ k.transpose(-1, -2) * 0.25).softmax(-1)
    return (p / temp[None, :, None, None]) @ v


def _row_sinks(q, k, v, c):
    """A sink logit per query row: its share of each row's weight is a factor of the row, read through the LSE."""
    s = torch.cat([q @ k.transpose(-1, -2) * 0.25, c[..., None]], -1)
    return s.softmax(-1)[..., :-1] @ v


# the row-scaled programs: a gate, a temperature, a sink per row (which reads the LSE), with their factors
ROW_SCALED = pytest.mark.parametrize("fn,extra", [(_gated_rows, lambda: torch.rand(2, 4, 37) + 0.5),
                                                 (_divided_rows, lambda: torch.rand(4) + 0.5),
                                                 (_row_sinks, lambda: torch.randn(2, 4, 37))],
                                     ids=["gate", "temperature", "row_sink"])


def _row_scaled_grads(f, extra, seed):
    """The gradients of a row-scaled call [2, 4, 37, 16] of f (warnings ignored), its arguments and dO."""
    g = torch.Generator().manual_seed(seed)
    args = tuple(torch.randn(2, 4, 37, 16, generator=g) for _ in range(3)) + (extra(),)
    dout = torch.randn(2, 4, 37, 16, generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, got = _grads(f, args, dout)
    return got, args, dout


@ROW_SCALED
def test_a_row_scaled_program_trains_through_the_op(monkeypatch, fn, extra):
    """The probabilities scaled per query row after the softmax (a gate, a temperature, a sink per row read
    through the LSE): the op gives O unscaled and PyTorch applies the scale after it, so dO, the LSE's gradient
    and the learnable factor's gradient reach the backward; every gradient, the factor's too, is float64's."""
    made = serve_by_op(monkeypatch)
    f = tc.compile(fn)
    got, args, dout = _row_scaled_grads(f, extra, 7)
    assert made and made[-1].p.row_scale is not None
    assert f.served["kernel"] == 1 and f.served["spec"] == 0, f.served
    assert made[-1].forward_calls == 1
    _, want = _reference(fn, args, dout)
    _check(got, want)


def test_a_row_sink_program_trains_under_torch_compile_fullgraph(monkeypatch):
    """The row scale applied after the op traces with it: one graph, gradients float64's."""
    torch._dynamo.reset()
    serve_by_op(monkeypatch)
    f = tc.compile(_row_sinks, fallback="silent")
    g = torch.Generator().manual_seed(3)
    args = tuple(torch.randn(2, 4, 37, 16, generator=g) for _ in range(3)) + (torch.randn(2, 4, 37, generator=g),)
    with torch.no_grad():
        f(*args)  # registers the runner before the trace
    model = torch.compile(lambda q, k, v, c: f(q, k, v, c) * 2, fullgraph=True)
    dout = torch.randn_like(args[0])
    _, got = _grads(model, args, dout)
    _, want = _reference(lambda *a: _row_sinks(*a) * 2, args, dout)
    _check(got, want)


@pytest.mark.parametrize("how", ["default", "option", "torch"])
def test_determinism_reaches_the_backward_kernel(monkeypatch, how):
    """compile(deterministic=True), or torch.use_deterministic_algorithms(True) when the forward runs, builds the
    backward kernel in its deterministic mode (a kernel of its own, beside the default one); else the default."""
    monkeypatch.setattr(backward_gpu, "refusal", lambda *a: None)
    asked: list[bool] = []

    def build(p, arch, dtype, head_dim, value_dim=None, deterministic=False, learnable=()):
        asked.append(deterministic)
        return _stand_in(None)(p, arch, dtype, head_dim)
    monkeypatch.setattr(backward_runner, "build_kernel", build)
    serve_by_op(monkeypatch)
    fn, make, _ = _case("softcap_causal")
    f = tc.compile(fn, fallback="silent", deterministic=how == "option")
    args = make()
    with torch.no_grad():
        f(*args)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(how == "torch")
    try:
        out, _ = _grads(f, args, torch.randn_like(args[0]))
    finally:
        torch.use_deterministic_algorithms(before)
    assert asked == [how != "default"]
    assert backward_runner.backward_for(f.kernels()[-1].kernel_id).served == {"kernel": 1}


def test_a_value_head_dim_of_its_own_gets_a_backward_kernel_of_its_own(monkeypatch):
    """The backward kernel is built per (head dim, value head dim): a call whose V is wider than the calls
    before it is not handed their kernel (built for their V's width, and checked only on their first call)."""
    monkeypatch.setattr(backward_gpu, "refusal", lambda *a: None)
    asked: list[tuple] = []

    def build(p, arch, dtype, head_dim, value_dim=None, deterministic=False, learnable=()):
        asked.append((head_dim, value_dim))
        return _stand_in(None)(p, arch, dtype, head_dim)
    monkeypatch.setattr(backward_runner, "build_kernel", build)
    serve_by_op(monkeypatch)

    def spec(q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2) * 0.25, dim=-1) @ v
    f = tc.compile(spec, fallback="silent")
    q, k = torch.randn(2, 4, 37, 16), torch.randn(2, 4, 37, 16)
    for dv in (16, 32):
        v = torch.randn(2, 4, 37, dv)
        with torch.no_grad():
            f(q, k, v)
        dout = torch.randn(2, 4, 37, dv)
        _, got = _grads(f, (q, k, v), dout)
        _, want = _reference(spec, (q, k, v), dout)
        _check(got, want)
    assert sorted(asked) == [(16, 16), (16, 32)]


@ROW_SCALED
def test_a_row_scale_that_reads_no_lse_leaves_the_backward_to_the_kernel(monkeypatch, fn, extra):
    """The op's backward of a row-scaled program is the attention's alone (PyTorch scales after the op): the
    kernel takes it where the scale reads no LSE (a gate, a temperature); a sink per row gives the LSE a
    gradient, and the reference takes it. Every gradient is float64's either way."""
    monkeypatch.setattr(backward_gpu, "refusal", lambda *a: None)
    monkeypatch.setattr(backward_runner, "build_kernel", _stand_in(None))
    serve_by_op(monkeypatch)
    f = tc.compile(fn, fallback="silent")
    got, args, dout = _row_scaled_grads(f, extra, 5)
    _, want = _reference(fn, args, dout)
    _check(got, want)
    who = "reference" if fn is _row_sinks else "kernel"
    assert backward_runner.backward_for(f.kernels()[-1].kernel_id).served == {who: 1}


def _wrong_off_the_calls_length(length: int):
    """A stand-in kernel right at the call's query length and wrong at any other (one row of dQ doubled): what a
    kernel wrong only on partial tiles looks like to a check of the call's own inputs."""
    def spoil(dq, q, lse):
        if q.shape[2] != length:
            dq[0, 0, 5] *= 2.0
    return _stand_in(spoil)


@pytest.mark.parametrize("wrong", [False, True], ids=["right", "wrong-off-length"])
def test_a_backward_kernel_is_checked_on_redrawn_cases_too(monkeypatch, wrong):
    """The first backward's check runs the kernel on the cases the forward's verification draws (other lengths,
    structured masks) besides the call's own inputs: a kernel right at the call's length and wrong at another is
    caught there, and the reference serves; a right one serves. The call's activations are not what is kept."""
    monkeypatch.setattr(backward_gpu, "refusal", lambda *a: None)
    S = 300
    build = _wrong_off_the_calls_length(S) if wrong else _stand_in(None)
    monkeypatch.setattr(backward_runner, "build_kernel", build)
    made = serve_by_op(monkeypatch)
    c = next(c for c in CASES if c.name == "causal_sdpa")
    f = tc.compile(c.fn)
    args = c.make(2, 4, 4, S, 16, torch.float32)
    dout = torch.randn(args[0].shape)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        leaves = [a.detach().clone().requires_grad_() for a in args]
        out = f(*leaves)
        kept = made[-1].grad_example
        assert kept is not None and all(t.device.type == "meta" for t in kept.values() if isinstance(t, torch.Tensor))
        out.backward(dout)
    bw = backward_runner.backward_for(made[-1].kernel_id)
    _, want = _reference(c.fn, args, dout)
    _check([a.grad for a in leaves], want)  # right either way
    assert made[-1].grad_example is None  # drawn from once, then let go
    if wrong:
        assert bw.served == {"reference": 1}, bw.served
        assert any("redrawn case" in str(w.message) and "Sq 77" in str(w.message) for w in seen), \
            [str(w.message) for w in seen]
    else:
        assert bw.served == {"kernel": 1}, bw.served


def keep_masked(q, k, v, keep):
    return (q @ k.transpose(-1, -2) / 4).masked_fill(~keep, float("-inf")).softmax(-1) @ v


def test_a_backward_kernel_is_checked_on_structured_masks_too(monkeypatch):
    """A boolean mask argument over (query, key): the redrawn cases mask whole rows and tiles (verify/inputs.py's
    structured patterns). A stand-in kernel that leaves garbage in the rows that keep no key passes a call whose
    mask empties no row, and is caught on those cases; the reference serves, every gradient right."""
    def spoil(dq, q, lse):
        dq[torch.isneginf(lse)] = 1.0  # rows with no key: zero in the program's rule
    monkeypatch.setattr(backward_gpu, "refusal", lambda *a: None)
    monkeypatch.setattr(backward_runner, "build_kernel", _stand_in(spoil))
    made = serve_by_op(monkeypatch)
    f = tc.compile(keep_masked)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 150, 16, generator=g) for _ in range(3))
    keep = torch.rand(2, 1, 150, 150, generator=g) > 0.3
    assert keep.sum(-1).min() > 0  # no row of the call's own is empty
    dout = torch.randn(q.shape, generator=g)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        f(*leaves, keep).backward(dout)
    assert backward_runner.backward_for(made[-1].kernel_id).served == {"reference": 1}
    assert any("structured mask" in str(w.message) and "dQ" in str(w.message) for w in seen), \
        [str(w.message) for w in seen]
    _, want = _reference(lambda a, b, c: keep_masked(a, b, c, keep), (q, k, v), dout)
    _check([t.grad for t in leaves], want)


def test_rows_a_finite_fill_absorbs_in_float32_are_judged_as_the_forward_judges_them(monkeypatch):
    """A fill such as -1e9 absorbs the scores in float32 (a filled row is uniform there) and not in float64
    (softmax of the scores): the forward's verification holds such rows to the spec in float32, and so must the
    backward's first check, whose redrawn structured cases fill whole rows with each of verify/inputs.py's
    fills. A kernel computing as the real one does (P = exp(X - LSE) in float32) serves; the gradients are the
    spec's, in float32 as in float64 on every other row."""
    monkeypatch.setattr(backward_gpu, "refusal", lambda *a: None)
    monkeypatch.setattr(backward_runner, "build_kernel", _kernel_math_stand_in)
    made = serve_by_op(monkeypatch)
    f = tc.compile(finfo_padded)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 4, 150, 16, generator=g) for _ in range(3))
    mask = torch.zeros(2, 1, 150, 150)
    mask[0, :, :, :20] = torch.finfo(torch.float32).min  # left padding: no row filled whole in the call
    dout = torch.randn(q.shape, generator=g)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        f(*leaves, mask).backward(dout)
    assert backward_runner.backward_for(made[-1].kernel_id).served == {"kernel": 1}, \
        [str(w.message) for w in seen]
    _, want = _reference(lambda a, b, c: finfo_padded(a, b, c, mask.double()), (q, k, v), dout)
    _check([t.grad for t in leaves], want)


def test_the_float32_judgement_is_taken_only_where_its_backward_is_finite(monkeypatch):
    """The judge leaves a reference's NaN elements unjudged, so a float32 backward that overflowed (NaN in dK and
    dV where float64's is finite) would pass any kernel there: such a float32 opinion is not taken, and a kernel
    wrong in dK is refused (seen served with the finiteness test left out)."""
    monkeypatch.setattr(backward_gpu, "refusal", lambda *a: None)
    real = backward_runner.reference_backward

    def overflowing(p, q, k, v, extras, scalars, dout, dlse, learn, fdt=None, o=None):
        dq, dk, dv, x = real(p, q, k, v, extras, scalars, dout, dlse, learn, fdt=fdt, o=o)
        if fdt is torch.float32:
            dk, dv = torch.full_like(dk, float("nan")), torch.full_like(dv, float("nan"))
        return dq, dk, dv, x
    monkeypatch.setattr(backward_runner, "reference_backward", overflowing)

    def wrong_dk(p, arch, dtype, head_dim, value_dim=None, deterministic=False, learnable=()):
        def kern(q, k, v, extras, scalars, out, lse, dout):
            dq, dk, dv, _ = real(p, q, k, v, extras, scalars, dout, None, [])
            dk[0, 0, 3] *= 1.5
            return dq, dk, dv, {}
        return kern
    monkeypatch.setattr(backward_runner, "build_kernel", wrong_dk)
    f, fn, args = _compiled_pair(monkeypatch)
    dout = torch.randn_like(args[0])
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        _, got = _grads(f, args, dout)
    assert backward_runner.backward_for(f.kernels()[-1].kernel_id).served == {"reference": 1}
    _, want = _reference(fn, args, dout)
    _check(got, want)
