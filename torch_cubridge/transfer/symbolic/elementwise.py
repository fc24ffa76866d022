"""Elementwise ops: broadcasting by unification, values as CuIR expressions."""
from __future__ import annotations

import math
from typing import Any

import torch

from ...errors import UnsupportedSpec
from ...ir.expr import Expr, call, const, where
from .simplify import simplify
from .sym import Ctx, Sym, unify

# aten packet name -> CuIR op
BINARY = {"add": "add", "sub": "sub", "rsub": "rsub", "mul": "mul", "div": "div", "true_divide": "div",
          "floor_divide": "floordiv", "remainder": "mod", "fmod": "mod", "maximum": "max", "minimum": "min",
          "pow": "pow", "eq": "eq", "ne": "ne", "lt": "lt", "le": "le", "gt": "gt", "ge": "ge",
          "bitwise_and": "and", "logical_and": "and", "bitwise_or": "or", "logical_or": "or",
          "__and__": "and", "__or__": "or"}
UNARY = {"neg": "neg", "tanh": "tanh", "exp": "exp", "log": "log", "abs": "abs", "sqrt": "sqrt",
         "rsqrt": "rsqrt", "sigmoid": "sigmoid", "bitwise_not": "not", "logical_not": "not", "floor": "floor",
         "sin": "sin", "cos": "cos", "exp2": "exp2", "log2": "log2", "log1p": "log1p", "expm1": "expm1",
         "reciprocal": "reciprocal", "sign": "sign"}


def _has_roles(ctx: Ctx, d: tuple[str, ...]) -> bool:
    return any(a in ctx.roles for a in d)


def broadcast(ctx: Ctx, xs: list[Sym], op: str) -> tuple[tuple, list[Expr]]:
    """Common axes for xs and each operand's value rewritten onto them."""
    rank = max(len(x.axes) for x in xs)
    padded = [[()] * (rank - len(x.axes)) + list(x.axes) for x in xs]
    # one atom indexes one output dim: x[:, None] >= x[None, :] needs two atoms
    owner: dict[str, int] = {}
    fresh_xs = []
    for n, (x, p) in enumerate(zip(xs, padded)):
        sub: dict[str, Expr] = {}
        for i, d in enumerate(p):
            nd = []
            for a in d:
                if owner.setdefault(a, i) != i:
                    f = ctx.atom(ctx.sizes[a])
                    owner[f] = i
                    sub[a] = Expr("var", (), f)
                    nd.append(f)
                else:
                    nd.append(a)
            p[i] = tuple(nd)
        fresh_xs.append(ctx.subst(x, sub, op) if sub else x)
    xs = fresh_xs
    out: list[tuple[str, ...]] = []
    for i in range(rank):
        dims = [p[i] for p in padded]
        big = [d for d in dims if ctx.dim_size(d) > 1]
        if not big:  # a broadcast dim of extent 1 has no index unless a role needs one
            roled = [d for d in dims if _has_roles(ctx, d)]
            # or the one operand that has this dim at all (q times a number before q.k at Sq = 1 keeps its
            # query axis); a unit dim two tensors share is a broadcast, and has none
            own = [p[i] for x, p in zip(xs, padded) if i >= rank - len(x.axes)]
            out.append(roled[0] if roled else own[0] if len(own) == 1 else ())
            continue
        out.append(max(big, key=lambda d: (_has_roles(ctx, d), len(d) == 1, len(d))))
    exprs = []
    for x, p in zip(xs, padded):
        sub: dict[str, Expr] = {}
        for d, keep in zip(p, out):
            if ctx.dim_size(d) == 1 and ctx.dim_size(keep) > 1:
                sub.update({a: const(0) for a in d})
            else:
                sub.update(unify(ctx, keep, d, op))
        exprs.append(ctx.subst(x, sub, op).expr)
    return tuple(out), exprs


def lift_scalar(v: Any, like: torch.dtype) -> Sym:
    """A Python number as a constant; anything else (a tensor where a rule expects a number) is refused."""
    if isinstance(v, bool):
        return Sym((), const(v), torch.bool)
    if isinstance(v, int):
        return Sym((), const(v), torch.int64)
    if not isinstance(v, float):
        raise UnsupportedSpec(f"a {type(v).__name__} where a number was expected")
    return Sym((), const(float(v)), torch.float32)


def _scaled_shift(ctx: Ctx, cuir_op: str, xs: list[Sym], out_dtype: torch.dtype, op: str) -> Sym | None:
    """(x - rowmax(x)) * c, or / c, for a constant c > 0 (CogView's overflow guard: scores / a, shifted, times
    a): c*x shifted by c*rowmax(x), a constant along the row, which is also c*x's own row max. The softmax of
    it is softmax(c*x), and the kernel's running max makes the same shift. A c <= 0 or a c that is not a
    constant is left to the refusal below (the spec's exp could overflow where the kernel's does not)."""
    if cuir_op not in ("mul", "div") or len(xs) != 2 or [x.kind for x in xs].count("shifted") != 1:
        return None
    at = 0 if xs[0].kind == "shifted" else 1
    c = xs[1 - at]
    if cuir_op == "div" and at != 0:
        return None
    if c.kind != "value" or c.axes or c.expr is None or c.expr.op != "const" or \
            isinstance(c.expr.attr, bool) or not isinstance(c.expr.attr, (int, float)) or not c.expr.attr > 0:
        return None
    inner = combine(ctx, cuir_op, [xs[at].payload["of"], c] if at == 0 else [c, xs[at].payload["of"]], out_dtype, op)
    return Sym(inner.axes, None, inner.dtype, "shifted", {"of": inner})


_BOOL_ARITH = {"add": "or", "mul": "and", "max": "or", "min": "and"}


def combine(ctx: Ctx, cuir_op: str, xs: list[Sym], out_dtype: torch.dtype, op: str) -> Sym:
    scaled = _scaled_shift(ctx, cuir_op, xs, out_dtype, op)
    if scaled is not None:
        return scaled
    for x in xs:
        if x.kind != "value":
            raise UnsupportedSpec(f"{cuir_op} applied to the {x.kind} (only casts and views may follow softmax)", op=op)
    axes, es = broadcast(ctx, xs, op)
    if cuir_op == "rsub":
        e = call("sub", es[1], es[0])
    elif cuir_op == "div" and not out_dtype.is_floating_point:
        e = call("floordiv", *es)  # aten integer div only reaches here with rounding_mode
    elif cuir_op == "where":
        e = where(*es)
    elif out_dtype == torch.bool and cuir_op in _BOOL_ARITH:
        # torch's + and * of bools are logic (True + True is True); C's would count to 2
        e = call(_BOOL_ARITH[cuir_op], *es)
    else:
        e = call(cuir_op, *es)
    return Sym(axes, simplify(e, ctx.ranges()), out_dtype)


def cast(x: Sym, dtype: torch.dtype) -> Sym:
    if x.kind != "value" or x.expr is None:
        return Sym(x.axes, x.expr, dtype, x.kind, x.payload)
    src, e = x.dtype, x.expr
    if dtype == torch.bool and src != torch.bool:
        e = call("to_bool", e)
    elif dtype.is_floating_point and not src.is_floating_point:
        e = call("to_float", e)
    elif not dtype.is_floating_point and dtype != torch.bool and (src.is_floating_point or src == torch.bool):
        e = call("to_int", e)  # a bool made an integer counts: a - b of two masks is -1, 0 or 1
    return Sym(x.axes, e, dtype)


def is_neg_fill(v: Any) -> bool:
    return isinstance(v, (int, float)) and (v == -math.inf or v <= -1e4)
