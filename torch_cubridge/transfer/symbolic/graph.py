"""Walk the captured aten graph, giving every node a symbolic value.

The walk knows the *algebra* of ops (views, broadcasting, contractions,
reductions, softmax), not a list of attention idioms: masks, biases, scales
and head grouping fall out of how values combine.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
from torch.fx import Node

from ...errors import UnsupportedSpec
from ...ir.expr import Expr, call, const, walk
from ..prologue import Prologue
from . import views
from .contract import contract, unit_key_output
from .normaliser import NormaliserPath
from .offscore import PENDING, OffScorePath, merges_dims
from .elementwise import BINARY, UNARY, broadcast, cast, combine, lift_scalar
from .simplify import simplify
from .sym import Ctx, Sym, input_sym, packet_name  # noqa: F401  (input_sym: the backend's too)

_RANDOM = {"native_dropout", "bernoulli", "rand", "randn", "rand_like", "randn_like", "randint", "normal",
           "uniform", "exponential", "random", "multinomial", "randperm"}
_PASS = {"clone", "contiguous", "alias", "detach", "lift_fresh_copy", "lift_fresh", "dropout",
         "_to_copy", "to", "type_as", "clamp"}


def tensor_name(path: str) -> str:
    return path.replace(".", "_").replace("*", "")


class Walker(OffScorePath, NormaliserPath):
    def __init__(self, ctx: Ctx, inputs: dict[str, Sym], prologue: Prologue | None = None) -> None:
        self.ctx = ctx
        self.env: dict[Node, Any] = {}
        self.inputs = inputs
        self.prologue = prologue          # where values off the score path may go; None: refuse them
        self.on_score: set[Node] = set()  # nodes whose value depends on q.k
        self.from_call: set[Node] = set()  # nodes that read a call argument (placeholders)
        self.not_score: set[str] = set()   # matmuls an earlier walk took for q.k and failed with
        self.held_operand = False  # q.k may have one side the function holds itself (symbolic_transfer)
        self.score_node: str | None = None
        self.split_inputs: set[str] = set()  # arguments whose split views the prologue makes (symbolic_transfer)
        self.boundary: Node | None = None  # the attention output the epilogue starts from (transfer/epilogue.py)

    def arg(self, a: Any) -> Any:
        if isinstance(a, Node):
            return self.env[a]
        if isinstance(a, (list, tuple)):
            return type(a)(self.arg(x) for x in a)
        return a

    def sym(self, a: Any, like: torch.dtype = torch.float32) -> Sym:
        v = self.arg(a)
        if isinstance(v, Sym):
            return v
        if isinstance(v, (int, float, bool)):
            return lift_scalar(v, like)
        raise UnsupportedSpec(f"unexpected operand {v!r}")

    def run(self, gm: torch.fx.GraphModule, placeholders: list[str], consts: dict[str, str]) -> Any:
        for node in gm.graph.nodes:  # randomness anywhere makes the whole function non-deterministic
            name = packet_name(node)
            if name.rstrip("_") in _RANDOM:
                raise UnsupportedSpec("random numbers (dropout in training?) cannot be compiled", op=f"aten.{name}")
        ph = iter(placeholders)
        split_from: set[Node] = set()
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                name = next(ph)
                self.env[node] = self.inputs[name]
                self.from_call.add(node)
                if name in self.split_inputs:
                    split_from.add(node)
            elif node.op == "call_function" and self.split_inputs and self.prologue is not None \
                    and node.args and self._split_source(node.args[0], split_from) \
                    and (merges_dims(node) or packet_name(node) in ("select", "slice")):
                self.env[node] = self.materialize(node)  # the argument's split view, made by the prologue
                self.from_call.add(node)
            elif node.op == "get_attr":
                self.env[node] = self.inputs[consts[node.target]]
            elif node.op == "call_function":
                had_score = "score" in self.ctx.facts
                try:
                    self.env[node] = self.settle(node, self.call(node))
                except UnsupportedSpec as e:  # say which node, so the refusal can point at the user's line
                    e.node = e.node or node.name
                    alt = self.recover(node)
                    if alt is None:
                        at = self._attention_output_read_by(node)
                        if at is None:
                            raise
                        # an op on the finished attention output (o @ W_o, o * g): the rest of the graph
                        # is the epilogue, which PyTorch runs on the kernel's output
                        self.boundary = at
                        return self.env[at]
                    self.env[node] = alt
                ins = node.all_input_nodes
                if (not had_score and "score" in self.ctx.facts) or any(a in self.on_score for a in ins):
                    self.on_score.add(node)
                if any(a in self.from_call for a in ins):
                    self.from_call.add(node)
            elif node.op == "output":
                return self.arg(node.args[0])
        raise UnsupportedSpec("graph has no output")

    def _split_source(self, a: Any, split_from: set[Node]) -> bool:
        """`a` is an argument, or a tensor the prologue made, whose split view the prologue is to make."""
        if a in split_from:
            return True
        v = self.env.get(a) if isinstance(a, Node) else None
        # the tensor itself, or an elementwise function of it (q scaled before its heads are split)
        return isinstance(v, Sym) and v.expr is not None and a not in self.on_score and \
            any(n.op == "load" and n.attr in self.split_inputs for n in walk(v.expr))

    def _attention_output_read_by(self, node: Node) -> Node | None:
        """The one attention output (softmax(...) @ v, as its views) `node` reads, where the epilogue may
        start there (the prologue is on: values off the kernel's path go to PyTorch); else None."""
        if self.prologue is None:
            return None
        outs = [a for a in node.all_input_nodes if isinstance(self.env.get(a), Sym) and self.env[a].kind == "attn"]
        return outs[0] if len(outs) == 1 else None

    def call(self, node: Node) -> Any:
        t = node.target
        if t is operator.getitem:
            x = self.arg(node.args[0])
            if x is PENDING:
                return self.materialize(node)
            return x[node.args[1]]
        name = getattr(getattr(t, "overloadpacket", None), "__name__", str(t))
        name = name.rstrip("_") if name.endswith("_") and name not in ("slice_",) else name
        val = node.meta.get("val")
        dtype = val.dtype if isinstance(val, torch.Tensor) else torch.float32
        op = f"aten.{name}"
        a, kw = node.args, node.kwargs
        ctx = self.ctx
        if name in ("view", "reshape", "_unsafe_view"):
            return views.reshape(ctx, self.sym(a[0]), list(a[1]), op)
        if name == "permute":
            return views.permute(self.sym(a[0]), list(a[1]))
        if name == "transpose":
            return views.transpose(self.sym(a[0]), a[1], a[2])
        if name == "t":
            return views.transpose(self.sym(a[0]), 0, 1)
        if name == "unsqueeze":
            return views.unsqueeze(self.sym(a[0]), a[1])
        if name == "squeeze":
            dims = None if len(a) < 2 else ([a[1]] if isinstance(a[1], int) else list(a[1]))
            return views.squeeze(ctx, self.sym(a[0]), dims, op)
        if name in ("expand", "broadcast_to"):
            return views.expand(ctx, self.sym(a[0]), list(a[1]), op)
        if name == "repeat":
            return self.repeat(self.sym(a[0]), list(a[1]), op)
        if name == "slice":
            x = self.sym(a[0])
            dim, start, end, step = (list(a[1:]) + [0, None, None, 1][len(a) - 1:])[:4]
            if x.kind == "probs" and x.payload.get("sink_col"):
                return self.drop_sink_column(x, dim, start, end, op)
            return views.slice_(ctx, x, dim, start, end, step or 1, op)
        if name == "select":
            return views.select(ctx, self.sym(a[0]), a[1], a[2], op)
        if name in _PASS:
            x = self.sym(a[0])
            if name == "dropout" and len(a) > 2 and a[2] and a[1] > 0:
                raise UnsupportedSpec("dropout in training mode is random", op=op)
            if name == "clamp":
                return self.clamp(x, a[1] if len(a) > 1 else kw.get("min"), a[2] if len(a) > 2 else kw.get("max"), dtype, op)
            return cast(x, dtype)
        if name in ("native_dropout", "bernoulli", "rand", "randn", "rand_like", "randn_like", "randint"):
            raise UnsupportedSpec("random numbers (dropout in training?) cannot be compiled", op=op)
        if name in ("topk", "sort", "argsort", "kthvalue", "nonzero", "masked_select", "unique"):
            raise UnsupportedSpec("selection by value (top-k, sort, nonzero) is not an attention score", op=op)
        if name == "exp" and self.sym(a[0]).kind == "shifted":
            x = self.sym(a[0])
            return Sym(x.axes, None, x.dtype, "expshift", x.payload)
        if name == "exp" and self.sym(a[0]).kind == "logprobs":  # exp(x - logsumexp(x)) is softmax(x)
            x = self.sym(a[0]).payload["of"]
            return self.softmax(x, -1, dtype, op)
        if name == "sigmoid" and self.sym(a[0]).kind == "lse_minus":  # sigmoid(lse - c) = sum e^x / (sum e^x + e^c)
            x = self.sym(a[0])
            return Sym(x.axes, None, dtype, "sinkscale", x.payload)
        if name in UNARY:
            return combine(ctx, UNARY[name], [self.sym(a[0])], dtype, op)
        if name in BINARY:
            xs = [self.sym(x) for x in a[:2]]
            if name == "div" and kw.get("rounding_mode") == "floor":
                return combine(ctx, "floordiv", xs, dtype, op)
            if name == "div" and kw.get("rounding_mode") == "trunc":
                raise UnsupportedSpec("truncating division", op=op)
            alpha = kw.get("alpha", a[2] if len(a) > 2 else 1)
            if name in ("add", "sub") and alpha != 1:
                xs[1] = combine(ctx, "mul", [xs[1], lift_scalar(alpha, dtype)], xs[1].dtype, op)
            if name == "sub" and xs[0].kind in ("value", "catsink") and xs[1].kind == "rowmax":
                return self.shift(xs[0], xs[1], op)
            if name == "sub" and xs[0].kind == "value" and xs[1].kind == "rowlse":
                if xs[1].payload["of"] is not xs[0]:
                    raise UnsupportedSpec("subtracting the logsumexp of another tensor", op=op)
                return Sym(xs[0].axes, None, xs[0].dtype, "logprobs", {"of": xs[0]})
            if name == "div" and xs[0].kind == "expshift" and xs[1].kind == "rowsum":
                return self.manual_softmax(xs[0], xs[1], op)
            if name == "sub" and xs[0].kind == "rowlse" and xs[1].kind == "value":
                return self.lse_minus(xs[0], xs[1], op)
            if name == "mul" and {xs[0].kind, xs[1].kind} == {"attn", "sinkscale"}:
                return self.sink_from_scale(*sorted(xs, key=lambda x: x.kind != "attn"), op=op)
            if name == "mul" and {xs[0].kind, xs[1].kind} == {"probs", "value"}:
                pv = sorted(xs, key=lambda x: x.kind != "probs")
                out = unit_key_output(ctx, pv[0], pv[1], op)
                if out is not None:
                    return out
            if name in ("mul", "div") and xs[0].kind == "probs" and xs[1].kind == "value":
                f = xs[1] if name == "mul" else combine(ctx, "div", [lift_scalar(1.0, dtype), xs[1]], dtype, op)
                return self.row_scaled(xs[0], f, op)
            if name == "mul" and xs[1].kind == "probs" and xs[0].kind == "value":
                return self.row_scaled(xs[1], xs[0], op)
            return combine(ctx, BINARY[name], xs, dtype, op)
        if name == "where":
            c, x, y = (self.sym(t) for t in a[:3])
            if {x.kind, y.kind} == {"probs", "value"} and _is_zero(x if y.kind == "probs" else y):
                keep = c if x.kind == "probs" else combine(ctx, "not", [c], torch.bool, op)
                return self.row_scaled(x if x.kind == "probs" else y, cast(keep, dtype), op)
            return combine(ctx, "where", [c, x, y], dtype, op)
        if name == "nan_to_num":  # nan_to_num(x, nan, posinf, neginf), positionally or by keyword
            fills = {**dict(zip(("nan", "posinf", "neginf"), a[1:])), **kw}
            return self.nan_to_num(self.sym(a[0]), fills.get("nan"), fills.get("posinf"), fills.get("neginf"), dtype, op)
        if name == "masked_fill":
            x, m, v = self.sym(a[0]), self.sym(a[1]), self.sym(a[2])
            if x.kind == "probs" and _is_zero(v):  # rows of probabilities zeroed (Longformer's padded queries)
                return self.row_scaled(x, cast(combine(ctx, "not", [m], torch.bool, op), dtype), op)
            return combine(ctx, "where", [m, v, x], dtype, op)
        if name in ("scalar_tensor", "full", "ones", "zeros", "full_like", "ones_like", "zeros_like",
                    "new_ones", "new_zeros", "new_full", "empty", "empty_like"):
            return self.factory(name, node, dtype, op)
        if name == "arange":
            return self.arange(node, dtype, op)
        if name in ("triu", "tril"):
            return self.tri(name, self.sym(a[0]), a[1] if len(a) > 1 else kw.get("diagonal", 0), dtype, op)
        if name == "diag_embed":  # torch.diag(x) of a vector
            return self.diag_embed(self.sym(a[0]), *(list(a[1:]) + [kw.get("offset", 0), kw.get("dim1", -2),
                                                                       kw.get("dim2", -1)])[:3], dtype=dtype, op=op)
        if name in ("bmm", "mm", "matmul"):
            self.score_candidate(node, op)
            if self.prologue is not None:
                self.make_gathered_operands(node)
            return contract(ctx, self.sym(a[0]), self.sym(a[1]), op)
        if name in ("baddbmm", "addmm"):  # beta * input + alpha * (b1 @ b2)
            self.score_candidate(node, op)
            if self.prologue is not None:
                self.make_gathered_operands(node)
            prod = contract(ctx, self.sym(a[1]), self.sym(a[2]), op)
            alpha, beta = kw.get("alpha", 1), kw.get("beta", 1)
            if alpha != 1:
                prod = combine(ctx, "mul", [prod, lift_scalar(alpha, dtype)], dtype, op)
            if beta == 0:
                return prod
            base = self.sym(a[0])
            if beta != 1:
                base = combine(ctx, "mul", [base, lift_scalar(beta, dtype)], dtype, op)
            return combine(ctx, "add", [prod, base], dtype, op)
        if name == "log_sigmoid_forward":  # min(x, 0) - log(1 + exp(-|x|)), stable for any x
            x = self.sym(a[0])
            neg_abs = combine(ctx, "neg", [combine(ctx, "abs", [x], dtype, op)], dtype, op)
            soft = combine(ctx, "log", [combine(ctx, "add", [lift_scalar(1.0, dtype),
                                                            combine(ctx, "exp", [neg_abs], dtype, op)], dtype, op)],
                           dtype, op)
            return (combine(ctx, "sub", [combine(ctx, "min", [x, lift_scalar(0.0, dtype)], dtype, op), soft],
                            dtype, op), None)
        if name == "logsumexp":
            x = self.sym(a[0])
            m = self.rowmax(x, a[1], op)
            keep = a[2] if len(a) > 2 else kw.get("keepdim", False)
            return Sym(m.axes if keep else m.axes[:-1], None, m.dtype, "rowlse", {"of": x})
        if name == "_log_softmax":
            x = self.sym(a[0])
            self.softmax(x, a[1], dtype, op)  # same checks: over the key axis of a score
            return Sym(x.axes, None, dtype, "logprobs", {"of": x})
        if name in ("_softmax", "softmax", "_safe_softmax"):
            return self.softmax(self.sym(a[0]), a[1], dtype, op)
        if name in ("amax", "max") and len(a) >= 2:
            m = self.rowmax(self.sym(a[0]), a[1], op)
            return (m, None) if name == "max" else m
        if name == "sum" and len(a) >= 2:
            return self.rowsum(self.sym(a[0]), a[1], op)
        if name == "cat":
            return self.cat([self.sym(x) for x in a[0]], a[1] if len(a) > 1 else kw.get("dim", 0), op)
        if name == "index":
            return self.index(self.sym(a[0]), list(a[1]), op)
        if name == "index_select":
            return self.index(self.sym(a[0]), [None] * (a[1] % len(self.sym(a[0]).axes)) + [a[2]], op)
        if name == "embedding":
            return self.index(self.sym(a[0]), [a[1]], op)
        raise UnsupportedSpec("no symbolic rule for this op", op=op)

    def score_candidate(self, node: Node, op: str) -> None:
        """Refuse `node` as q.k where it cannot be (may_be_score), so that the prologue takes it; a
        walk that took the wrong matmul for q.k is run again without it (symbolic_backend)."""
        if "score" in self.ctx.facts:
            return
        if not self.may_be_score(node):
            raise UnsupportedSpec("a matmul of values off the score path", op=op)
        self.score_node = node.name
        if self.held_operand and self.prologue is not None:
            self.make_held_operand(node)

    def nan_to_num(self, x: Sym, nan: Any, posinf: Any, neginf: Any, dtype: torch.dtype, op: str) -> Sym:
        """torch.nan_to_num: NaN to `nan` (0), +-inf to `posinf`/`neginf` (the dtype's largest finite values)."""
        big = torch.finfo(dtype).max if dtype.is_floating_point else 0

        def put(hit: Sym, val: Any, x: Sym) -> Sym:
            return combine(self.ctx, "where", [hit, lift_scalar(val, dtype), x], dtype, op)
        x = put(combine(self.ctx, "ne", [x, x], torch.bool, op), 0.0 if nan is None else nan, x)  # only NaN != NaN
        for inf, fill, default in ((float("inf"), posinf, big), (float("-inf"), neginf, -big)):
            x = put(combine(self.ctx, "eq", [x, lift_scalar(inf, dtype)], torch.bool, op),
                    default if fill is None else fill, x)
        return x

    def clamp(self, x: Sym, lo: Any, hi: Any, dtype: torch.dtype, op: str) -> Sym:
        if lo is not None:
            x = combine(self.ctx, "max", [x, lift_scalar(lo, dtype)], dtype, op)
        if hi is not None:
            x = combine(self.ctx, "min", [x, lift_scalar(hi, dtype)], dtype, op)
        return x

    # -- tensors made from indices ------------------------------------------
    def factory(self, name: str, node: Node, dtype: torch.dtype, op: str) -> Sym:
        a = node.args
        val = node.meta["val"]
        if name == "scalar_tensor":
            fill = a[0]
        elif name in ("full", "new_full", "full_like"):
            fill = a[-1] if name != "full_like" else a[1]
        elif name in ("ones", "ones_like", "new_ones"):
            fill = 1
        elif name in ("zeros", "zeros_like", "new_zeros"):
            fill = 0
        else:
            raise UnsupportedSpec("uninitialised memory", op=op)
        v = bool(fill) if dtype == torch.bool else (float(fill) if dtype.is_floating_point else int(fill))
        return Sym(tuple((self.ctx.atom(n),) if n > 1 else () for n in val.shape), const(v), dtype)

    def arange(self, node: Node, dtype: torch.dtype, op: str) -> Sym:
        a = list(node.args)
        start, end, step = (0, a[0], 1) if len(a) == 1 else (a + [1])[:3]
        n = node.meta["val"].shape[0]
        at = self.ctx.atom(n)
        e: Expr = Expr("var", (), at)
        if step != 1:
            e = call("mul", e, const(step))
        if start:
            e = call("add", e, const(start))
        if dtype.is_floating_point:
            e = call("to_float", e)
        return Sym(((at,),), e, dtype)

    def tri(self, name: str, x: Sym, diag: int, dtype: torch.dtype, op: str) -> Sym:
        r, c = x.axes[-2], x.axes[-1]
        row = self.ctx.linear(r)
        col = self.ctx.linear(c)
        off = call("sub", col, row)
        keep = call("ge", off, const(diag)) if name == "triu" else call("le", off, const(diag))
        zero = const(False) if dtype == torch.bool else const(0 if not dtype.is_floating_point else 0.0)
        return Sym(x.axes, simplify(call("where", keep, x.expr, zero), self.ctx.ranges()), dtype)

    def diag_embed(self, x: Sym, offset: int, dim1: int, dim2: int, dtype: torch.dtype, op: str) -> Sym:
        """out[..., i, j] = x[..., i] where j - i == offset, else 0 (the last two dims, square)."""
        if (dim1, dim2) not in ((-2, -1), (len(x.axes) - 1, len(x.axes))) or not x.axes:
            raise UnsupportedSpec("diag_embed into other than the last two dims", op=op)
        row = x.axes[-1]
        n = self.ctx.dim_size(row)
        col = self.ctx.atom(n + abs(offset))
        if offset:  # the output is larger than x: its rows need their own atom too
            raise UnsupportedSpec("diag_embed with an offset", op=op)
        on = call("eq", Expr("var", (), col), self.ctx.linear(row))
        zero = const(False) if dtype == torch.bool else const(0 if not dtype.is_floating_point else 0.0)
        return Sym(x.axes + ((col,),), simplify(call("where", on, x.expr, zero), self.ctx.ranges()), dtype)

    def repeat(self, x: Sym, reps: list[int], op: str) -> Sym:
        axes = [()] * (len(reps) - len(x.axes)) + list(x.axes)
        out, sub = [], {}
        for d, r in zip(axes, reps):
            if r == 1:
                out.append(d)
                continue
            g = self.ctx.atom(r)
            if self.ctx.dim_size(d) == 1:
                sub.update({a: const(0) for a in d})
                out.append((g,))
            else:
                out.append((g,) + d)  # copies are outermost: index = g * n + i
        y = self.ctx.subst(x, sub, op)
        return Sym(tuple(out), y.expr, x.dtype, x.kind, x.payload)

    def index(self, x: Sym, indices: list[Any], op: str) -> Sym:
        """x[i0, i1, ...] with tensor indices: a load through index expressions."""
        if x.kind != "value" or x.expr is None or x.expr.op != "load":
            raise UnsupportedSpec("indexing a computed tensor (only inputs can be gathered)", op=op)
        idx_syms = [None if i is None else self.sym(i) for i in indices]
        used = [s for s in idx_syms if s is not None]
        axes, exprs = broadcast(self.ctx, used, op)
        it = iter(exprs)
        sub: dict[str, Expr] = {}
        rest: list[tuple[str, ...]] = []
        for i, d in enumerate(x.axes):
            s = idx_syms[i] if i < len(idx_syms) else None
            if s is None:
                rest.append(d)
            else:
                sub.update(self.ctx.decompose(next(it), d))
        y = self.ctx.subst(x, sub, op)
        first = next(i for i, s in enumerate(idx_syms) if s is not None)
        contiguous = all(s is not None for s in idx_syms[first:first + len(used)])
        out = rest[:first] + list(axes) + rest[first:] if contiguous else list(axes) + rest
        return Sym(tuple(out), y.expr, x.dtype)


def _is_zero(x: Sym) -> bool:
    """A literal zero (a masked_fill or where filling with 0)."""
    return x.kind == "value" and x.expr is not None and x.expr.op == "const" and x.expr.attr == 0
