"""View and layout ops on symbolic tensors: reshape, permute, expand, repeat, slice."""
from __future__ import annotations

from ...errors import UnsupportedSpec
from ...ir.expr import Expr, call, const
from .sym import Ctx, Sym


def _norm(dim: int, rank: int) -> int:
    return dim + rank if dim < 0 else dim


def reshape(ctx: Ctx, x: Sym, shape: list[int], op: str) -> Sym:
    total = 1
    for n in ctx.shape(x):
        total *= n
    shape = list(shape)
    if -1 in shape:
        known = 1
        for n in shape:
            if n != -1:
                known *= n
        shape[shape.index(-1)] = total // max(known, 1)
    # Size-1 atoms stay in order and fill the output's size-1 dims positionally (a unit dim can sit
    # anywhere in a row-major view); this keeps a query axis of length 1 (decoding) an axis of its own.
    # A unit atom no unit output dim takes is index 0.
    seq = [a for d in x.axes for a in d]
    sub: dict[str, Expr] = {}
    axes: list[tuple[str, ...]] = []
    i = 0

    def skip_units() -> None:
        nonlocal i
        while i < len(seq) and ctx.sizes[seq[i]] == 1:
            sub[seq[i]] = const(0)
            i += 1
    for n in shape:
        group: list[str] = []
        if n == 1:
            if i < len(seq) and ctx.sizes[seq[i]] == 1:
                group.append(seq[i])
                i += 1
            axes.append(tuple(group))
            continue
        prod = 1
        while prod < n:
            skip_units()
            if i >= len(seq):
                raise UnsupportedSpec(f"reshape to {shape} does not fit", op=op)
            a = seq[i]
            sa = ctx.sizes[a]
            if prod * sa <= n:
                group.append(a)
                prod *= sa
                i += 1
                continue
            need = n // prod
            if n % prod or sa % need:
                raise UnsupportedSpec(f"reshape to {shape} mixes dims", op=op)
            outer, inner = ctx.atom(need), ctx.atom(sa // need)
            if a in ctx.roles:  # a batch axis of the scores split in two (Swin's windows): digits of it
                ctx.split(a, outer, inner)
            else:
                sub[a] = call("add", call("mul", Expr("var", (), outer), const(sa // need)), Expr("var", (), inner))
            group.append(outer)
            prod *= need
            seq[i] = inner
        axes.append(_rejoin(ctx, group, sub))
    skip_units()
    # a permute may have moved a unit atom past others: unit atoms left over fill the unit dims left empty
    dropped = [a for a, e in sub.items() if e == const(0) and ctx.sizes.get(a) == 1]
    for j, n in enumerate(shape):
        if n == 1 and not axes[j] and dropped:
            a = dropped.pop(0)
            del sub[a]
            axes[j] = (a,)
    if i != len(seq):
        raise UnsupportedSpec(f"reshape to {shape} does not fit", op=op)
    y = ctx.subst(x, sub, op)
    return Sym(tuple(axes), y.expr, x.dtype, x.kind, x.payload)


def _rejoin(ctx: Ctx, group: list[str], sub: dict[str, Expr]) -> tuple[str, ...]:
    """Digits of a split role axis that come together again (outer, inner) are that axis once more;
    values that read the digits read them from it."""
    out: list[str] = []
    for a in group:
        whole = ctx.digits_of(out[-1], a) if out else None
        if whole is None:
            out.append(a)
            continue
        sub.update(ctx.derived_of(out[-1]))
        sub.update(ctx.derived_of(a))
        out[-1] = whole
    return tuple(out)


def permute(x: Sym, order: list[int]) -> Sym:
    r = len(x.axes)
    return Sym(tuple(x.axes[_norm(i, r)] for i in order), x.expr, x.dtype, x.kind, x.payload)


def transpose(x: Sym, d0: int, d1: int) -> Sym:
    r = len(x.axes)
    order = list(range(r))
    a, b = _norm(d0, r), _norm(d1, r)
    order[a], order[b] = order[b], order[a]
    return permute(x, order)


def unsqueeze(x: Sym, dim: int) -> Sym:
    axes = list(x.axes)
    axes.insert(_norm(dim, len(axes) + 1), ())
    return Sym(tuple(axes), x.expr, x.dtype, x.kind, x.payload)


def squeeze(ctx: Ctx, x: Sym, dims: list[int] | None, op: str) -> Sym:
    r = len(x.axes)
    targets = {(_norm(d, r)) for d in dims} if dims is not None else set(range(r))
    keep, sub = [], {}
    for i, d in enumerate(x.axes):
        if i in targets and ctx.dim_size(d) == 1:
            sub.update({a: const(0) for a in d})
        else:
            keep.append(d)
    y = ctx.subst(x, sub, op)
    return Sym(tuple(keep), y.expr, x.dtype, x.kind, x.payload)


def expand(ctx: Ctx, x: Sym, sizes: list[int], op: str) -> Sym:
    axes = [()] * (len(sizes) - len(x.axes)) + list(x.axes)
    sub = {}
    out = []
    for d, n in zip(axes, sizes):
        if n == -1 or ctx.dim_size(d) == n:
            out.append(d)
        else:
            sub.update({a: const(0) for a in d})
            out.append((ctx.atom(n),))
    y = ctx.subst(x, sub, op)
    return Sym(tuple(out), y.expr, x.dtype, x.kind, x.payload)


def repeat(ctx: Ctx, x: Sym, reps: list[int], op: str) -> Sym:
    """x.repeat(reps): each repeated dim gains an atom for the copy, outermost (index = copy * n + i)."""
    axes = [()] * (len(reps) - len(x.axes)) + list(x.axes)
    out, sub = [], {}
    for d, r in zip(axes, reps):
        if r == 1:
            out.append(d)
            continue
        g = ctx.atom(r)
        if ctx.dim_size(d) == 1:
            sub.update({a: const(0) for a in d})
            out.append((g,))
        else:
            out.append((g,) + d)
    y = ctx.subst(x, sub, op)
    return Sym(tuple(out), y.expr, x.dtype, x.kind, x.payload)

def slice_(ctx: Ctx, x: Sym, dim: int, start: int | None, end: int | None, step: int, op: str) -> Sym:
    r = len(x.axes)
    dim = _norm(dim, r)
    d = x.axes[dim]
    n = ctx.dim_size(d)
    start = 0 if start is None else (start + n if start < 0 else start)
    end = n if end is None else (end + n if end < 0 else min(end, n))
    start = max(0, min(start, n))
    length = max(0, (end - start + step - 1) // step)
    if start == 0 and length == n:
        return x
    if len(d) != 1:
        raise UnsupportedSpec("slice of a merged dim", op=op)
    new = ctx.atom(length)
    src = Expr("var", (), new)
    if step != 1:
        src = call("mul", src, const(step))
    if start:
        src = call("add", src, const(start))
    y = ctx.subst(x, {d[0]: src}, op)
    axes = list(x.axes)
    axes[dim] = (new,)
    return Sym(tuple(axes), y.expr, x.dtype, x.kind, x.payload)


def select(ctx: Ctx, x: Sym, dim: int, index: int, op: str) -> Sym:
    r = len(x.axes)
    dim = _norm(dim, r)
    d = x.axes[dim]
    n = ctx.dim_size(d)
    index = index + n if index < 0 else index
    sub = ctx.decompose(const(index), d) if d else {}
    y = ctx.subst(x, sub, op)
    return Sym(x.axes[:dim] + x.axes[dim + 1:], y.expr, x.dtype, x.kind, x.payload)
