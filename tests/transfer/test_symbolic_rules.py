"""The symbolic walker's op rules (transfer/symbolic/rules/), each family alone: one aten op applied to
symbolic inputs through Walker.call, its value evaluated and compared with the op itself in float64;
the softmax family through the smallest captured attention; an op with no rule refused as before."""
import pytest
import torch
import torch.nn.functional as F

from helpers import rel_err
from torch_cubridge.capture.trace import bind_example, capture
from torch_cubridge.errors import UnsupportedSpec
from torch_cubridge.ir.expr import free_vars
from torch_cubridge.ir.interpreter import evaluate
from torch_cubridge.transfer.symbolic.graph import Walker
from torch_cubridge.transfer.symbolic.rules import RULES, aten_name, rule
from torch_cubridge.transfer.symbolic.sym import Ctx, Sym, input_sym
from torch_cubridge.transfer.symbolic_backend import symbolic_transfer

aten = torch.ops.aten


def _tensors(a, f):
    """a with every tensor in it (also in lists) replaced by f(tensor)."""
    if isinstance(a, torch.Tensor):
        return f(a)
    if isinstance(a, (list, tuple)):
        return type(a)(_tensors(x, f) for x in a)
    return a


def _double(t: torch.Tensor) -> torch.Tensor:
    return t.double() if t.is_floating_point() else t.clone()


class Applied:
    """One aten op applied, through Walker.call, to inputs given as symbolic loads."""

    def __init__(self, op, *args, **kwargs):
        g = torch.fx.Graph()
        self.ctx, self.tensors, inputs, holders = Ctx(), {}, {}, []

        def hold(a):
            if isinstance(a, torch.Tensor):
                name = f"x{len(self.tensors)}"
                self.tensors[name] = a
                inputs[name] = input_sym(self.ctx, name, a)
                ph = g.placeholder(name)
                ph.meta["val"] = a
                holders.append((ph, name))
                return ph
            if isinstance(a, (list, tuple)):
                return type(a)(hold(x) for x in a)
            return a
        fx_args = tuple(hold(a) for a in args)
        self.node = g.call_function(op, fx_args, kwargs)
        self.node.meta["val"] = op(*_tensors(args, torch.clone), **kwargs)  # an in-place op writes a copy
        self.expected = op(*_tensors(args, _double), **kwargs)
        self.walker = Walker(self.ctx, inputs)
        for ph, name in holders:
            self.walker.env[ph] = inputs[name]
            self.walker.from_call.add(ph)

    def value(self):
        return self.walker.call(self.node)

    def numbers(self, x: Sym, **env) -> torch.Tensor:
        """x's value at every index of its axes (a merged dim's atoms are its row-major digits)."""
        shape = self.ctx.shape(x)
        env = {**env, **{"@" + n: _double(t) for n, t in self.tensors.items()}}
        for i, d in enumerate(x.axes):
            idx = torch.arange(self.ctx.dim_size(d)).view([-1 if j == i else 1 for j in range(len(shape))])
            inner = self.ctx.dim_size(d)
            for a in d:
                inner //= self.ctx.sizes[a]
                env[a] = idx // inner % self.ctx.sizes[a]
        assert free_vars(x.expr) <= set(env), f"{x.expr} reads atoms that are not its axes"
        return torch.as_tensor(evaluate(x.expr, env, torch.float64)).broadcast_to(shape)


def same(op, *args, **kwargs):
    """The op's rule gives the op's own values (float64), at the op's own shape."""
    ap = Applied(op, *args, **kwargs)
    x = ap.value()
    x = x[0] if isinstance(x, tuple) else x
    want = ap.expected[0] if isinstance(ap.expected, tuple) else ap.expected
    got = ap.numbers(x)
    assert got.shape == want.shape
    if want.is_floating_point():
        assert x.kind == "value"
        # the interpreter holds literals in float32, as the kernel does: 0.1 is float32's 0.1
        assert torch.allclose(got.double(), want.double(), rtol=1e-6, atol=1e-6, equal_nan=True)
    else:
        assert x.dtype == want.dtype and torch.equal(got.to(want.dtype), want)


def refused(op, *args, words, **kwargs):
    ap = Applied(op, *args, **kwargs)
    with pytest.raises(UnsupportedSpec) as e:
        ap.value()
    assert e.value.op == f"aten.{aten_name(ap.node)}" and words in e.value.reason
    return e.value


def _ids(cases):
    return [f"{c[0].__name__}-{i}" for i, c in enumerate(cases)]


g = torch.Generator().manual_seed(0)
X = torch.randn(2, 3, 4, generator=g)
Y = torch.randn(2, 3, 4, generator=g)
ROW = torch.randn(4, generator=g)
ONE = torch.randn(2, 1, 4, generator=g)

# -- layout: views change which atoms index a tensor, never its values --------------------------
LAYOUT = [
    (aten.view.default, X, [6, 4]), (aten.view.default, X, [2, 12]), (aten.reshape.default, X, [6, 2, 2]),
    (aten._unsafe_view.default, X, [2, 3, 2, 2]), (aten.permute.default, X, [2, 0, 1]),
    (aten.transpose.int, X, 0, -1), (aten.t.default, X[0]), (aten.unsqueeze.default, X, 1),
    (aten.squeeze.dim, ONE, 1), (aten.squeeze.default, ONE), (aten.expand.default, ONE, [2, 5, 4]),
    (aten.expand.default, ROW, [3, -1]), (aten.repeat.default, X, [2, 1, 3]), (aten.repeat.default, ONE, [1, 3, 1]),
    (aten.slice.Tensor, X, 2, 1, 4), (aten.slice.Tensor, X, -1, 0, None, 2), (aten.slice.Tensor, X, 1, -2),
    (aten.select.int, X, 1, -1), (aten.select.int, X, 0, 1),
]


@pytest.mark.parametrize("case", LAYOUT, ids=_ids(LAYOUT))
def test_layout_rules_keep_the_values(case):
    same(*case)


def test_a_view_that_splits_a_dim_unevenly_is_refused():
    refused(aten.view.default, torch.randn(6, 5), [5, 6], words="mixes dims")


# -- pointwise: values combine by broadcasting ---------------------------------------------------
POS = X.abs() + 0.5
POINTWISE = [
    (aten.add.Tensor, X, Y), (aten.add.Tensor, X, ROW, {"alpha": 3}), (aten.sub.Tensor, X, 2.5),
    (aten.rsub.Scalar, X, 1.0), (aten.mul.Tensor, X, ONE), (aten.div.Tensor, X, POS),
    (aten.div.Tensor_mode, X, POS, {"rounding_mode": "floor"}), (aten.pow.Tensor_Scalar, POS, 1.5),
    (aten.maximum.default, X, Y), (aten.remainder.Scalar, X, 0.7), (aten.gt.Tensor, X, Y), (aten.eq.Scalar, X, 0.0),
    (aten.logical_and.default, X > 0, Y > 0), (aten.bitwise_not.default, X > 0),
    (aten.exp.default, X), (aten.tanh.default, X), (aten.log.default, POS), (aten.rsqrt.default, POS),
    (aten.sigmoid.default, X), (aten.sign.default, X), (aten.exp2.default, X), (aten.log1p.default, POS),
    (aten.where.self, X > 0, X, Y), (aten.masked_fill.Scalar, X, Y > 0, -1e4),
    (aten.clamp.default, X, -0.5, 0.5), (aten.clamp.default, X, None, 0.1), (aten.clone.default, X),
    (aten._to_copy.default, X, {"dtype": torch.int64}), (aten._to_copy.default, X > 0, {"dtype": torch.float32}),
    (aten.dropout.default, X, 0.5, False), (aten.log_sigmoid_forward.default, X * 30),
    (aten.nan_to_num.default, X.log()), (aten.nan_to_num.default, X / 0, 0.5, 7.0, -7.0),
    (aten.add_.Tensor, X.clone(), Y),
]


def _with_kwargs(case):
    """(op, *args) or (op, *args, {kwargs})"""
    return (case[:-1], case[-1]) if isinstance(case[-1], dict) else (case, {})


@pytest.mark.parametrize("case", POINTWISE, ids=_ids(POINTWISE))
def test_pointwise_rules_match_the_op_in_float64(case):
    args, kw = _with_kwargs(case)
    same(*args, **kw)


@pytest.mark.parametrize("op, args, kw, words", [
    (aten.div.Tensor_mode, (X, POS), {"rounding_mode": "trunc"}, "truncating division"),
    (aten.dropout.default, (X, 0.5, True), {}, "dropout in training mode is random"),
])
def test_pointwise_refusals(op, args, kw, words):
    refused(op, *args, **kw, words=words)


# -- factories: tensors made from their shape and indices ---------------------------------------
FACTORIES = [
    (aten.full.default, [3, 1, 4], 2.5), (aten.ones.default, [2, 3]), (aten.zeros_like.default, X),
    (aten.full_like.default, X, 7), (aten.new_full.default, X, [3], -1.0), (aten.scalar_tensor.default, 1.25),
    (aten.arange.default, 6), (aten.arange.start_step, 2, 11, 3), (aten.arange.start, 1, 5, {"dtype": torch.float32}),
    (aten.triu.default, torch.randn(2, 5, 5)), (aten.tril.default, torch.randn(4, 6), -1),
    (aten.triu.default, torch.ones(4, 6, dtype=torch.bool), 2), (aten.diag_embed.default, torch.randn(2, 3)),
]


@pytest.mark.parametrize("case", FACTORIES, ids=_ids(FACTORIES))
def test_factory_rules_make_the_same_tensor(case):
    args, kw = _with_kwargs(case)
    same(*args, **kw)


def test_uninitialised_memory_is_refused():
    refused(aten.empty.memory_format, [2, 3], words="uninitialised memory")
    refused(aten.diag_embed.default, torch.randn(2, 3), offset=1, words="offset")


# -- gathers: a load through index expressions --------------------------------------------------
TABLE = torch.randn(7, 5, generator=g)
IDS = torch.tensor([[0, 6, 3], [2, 2, 5]])


@pytest.mark.parametrize("op, args", [
    (aten.index.Tensor, (TABLE, [IDS])), (aten.index.Tensor, (TABLE, [None, IDS % 5])),
    (aten.index.Tensor, (TABLE, [IDS, IDS % 5])), (aten.index_select.default, (TABLE, 1, IDS[0] % 5)),
    (aten.index_select.default, (TABLE, -2, IDS[1])), (aten.embedding.default, (TABLE, IDS)),
])
def test_gather_rules_read_through_the_indices(op, args):
    same(op, *args)


def test_gathering_from_a_computed_tensor_is_refused():
    ap = Applied(aten.index.Tensor, TABLE, [IDS])
    ap.walker.env[ap.node.args[0]] = Sym(((ap.ctx.atom(7),), (ap.ctx.atom(5),)), None, torch.float32, "probs")
    with pytest.raises(UnsupportedSpec, match="only inputs can be gathered"):
        ap.value()


# -- contractions: the first matmul of two call tensors is q.k --------------------------------
Q, K, BIAS = torch.randn(3, 5, 4, generator=g), torch.randn(3, 6, 4, generator=g), torch.randn(3, 5, 6, generator=g)


@pytest.mark.parametrize("op, args, kw", [
    (aten.bmm.default, (Q, K.transpose(1, 2)), {}),
    (aten.baddbmm.default, (BIAS, Q, K.transpose(1, 2)), {"beta": 0.5, "alpha": 0.25}),
    (aten.baddbmm.default, (BIAS, Q, K.transpose(1, 2)), {"beta": 0}),
])
def test_contraction_rules_find_the_score(op, args, kw):
    ap = Applied(op, *args, **kw)
    x = ap.value()
    assert ap.ctx.facts["score"]["q"].attr != ap.ctx.facts["score"]["k"].attr
    assert sorted(ap.ctx.roles.values()) == ["batch", "d", "kv", "q"]
    s = torch.bmm(Q.double(), K.double().transpose(1, 2))  # the score variable "s" is q.k itself
    assert torch.allclose(ap.numbers(x, s=s), ap.expected, rtol=1e-12, atol=1e-12)


def test_a_matmul_of_values_off_the_call_is_not_the_score():
    ap = Applied(aten.bmm.default, Q, K.transpose(1, 2))
    ap.walker.from_call.clear()  # as if both operands were computed by the function
    with pytest.raises(UnsupportedSpec, match="off the score path"):
        ap.value()


# -- reductions and the softmax written by hand: through the smallest captured attention -------
def walk(fn, *args):
    """fn captured and walked with no prologue: (its value, the walk's facts)."""
    cap = capture(fn, bind_example(fn, args, {}))
    ctx = Ctx()
    names = [p.replace(".", "_") for p in cap.tensor_paths]
    walker = Walker(ctx, {n: input_sym(ctx, n, cap.example[p]) for n, p in zip(names, cap.tensor_paths)})
    return walker.run(cap.graph, names, {}), ctx


def softmax_lib(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v


def softmax_by_hand(q, k, v):
    s = q @ k.transpose(-1, -2) * 0.5
    e = (s - s.amax(-1, keepdim=True)).exp()
    return (e / e.sum(-1, keepdim=True)) @ v


def softmax_by_max(q, k, v):
    s = q @ k.transpose(-1, -2)
    e = torch.exp(s - s.max(dim=-1, keepdim=True).values)
    return e / e.sum(-1, keepdim=True) @ v


def log_softmax_exp(q, k, v):
    return F.log_softmax(q @ k.transpose(-1, -2), dim=-1).exp() @ v


def logsumexp_shift(q, k, v):
    s = q @ k.transpose(-1, -2)
    return (s - torch.logsumexp(s, -1, keepdim=True)).exp() @ v


def probs_zeroed_rows(q, k, v, pad):
    p = torch.softmax(q @ k.transpose(-1, -2), dim=-1)
    return p.masked_fill(pad, 0.0) @ v


def _minus_lse_of_twice(s):
    return torch.exp(s - torch.logsumexp(s * 2, -1, keepdim=True))


QKV = tuple(torch.randn(1, 2, 5, 4, generator=g) for _ in range(3))
PAD = torch.tensor([True, False, False, True, False]).view(1, 1, 5, 1)  # query rows zeroed


@pytest.mark.parametrize("fn", [softmax_lib, softmax_by_hand, softmax_by_max, log_softmax_exp, logsumexp_shift,
                                probs_zeroed_rows])
def test_softmax_rules_find_the_attention(fn):
    args = QKV + (PAD,) if fn is probs_zeroed_rows else QKV
    out, ctx = walk(fn, *args)
    assert out.kind == "attn" and ctx.facts["output"]["probs"].kind == "probs"
    cap = capture(fn, bind_example(fn, args, {}))
    args = tuple(_double(t) for t in args)
    assert rel_err(symbolic_transfer(cap, prologue=False).run(*args), fn(*args)) < 1e-6


@pytest.mark.parametrize("op, args, kind", [
    (aten.logsumexp.default, (X, [-1], True), "rowlse"), (aten.logsumexp.default, (X, [-1]), "rowlse"),
    (aten.amax.default, (X, [-1], True), "rowmax"), (aten.max.dim, (X, -1, True), "rowmax"),
])
def test_row_reductions_have_the_ops_shape(op, args, kind):
    """A row max or logsumexp is a piece of a softmax to come (its value is the normaliser's), of the op's shape."""
    ap = Applied(op, *args)
    x, want = ap.value(), ap.expected
    x, want = (x[0], want[0]) if isinstance(want, tuple) else (x, want)
    assert x.kind == kind and x.expr is None and ap.ctx.shape(x) == tuple(want.shape)


@pytest.mark.parametrize("fn, op, words", [
    (lambda q, k, v: torch.softmax(q @ k.transpose(-1, -2), dim=-2) @ v, "aten._softmax", "key axis"),
    (lambda q, k, v: torch.softmax(q, dim=-1) @ v.transpose(-1, -2), "aten._softmax", "not derived from q.k"),
    (lambda q, k, v: (q @ k.transpose(-1, -2)).amax(-2) @ v, "aten.amax", "row max"),
    (lambda q, k, v: (q @ k.transpose(-1, -2)).sum(-1), "aten.sum", "softmax normaliser"),
    (lambda q, k, v: (q @ k.transpose(-1, -2)).sum(), "aten.sum", "no symbolic rule"),
    (lambda q, k, v: _minus_lse_of_twice(q @ k.transpose(-1, -2)), "aten.sub", "logsumexp of another tensor"),
])
def test_reductions_off_the_softmax_row_are_refused(fn, op, words):
    with pytest.raises(UnsupportedSpec) as e:
        walk(fn, *QKV)
    assert e.value.op == op and words in e.value.reason and e.value.node


# -- refusals and the table itself ---------------------------------------------------------------
@pytest.mark.parametrize("op, args, words", [
    (aten.topk.default, (X, 2), "selection by value"), (aten.sort.default, (X,), "selection by value"),
    (aten.rand_like.default, (X,), "random numbers"),
])
def test_ops_refused_with_their_own_reason(op, args, words):
    refused(op, *args, words=words)


def test_an_op_with_no_rule_is_refused_as_before():
    """No rule for cumsum: the walk refuses it naming the op and the node (the message the if-chain gave)."""
    assert "cumsum" not in RULES
    e = refused(aten.cumsum.default, X, 1, words="no symbolic rule for this op")
    assert str(e) == "aten.cumsum: no symbolic rule for this op"

    def cumulative(q, k, v):
        return torch.softmax((q @ k.transpose(-1, -2)).cumsum(-1), dim=-1) @ v
    with pytest.raises(UnsupportedSpec) as e:
        symbolic_transfer(capture(cumulative, bind_example(cumulative, QKV, {})), prologue=False)
    assert str(e.value) == "aten.cumsum: no symbolic rule for this op" and e.value.node == "cumsum"


def test_an_op_has_one_rule():
    with pytest.raises(ValueError, match="two symbolic rules for aten.permute"):
        rule("permute")(lambda c: None)
    assert RULES["permute"].__name__ == "permute"


def test_an_in_place_op_takes_its_out_of_place_rule():
    node = torch.fx.Graph().call_function(aten.mul_.Tensor, ())
    assert aten_name(node) == "mul" and RULES["mul"] is RULES["add"]
