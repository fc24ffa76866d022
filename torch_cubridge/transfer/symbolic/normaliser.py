"""The softmax and its normaliser in the captured graph: softmax itself, the hand-written max, shift, exp,
sum and divide, a sink logit as an extra score column or as sigmoid(logsumexp - c) on the output, and factors
per query row on the probabilities (which move to the output).

A mixin of the graph walker (graph.Walker), which provides ctx and calls these where the aten ops are.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from ...errors import UnsupportedSpec
from ...ir.expr import Expr, call, const, rewrite, walk
from .elementwise import broadcast
from .simplify import simplify
from .sym import Sym


class NormaliserPath:
    """What graph.Walker provides: ctx."""

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


def _has_s(x: Sym) -> bool:
    return x.expr is not None and any(n.op == "var" and n.attr == "s" for n in walk(x.expr))
