"""Walk the captured aten graph, giving every node a symbolic value.

The walk knows the *algebra* of ops (views, broadcasting, contractions,
reductions, softmax), not a list of attention idioms: masks, biases, scales
and head grouping fall out of how values combine.
"""
from __future__ import annotations

import math
import operator
from typing import Any

import torch
from torch.fx import Node

from ...errors import UnsupportedSpec
from ...ir.expr import Expr, call, const, rewrite, walk
from ..prologue import Prologue
from . import views
from .contract import contract, unit_key_output
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


class Walker(OffScorePath):
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

    # -- structure ---------------------------------------------------------
    def softmax(self, x: Sym, dim: int, dtype: torch.dtype, op: str) -> Sym:
        if dim not in (-1, len(x.axes) - 1):
            raise UnsupportedSpec("softmax must run over the key axis (the last dim)", op=op)
        if x.kind == "shifted":
            x = x.payload["of"]
        sink = None
        if x.kind == "catsink":
            sink = x.payload["sink"]
            x = x.payload["score"]
        if x.kind != "value" or "score" not in self.ctx.facts:
            raise UnsupportedSpec("softmax of a value that is not derived from q.k", op=op)
        x = self._unit_key_last(x)
        if self.ctx.roles.get(x.axes[-1][0] if len(x.axes[-1]) == 1 else "", "") != "kv":
            raise UnsupportedSpec("softmax must run over the key axis", op=op)
        return Sym(x.axes if sink is None else x.axes[:-1] + (x.payload.get("full_kv", x.axes[-1]),),
                   None, dtype, "probs", {"score": x, "sink": sink, "sink_col": sink is not None})

    def _unit_key_last(self, x: Sym) -> Sym:
        """x with its key atom in the last dim where both are size 1 (Sq = Skv = 1 through einsum, whose
        views of unit dims the walk aligns by position and may leave the key atom elsewhere): permuting
        size-1 dims changes no value, and a softmax over one element is the same over either."""
        unit = lambda ax: all(self.ctx.sizes.get(a) == 1 for a in ax)  # noqa: E731
        if not unit(x.axes[-1]) or self.ctx.roles.get(x.axes[-1][0] if len(x.axes[-1]) == 1 else "") == "kv":
            return x
        at = [i for i, ax in enumerate(x.axes[:-1]) if len(ax) == 1 and self.ctx.roles.get(ax[0]) == "kv" and unit(ax)]
        if not at:
            return x
        axes = list(x.axes)
        axes[at[0]], axes[-1] = axes[-1], axes[at[0]]
        return Sym(tuple(axes), x.expr, x.dtype, x.kind, x.payload)

    def lse_minus(self, lse: Sym, c: Sym, op: str) -> Sym:
        """logsumexp(score) - c, c constant along the row (a sink logit, as granite_swa writes one)."""
        axes, (_, e) = broadcast(self.ctx, [Sym(lse.axes, const(0.0), lse.dtype), c], op)
        if tuple(axes) != tuple(lse.axes):
            raise UnsupportedSpec("a logsumexp minus a value with more axes than its rows", op=op)
        return Sym(lse.axes, None, lse.dtype, "lse_minus", {"of": lse.payload["of"], "c": e})

    def sink_from_scale(self, attn: Sym, scale: Sym, op: str) -> Sym:
        """softmax(x) V * sigmoid(lse(x) - c) = sum e^x V / (sum e^x + e^c): c is a sink logit joining the
        normaliser (the kernel's sink hook). The scale must be of the score the softmax normalised."""
        probs: Sym = self.ctx.facts["output"]["probs"]
        score, of, c = probs.payload["score"], scale.payload["of"], scale.payload["c"]
        if probs.payload.get("sink") is not None or of.axes != score.axes or of.expr != score.expr:
            raise UnsupportedSpec("the output scaled by sigmoid(logsumexp - c) of another score", op=op)
        if len(scale.axes) != len(attn.axes) or scale.axes[-1] != () or tuple(scale.axes[:-1]) != tuple(attn.axes[:-1]):
            raise UnsupportedSpec("sigmoid(logsumexp - c) not laid along the output's rows", op=op)
        self._check_sink(c, op)
        self.ctx.facts["output"]["probs"] = Sym(probs.axes, None, probs.dtype, "probs", {**probs.payload, "sink": c})
        return attn

    def row_scaled(self, p: Sym, f: Sym, op: str) -> Sym:
        """The probabilities times a factor that is constant along the key axis: (f P) V = f (P V), so
        the factor moves to the output (Program.row_scale). A factor that varies along the keys would
        change the weights the softmax gave, and is refused."""
        axes, (_, e) = broadcast(self.ctx, [Sym(p.axes, const(0.0), p.dtype), f], op)
        kv = set(p.axes[-1])
        if tuple(axes) == tuple(p.axes) and self._zeroes_masked_keys(p, e):
            return p
        if tuple(axes) != tuple(p.axes) or any(n.op == "var" and n.attr in kv for n in walk(e)):
            raise UnsupportedSpec("the probabilities are scaled or masked along the key axis after the softmax "
                                  "(only a factor per query row moves to the output)", op=op)
        old = p.payload.get("row_scale")
        new = e if old is None else call("mul", old, e)
        return Sym(p.axes, None, p.dtype, "probs", {**p.payload, "row_scale": simplify(new, self.ctx.ranges())})

    def _zeroes_masked_keys(self, p: Sym, f: Expr) -> bool:
        """f is 0 exactly where the score was filled with -inf before the softmax, 1 elsewhere (cpmant:
        `probs.masked_fill(~mask, 0)` after `scores.masked_fill(~mask, -inf)`): the weights are already 0
        there, so only a row with every key masked changes, from NaN to 0, which is the kernel's empty
        row. Conditions are compared as written, with one-element constants read as their values."""
        while f.op == "to_float":
            f = f.args[0]
        if f.op == "where" and f.args[1] == const(0.0) and f.args[2] == const(1.0):
            f = call("not", f.args[0])
        elif f.op == "where" and f.args[1] == const(1.0) and f.args[2] == const(0.0):
            f = f.args[0]
        zero_where = self._norm(call("not", f))
        e = p.payload["score"].expr
        while e.op == "where":
            c, x, y = e.args
            if x == const(-math.inf) and self._norm(c) == zero_where:
                return True
            if y == const(-math.inf) and self._norm(call("not", c)) == zero_where:
                return True
            e = y if x == const(-math.inf) else x if y == const(-math.inf) else const(0.0)
        return False

    def _norm(self, c: Expr) -> Expr:
        """A boolean condition with one-element captured constants as values and negations pushed into
        (in)equalities, for comparing two spellings of one mask."""
        def value(n: Expr) -> Expr:
            t = self.ctx.facts.get("inputs", {}).get(n.attr) if n.op == "load" else None
            if t is not None and n.attr.startswith("const") and t.numel() == 1 and t.device.type != "meta":
                return const(t.item())
            return n
        c = rewrite(c, value)
        flips = {"eq": "ne", "ne": "eq"}
        while c.op == "not":
            inner = c.args[0]
            if inner.op == "not":
                c = inner.args[0]
            elif inner.op in flips:
                c = Expr(flips[inner.op], inner.args, inner.attr)
            else:
                break
        if c.op in ("eq", "ne") and c.args[1] == const(False):  # x != False is x itself (a boolean load)
            return c.args[0] if c.op == "ne" else call("not", c.args[0])
        return c

    def _check_sink(self, sink: Expr, op: str) -> None:
        """A sink logit is one per row: over batch and head (the kernel's sink hook) or the query row too
        (inkling2 projects it from each token), which moves to the output as sigmoid(lse - c)."""
        rows = {a for a, r in self.ctx.roles.items() if r in ("batch", "q")}
        if {n.attr for n in walk(sink) if n.op == "var" and self.ctx.sizes.get(n.attr) != 1} - rows:
            raise UnsupportedSpec("the sink logit may depend only on batch, head and query row", op=op)

    def drop_sink_column(self, x: Sym, dim: int, start: Any, end: Any, op: str) -> Sym:
        score = x.payload["score"]
        n = self.ctx.dim_size(score.axes[-1])
        if dim not in (-1, len(x.axes) - 1) or (start or 0) != 0 or end not in (n, -1):
            raise UnsupportedSpec("slice of the probabilities other than dropping the sink column", op=op)
        return Sym(score.axes, None, x.dtype, "probs", {"score": score, "sink": x.payload["sink"]})

    def cat(self, xs: list[Sym], dim: int, op: str) -> Sym:
        if len(xs) != 2 or dim not in (-1, len(xs[0].axes) - 1):
            raise UnsupportedSpec("concatenation other than one sink column on the key axis", op=op)
        score, col = xs
        if self.ctx.dim_size(col.axes[-1]) != 1 or "score" not in self.ctx.facts or not _has_s(score):
            raise UnsupportedSpec("concatenation other than one sink column on the key axis", op=op)
        lead = Sym(col.axes[:-1] + ((),), col.expr, col.dtype)
        axes, exprs = broadcast(self.ctx, [Sym(score.axes[:-1] + ((),), const(0.0), score.dtype), lead], op)
        sink = exprs[1]
        self._check_sink(sink, op)
        full = (self.ctx.atom(self.ctx.dim_size(score.axes[-1]) + 1),)
        return Sym(score.axes[:-1] + (full,), None, score.dtype, "catsink",
                   {"score": score, "sink": sink, "full_kv": full})

    def rowmax(self, x: Sym, dim: Any, op: str) -> Sym:
        d = dim[0] if isinstance(dim, (list, tuple)) and len(dim) == 1 else dim
        if d not in (-1, len(x.axes) - 1) or x.kind not in ("value", "catsink"):
            raise UnsupportedSpec("a reduction other than the softmax row max", op=op)
        return Sym(x.axes[:-1] + ((),), None, x.dtype, "rowmax", {"of": x})

    def shift(self, x: Sym, m: Sym, op: str) -> Sym:
        if m.payload["of"] is not x:
            raise UnsupportedSpec("subtracting a row max of another tensor", op=op)
        return Sym(x.axes, None, x.dtype, "shifted", {"of": x})

    def rowsum(self, x: Sym, dim: Any, op: str) -> Sym:
        d = dim[0] if isinstance(dim, (list, tuple)) and len(dim) == 1 else dim
        if x.kind != "expshift" or d not in (-1, len(x.axes) - 1):
            raise UnsupportedSpec("a sum other than the softmax normaliser", op=op)
        return Sym(x.axes[:-1] + ((),), None, x.dtype, "rowsum", {"of": x.payload["of"]})

    def manual_softmax(self, e: Sym, s: Sym, op: str) -> Sym:
        if e.payload["of"] is not s.payload["of"]:
            raise UnsupportedSpec("normalising by the sum of another row", op=op)
        return self.softmax(Sym(e.axes, None, e.dtype, "shifted", {"of": e.payload["of"]}), -1, e.dtype, op)

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


def _has_s(x: Sym) -> bool:
    return x.expr is not None and any(n.op == "var" and n.attr == "s" for n in walk(x.expr))


def _is_zero(x: Sym) -> bool:
    """A literal zero (a masked_fill or where filling with 0)."""
    return x.kind == "value" and x.expr is not None and x.expr.op == "const" and x.expr.attr == 0
