"""Pass: turn the analysed graph (roles, loads, symbolic output) into CuIR."""
from __future__ import annotations

from typing import Any

import torch

from ..errors import UnsupportedSpec
from ..ir.expr import Expr, const, rewrite, walk
from ..ir.program import ExtraTensor, Operand, Output
from .symbolic.simplify import simplify
from .symbolic.sym import Ctx, Sym

_CANON = {"b": "b", "h": "h", "q": "q", "kv": "kv"}


def _var(e: Expr) -> str | None:
    return e.attr if e.op == "var" else None


def _pick_output(result: Any) -> tuple[Sym, int, int]:
    if isinstance(result, Sym):
        if result.kind != "attn":
            raise UnsupportedSpec("the function does not return softmax(q.k^T ...) @ v", op="output")
        return result, 0, 0
    if isinstance(result, (tuple, list)):
        idx = [i for i, r in enumerate(result) if isinstance(r, Sym) and r.kind == "attn"]
        if len(idx) != 1:
            raise UnsupportedSpec("the function does not return one attention output", op="output")
        for i, r in enumerate(result):
            if i != idx[0] and not (r is None or (isinstance(r, Sym) and r.kind == "probs")):
                raise UnsupportedSpec("a returned value other than the output and the attention weights", op="output")
        return result[idx[0]], len(result), idx[0]
    raise UnsupportedSpec("the function does not return a tensor", op="output")


def _operand(ctx: Ctx, ld: Expr, name: str, paths: dict[str, str]) -> tuple[Operand, list[Expr]]:
    dims = []
    heads: list[Expr] = []
    rank = len(ld.args)
    for i, ix in enumerate(ld.args):
        role = ctx.roles.get(_var(ix) or "", None)
        if role in ("q", "kv"):
            dims.append("s")
        elif role in ("d", "dv"):
            dims.append("d")
        else:
            dims.append(None)
            heads.append(ix)
    free = ["b", "h"] if rank == 4 else ["h"]
    if dims.count(None) != len(free) or dims.count("s") != 1 or dims.count("d") != 1:
        raise UnsupportedSpec(f"{name} is not a [batch, heads, seq, dim] tensor in any order", op=name)
    it = iter(free)
    dims = [d if d is not None else next(it) for d in dims]
    return Operand(paths[ld.attr], tuple(dims)), heads


def assemble(ctx: Ctx, result: Any, paths: dict[str, str], q_dtype: torch.dtype,
             signature: tuple[str, ...], consts: dict[str, torch.Tensor]) -> dict[str, Any]:
    out, tuple_len, index = _pick_output(result)
    if "output" not in ctx.facts:
        raise UnsupportedSpec("no softmax(...) @ v found", op="output")
    qld, kld = ctx.facts["score"]["q"], ctx.facts["score"]["k"]
    vld = ctx.facts["output"]["v"]
    probs: Sym = ctx.facts["output"]["probs"]
    q, qb = _operand(ctx, qld, "query", paths)
    # batch roles from the query's own dim order: [b, h] or [h]
    names = ["b", "h"] if len(qb) == 2 else ["h"]
    for ix, nm in zip(qb, names):
        if _var(ix):
            ctx.roles[_var(ix)] = nm
    k, kb = _operand(ctx, kld, "key", paths)
    v, vb = _operand(ctx, vld, "value", paths)
    head_map = _head_map(ctx, qb, kb, "key")
    if _head_map(ctx, qb, vb, "value") != head_map:
        raise UnsupportedSpec("key and value map query heads differently", op="value")

    def canon(e: Expr | None, what: str) -> Expr | None:
        if e is None:
            return None

        def r(n: Expr) -> Expr | None:
            if n.op == "var" and n.attr != "s":
                role = ctx.roles.get(n.attr)
                if role in _CANON:
                    return Expr("var", (), _CANON[role])
                if ctx.sizes.get(n.attr) == 1:
                    return const(0)
                raise UnsupportedSpec(f"the {what} depends on an axis that is not batch, head, query or key", op=what)
            return None
        return simplify(rewrite(e, r), {})

    score = canon(probs.payload["score"].expr, "score")
    sink = canon(probs.payload.get("sink"), "sink")
    used = {n.attr for e in (score, sink) if e is not None for n in walk(e) if n.op == "load"}
    extras = []
    for t in sorted(used):
        val = ctx.facts["inputs"][t]
        path = paths.get(t)
        extras.append(ExtraTensor(name=t, dtype=str(val.dtype).replace("torch.", ""), rank=val.dim(),
                                  arg=path, value=None if path else consts[t].tolist()))
    odims = []
    for d in out.axes:
        rs = [ctx.roles.get(a) for a in d]
        if not d:
            odims.append(None)
            continue
        nm = "*".join({"q": "s", "dv": "d", "b": "b", "h": "h"}.get(r or "", "?") for r in rs)
        if "?" in nm:
            raise UnsupportedSpec("the output mixes in an axis that is not batch, head, query or dim", op="output")
        odims.append(nm)
    missing = [x for x in ["b", "h", "s", "d"][(0 if len(qb) == 2 else 1):] if not any(x in (o or "").split("*") for o in odims)]
    odims = [o if o is not None else missing.pop(0) for o in odims]
    dt = "q" if out.dtype == q_dtype else str(out.dtype).replace("torch.", "")
    return dict(signature=signature, q=q, k=k, v=v, score=score, sink=sink, head_map=head_map,
                extras=tuple(extras), out=Output(tuple(odims), dt, tuple_len, index))


def _head_map(ctx: Ctx, qb: list[Expr], kb: list[Expr], name: str) -> str:
    for qi, ki in zip(qb, kb):
        qv = _var(qi)
        role = ctx.roles.get(qv or "")
        if ki == qi or ki == const(0):
            continue
        if role == "h" and ki.op in ("floordiv", "mod") and ki.args[0] == qi and ki.args[1].op == "const":
            return "group" if ki.op == "floordiv" else "tile"
        raise UnsupportedSpec(f"{name} is indexed by an unsupported head/batch expression {ki}", op=name)
    return "group"
