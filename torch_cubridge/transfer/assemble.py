"""Pass: turn the analysed graph (roles, loads, symbolic output) into CuIR."""
from __future__ import annotations

from typing import Any

import torch

from ..errors import OutputLayoutRefused, SplitLayoutRefused, UnsupportedSpec
from ..ir.expr import Expr, call, const, rewrite, substitute, var, walk
from ..ir.program import ExtraTensor, Operand, Output
from .symbolic.contract import packs_axes
from .symbolic.simplify import simplify
from .symbolic.sym import Ctx, Sym

_CANON = {"b": "b", "h": "h", "q": "q", "kv": "kv"}
_OUT_DIM = {"q": "s", "dv": "d", "b": "b", "h": "h"}


def _var(e: Expr) -> str | None:
    return e.attr if e.op == "var" else None


def _pick_output(result: Any) -> tuple[Sym, int, int, Sym | None, int]:
    """(the attention output, the tuple's length (0: a tensor), its index, the rows' log-sum-exp where
    the tuple holds one, its index)."""
    if isinstance(result, Sym):
        if result.kind != "attn":
            raise UnsupportedSpec("the function does not return softmax(q.k^T ...) @ v", op="output")
        return result, 0, 0, None, -1
    if isinstance(result, (tuple, list)):
        idx = [i for i, r in enumerate(result) if isinstance(r, Sym) and r.kind == "attn"]
        if len(idx) != 1:
            raise UnsupportedSpec("the function does not return one attention output", op="output")
        lse = [i for i, r in enumerate(result) if isinstance(r, Sym) and r.kind == "rowlse"]
        for i, r in enumerate(result):
            if i != idx[0] and i not in lse[:1] and not (r is None or (isinstance(r, Sym) and r.kind == "probs")):
                raise UnsupportedSpec("a returned value other than the output, the attention weights and the "
                                      "rows' log-sum-exp", op="output")
        return result[idx[0]], len(result), idx[0], result[lse[0]] if lse else None, lse[0] if lse else -1
    raise UnsupportedSpec("the function does not return a tensor", op="output")


_LSE_DIM = {"b": "b", "h": "h", "q": "s"}


def _lse_layout(ctx: Ctx, lse: Sym, probs: Sym, canon: list[str]) -> tuple[str, ...]:
    """The returned log-sum-exp's dims over b, h, s ("1" for a kept unit dim): it must be of the very
    scores the softmax normalised, with no sink joining them (the kernel's LSE is of the scores alone)."""
    a, b = lse.payload.get("of"), probs.payload.get("score")
    same = a is b or (a is not None and b is not None and a.expr is not None and (a.axes, a.expr) == (b.axes, b.expr))
    if not same or probs.payload.get("sink") is not None:  # (s.float() taken twice is two equal values)
        raise UnsupportedSpec("a returned log-sum-exp of other scores than the softmax's", op="output")
    dims: list[str | None] = []
    for d in lse.axes:
        rs = _axis_roles(ctx, d, _LSE_DIM)
        if len(rs) > 1 or any(r not in _LSE_DIM for r in rs):
            raise UnsupportedSpec("a returned log-sum-exp merges or mixes in another axis", op="output")
        dims.append(_LSE_DIM[rs[0]] if rs else None)
    missing = [x for x in canon if x not in dims]
    return tuple(d if d is not None else missing.pop(0) if missing else "1" for d in dims)


_ROLE_DIM = {"q": "s", "kv": "s", "d": "d", "dv": "d", "b": "b", "h": "h"}


def _operand(ctx: Ctx, ld: Expr, name: str, paths: dict[str, str]) -> tuple[Operand, dict[str, Expr]]:
    """The operand's layout and its index per batch/head dim: {"b": ..., "h": ...}.

    A size-1 dim is named by position, never by its atom's role: a size-1 batch, head and query axis
    look alike to the analysis (decoding with B = 1), and any naming of them reads the same values.
    """
    step = ctx.facts.get("prologue", {}).get(ld.attr)  # a computed q, k or v: the prologue makes it
    shape = tuple(ctx.facts["inputs"][ld.attr].shape)
    dims: list[str | None] = [None if n == 1 else _ROLE_DIM.get(ctx.roles.get(_var(ix) or "", "")) for ix, n in
                              zip(ld.args, shape)]
    named = [d for d in dims if d is not None]
    if step and (packs_axes(ld) or any(ix.op in ("add", "sub") for ix in ld.args)):
        # a computed tensor read with two axes packed in one dim (heads with the head dim, [1, S, H*D] at
        # B = 1), or at an offset (a slice of a fused qkv [1, S, H, 3*D]): taken again as its split view or
        # slice (a head map h // g reads one axis and stays)
        raise SplitLayoutRefused(f"{name} packs dims the spec splits apart (heads with the head dim?)",
                                 op=name, input=ld.attr)
    # rank 3: [heads, seq, dim], or [batch, seq, dim] for keys shared by every head (MQA, "bjd")
    names = ["b", "h", "s", "d"] if len(ld.args) == 4 else ["b", "s", "d"] if "b" in named else ["h", "s", "d"]
    try:
        if len(ld.args) > 4:  # windows or groups as a third batch axis ([B, H, windows, S, D]): not folded
            raise UnsupportedSpec(f"{name} has {len(ld.args)} dims: the kernels take one batch and one head axis "
                                  "besides the sequence and the head dim (a third batch axis is not folded "
                                  "into them)", op=name)
        if len(ld.args) not in (3, 4) or len(named) != len(set(named)) or not set(named) <= set(names):
            raise UnsupportedSpec(f"{name} is not a [batch, heads, seq, dim] tensor in any order", op=name)
        dims = _fill(dims, [n for n in names if n not in named], [n > 1 for n in shape], name)
    except UnsupportedSpec:
        if any(ix.op not in ("var", "const") for ix in ld.args):  # dims packed in the argument (or made tensor)
            raise SplitLayoutRefused(f"{name} packs dims the spec splits apart (heads with the head dim?)",
                                     op=name, input=ld.attr) from None
        raise
    op = Operand(f"prologue:{step}", tuple(dims), step) if step else Operand(paths[ld.attr], tuple(dims))
    return op, {d: ix for d, ix in zip(dims, ld.args) if d in ("b", "h")}


def _split_packed(*lds: Expr) -> None:
    """Operands that index batch and heads differently, one of them with two axes packed in one dim (a query
    kept as [(b h), n, d] against keys [b, h, m, d]): the walk is to be retried with that tensor's split view
    (symbolic_backend: SplitLayoutRefused), made by the prologue as a view."""
    for ld in lds:
        if packs_axes(ld):
            raise SplitLayoutRefused("an operand packs dims the others index apart (batch with heads?)",
                                     op="matmul", input=ld.attr)


def _fill(dims: list[str | None], left: list[str], big: list[bool], name: str) -> list[str]:
    """Unnamed dims take the names left in canonical order; one of size > 1 only a batch or head."""
    out = list(dims)
    for i, d in enumerate(dims):
        if d is not None:
            continue
        later = sum(1 for j in range(i + 1, len(dims)) if dims[j] is None and big[j])
        ok = [n for n in left if (n in ("b", "h") or not big[i])
              and sum(m in ("b", "h") for m in left if m != n) >= later]
        if not ok:
            raise UnsupportedSpec(f"{name} is not a [batch, heads, seq, dim] tensor in any order", op=name)
        out[i] = ok[0]
        left.remove(ok[0])
    return out  # type: ignore[return-value]


def assemble(ctx: Ctx, result: Any, paths: dict[str, str], q_dtype: torch.dtype,
             signature: tuple[str, ...], consts: dict[str, torch.Tensor]) -> dict[str, Any]:
    out, tuple_len, index, lse, lse_index = _pick_output(result)
    if "output" not in ctx.facts:
        raise UnsupportedSpec("no softmax(...) @ v found", op="output")
    qld, kld = ctx.facts["score"]["q"], ctx.facts["score"]["k"]
    vld = ctx.facts["output"]["v"]
    probs: Sym = ctx.facts["output"]["probs"]
    qld, kld, vld, chunk = _fold_chunks(ctx, qld, kld, vld)
    qld, kld, vld = _fold_grouped_heads(ctx, qld, kld, vld)
    q, qb = _operand(ctx, qld, "query", paths)
    # batch roles from the query's layout; a size-1 atom keeps a role it has (any reads the same)
    for nm, ix in qb.items():
        if _var(ix) and ctx.roles.get(_var(ix), "batch") == "batch":
            ctx.roles[_var(ix)] = nm
    k, kb = _operand(ctx, kld, "key", paths)
    v, vb = _operand(ctx, vld, "value", paths)
    try:
        head_map, by = _head_map(ctx, qb, kb, "key")
        v_map = _head_map(ctx, qb, vb, "value")
    except UnsupportedSpec:
        _split_packed(qld, kld, vld)
        raise
    if v_map != (head_map, by):
        raise UnsupportedSpec("key and value map query heads differently (one is repeated over the query "
                              "heads before its matmul, the other is not)", op="value")

    def canon(e: Expr | None, what: str) -> Expr | None:
        if e is None:
            return None

        def r(n: Expr) -> Expr | None:
            if n.op == "var" and n.attr in ctx.derived:  # a digit of a split batch axis, or of a chunked position
                return rewrite(ctx.derived[n.attr], r)
            if n.op == "var" and n.attr != "s":
                role = ctx.roles.get(n.attr)
                if role in _CANON:
                    return Expr("var", (), _CANON[role])
                if ctx.sizes.get(n.attr) == 1:
                    return const(0)
                raise UnsupportedSpec(f"the {what} depends on an axis that is not batch, head, query or key", op=what)
            return None
        return simplify(rewrite(e, r), {})

    rel = ctx.facts.get("chunk_rel", {})  # in-chunk positions, where the spec reads them in the score
    score = canon(substitute(probs.payload["score"].expr, rel) if rel else probs.payload["score"].expr, "score")
    sink = canon(probs.payload.get("sink"), "sink")
    row_scale = canon(probs.payload.get("row_scale"), "row scale")
    if chunk:  # keys outside the query's chunk are masked
        same = call("eq", call("floordiv", var("q"), const(chunk)), call("floordiv", var("kv"), const(chunk)))
        score = call("where", same, score, const(float("-inf")))
    used = {n.attr for e in (score, sink, row_scale) if e is not None for n in walk(e) if n.op == "load"}
    extras = []
    made = ctx.facts.get("prologue", {})
    for t in sorted(used):
        val = ctx.facts["inputs"][t]
        if t in made:
            extras.append(ExtraTensor(name=t, dtype=str(val.dtype).replace("torch.", ""), rank=val.dim(),
                                      step=made[t]))
            continue
        path = paths.get(t)
        extras.append(ExtraTensor(name=t, dtype=str(val.dtype).replace("torch.", ""), rank=val.dim(),
                                  arg=path, value=None if path else consts[t].tolist()))
    odims = []
    for d in out.axes:
        # a size-1 atom without a role is a unit axis: named with the others left over, below
        rs = _axis_roles(ctx, d, _OUT_DIM)
        if "q" in rs:  # (chunk, position in chunk) merged back: the query position
            rs = [r for r in rs if r != "chunk"]
        if not rs:
            odims.append(None)
            continue
        nm = "*".join(_OUT_DIM.get(r or "", "?") for r in rs)
        if "?" in nm:
            raise OutputLayoutRefused("the output mixes in an axis that is not batch, head, query or dim",
                                      op="output")
        odims.append(nm)
    canon_dims = ["b", "h", "s", "d"][(0 if "b" in q.dims else 1):]
    if "b" not in canon_dims and odims.count(None) > sum(x not in "*".join(filter(None, odims)) for x in canon_dims):
        canon_dims = ["b"] + canon_dims  # a unit batch the operands were made without ([H, S, D] at B = 1) kept
    odims = _name_units(odims, canon_dims)
    lse_at: dict[str, Any] = {}
    if lse is not None:
        if row_scale is not None or chunk:
            raise UnsupportedSpec("a returned log-sum-exp with probabilities scaled per row or chunked keys",
                                  op="output")
        lse_at = dict(lse_index=lse_index, lse_dims=_lse_layout(ctx, lse, probs, canon_dims[:-1]),
                      lse_dtype=_dtype_name(lse.dtype, q_dtype))
    return dict(signature=signature, q=q, k=k, v=v, score=score, sink=sink, head_map=head_map,
                extras=tuple(extras), row_scale=row_scale,
                out=Output(tuple(odims), _dtype_name(out.dtype, q_dtype), tuple_len, index, **lse_at))


def _dtype_name(dtype: torch.dtype, q_dtype: torch.dtype) -> str:
    """An output's dtype as the program names it: "q" where it is the query's."""
    return "q" if dtype == q_dtype else str(dtype).replace("torch.", "")


def _axis_roles(ctx: Ctx, d: tuple[str, ...], named: dict[str, str]) -> list[str | None]:
    """The roles an output axis holds: its atoms with a role in `named` or of size > 1; a (kv head, group)
    pair merged back is the query head."""
    whole = ctx.digits_of(d[0], d[1]) if len(d) == 2 else None
    d = (whole,) if whole else d
    return [ctx.roles.get(a) for a in d if ctx.roles.get(a) in named or ctx.sizes[a] > 1]


def _fold_chunks(ctx: Ctx, qld: Expr, kld: Expr, vld: Expr) -> tuple[Expr, Expr, Expr, int]:
    """Block-local attention written by reshaping the sequence into chunks of c ([B, H, S/c, c, D]):
    q, k and v read position x * c + i with x a batch axis of the matmul that q and k share. The
    positions become the query and key axes, the chunk index their quotient by c, and keys of
    another chunk are masked (the caller adds q // c == kv // c). Returns the loads and c (0: none)."""
    def split(ld: Expr, role: str) -> tuple[int, str, str, int] | None:
        for i, ix in enumerate(ld.args):
            lin = _linear(ix)
            if lin is None or len(lin) != 2:
                continue
            inner = [a for a, c in lin.items() if c == 1 and ctx.roles.get(a) == role]
            outer = [a for a, c in lin.items() if ctx.roles.get(a) == "batch" and c == ctx.sizes.get(inner[0] if inner else "", 0)]
            if inner and outer:
                return i, outer[0], inner[0], lin[outer[0]]
        return None
    sq, sk = split(qld, "q"), split(kld, "kv")
    if sq is None or sk is None or sq[1] != sk[1] or sq[3] != sk[3]:
        return qld, kld, vld, 0
    sv = split(vld, "kv")
    if sv is None or sv[1] != sq[1] or sv[2] != sk[2]:
        return qld, kld, vld, 0
    x, i, j, c = sq[1], sq[2], sk[2], sq[3]
    n = ctx.sizes[x] * c
    ctx.sizes[i] = ctx.sizes[j] = n  # i and j are positions in the whole sequence now
    ctx.roles[x] = "chunk"
    ctx.derived[x] = call("floordiv", _atom(i), const(c))
    # reads of the in-chunk positions (a bias inside the chunk) read them from the positions
    ctx.facts["chunk_rel"] = {i: call("mod", _atom(i), const(c)), j: call("mod", _atom(j), const(c))}

    def fold(ld: Expr, at: int, pos: str) -> Expr:
        return Expr("load", tuple(_atom(pos) if k == at else a for k, a in enumerate(ld.args)), ld.attr)
    return fold(qld, sq[0], i), fold(kld, sk[0], j), fold(vld, sv[0], j), c


def _atom(name: str) -> Expr:
    return Expr("var", (), name)


def _fold_grouped_heads(ctx: Ctx, qld: Expr, kld: Expr, vld: Expr) -> tuple[Expr, Expr, Expr]:
    """GQA written by splitting the query heads into (kv head, group) (Grok-1: q.view(B, Hkv, g, T, D)
    against k [B, Hkv, S, D]): q reads head x * g + y, k and v read head x. The query head becomes one
    atom h with x = h // g and y = h % g, so the key's and value's head index is h // g (a group map)
    and a bias indexed by x or y reads it through h."""
    def digits(ld: Expr) -> tuple[int, str, str, int] | None:
        for i, ix in enumerate(ld.args):
            lin = _linear(ix)
            if lin is None or len(lin) != 2:
                continue
            inner = [a for a, c in lin.items() if c == 1]
            outer = [a for a, c in lin.items() if inner and a != inner[0] and c == ctx.sizes.get(inner[0])]
            if inner and outer and ctx.sizes[inner[0]] > 1 and ctx.sizes[outer[0]] > 1:
                return i, outer[0], inner[0], lin[outer[0]]
        return None
    found = digits(qld)
    if found is None:
        return qld, kld, vld
    i, x, y, g = found
    bare = {ix.attr for ld in (kld, vld) for ix in ld.args if ix.op == "var"}
    reads = {n.attr for ld in (kld, vld) for n in walk(ld) if n.op == "var"}
    if x not in bare or y in reads:
        return qld, kld, vld
    h = ctx.atom(ctx.sizes[x] * g)
    ctx.split(h, x, y)
    qld = Expr(qld.op, qld.args[:i] + (Expr("var", (), h),) + qld.args[i + 1:], qld.attr)
    head = call("floordiv", Expr("var", (), h), const(g))
    kld, vld = (substitute(ld, {x: head}) for ld in (kld, vld))
    return qld, kld, vld


def _linear(e: Expr) -> dict[str, int] | None:
    """e as {atom: coefficient} when it is a sum of atoms times integer constants."""
    if e.op == "var":
        return {e.attr: 1}
    if e.op == "mul" and e.args[0].op == "var" and e.args[1].op == "const" and isinstance(e.args[1].attr, int):
        return {e.args[0].attr: e.args[1].attr}
    if e.op == "mul" and e.args[1].op == "var" and e.args[0].op == "const" and isinstance(e.args[0].attr, int):
        return {e.args[1].attr: e.args[0].attr}
    if e.op == "add":
        a, b = _linear(e.args[0]), _linear(e.args[1])
        if a is None or b is None or set(a) & set(b):
            return None
        return {**a, **b}
    return None


def _name_units(odims: list[str | None], canon: list[str]) -> list[str]:
    """Names no output axis holds fill the unnamed (size-1) axes in order; any left over were size-1
    axes a reshape folded away (e.g. [B, S, 1, D] -> [B, S, D]) and join the axis of the next name."""
    missing = [x for x in canon if not any(x in (o or "").split("*") for o in odims)]
    out = [o if o is not None else missing.pop(0) if missing else None for o in odims]
    if None in out:
        raise OutputLayoutRefused("the output has more axes than batch, head, query and dim", op="output")
    names: list[str] = out  # type: ignore[assignment]
    for x in missing:
        later = canon[canon.index(x) + 1:]
        at = next((i for i, o in enumerate(names) for y in later if y in o.split("*")), len(names) - 1)
        names[at] = f"{x}*{names[at]}"
    return names


def _head_map(ctx: Ctx, qb: dict[str, Expr], kb: dict[str, Expr], name: str) -> tuple[str, Expr | None]:
    """How the operand's heads follow the query's: ("group", None) where they read the query's head
    index as it is (or broadcast it), ("group" or "tile", the divisor) where they read h // g or h % g.
    The divisor is kept: a key read at h // 2 and a value read at h (a value repeated to every query head
    before the matmul, a key not) map heads differently, and one head map for both would read the
    wrong value heads."""
    for nm, qi in qb.items():
        ki = kb.get(nm, const(0))
        if ki == qi or ki == const(0) or (_unit(ctx, qi) and _unit(ctx, ki)):
            continue  # the same index, a broadcast, or two size-1 axes (both read index 0)
        if nm == "h" and ki.op in ("floordiv", "mod") and ki.args[0] == qi and ki.args[1].op == "const":
            return ("group" if ki.op == "floordiv" else "tile"), ki.args[1]
        raise UnsupportedSpec(f"{name} is indexed by an unsupported head/batch expression {ki}", op=name)
    return "group", None


def _unit(ctx: Ctx, e: Expr) -> bool:
    return e == const(0) or (e.op == "var" and ctx.sizes.get(e.attr) == 1)
