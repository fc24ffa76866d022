"""Running a program's prologue: the spec's own aten ops, replayed by PyTorch on a call's tensors.

Values of the spec that do not depend on q.k (a bias table, cumulative gates, ids looked up from
cu_seqlens) are computed here exactly as the spec computes them, in the call's dtypes; the kernel
reads the results as extra tensors.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from .bind import lookup

if TYPE_CHECKING:
    from .program import Program, Step


def resolve_op(name: str) -> Any:
    """torch.ops.aten.<op>.<overload> from "aten.<op>.<overload>"; "getitem" indexes a tuple (None),
    "tuple" and "list" pack the function's several results."""
    if name == "getitem":
        return None
    if name == "tuple":
        return _pack
    if name == "list":
        return _pack_list
    ns, op, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, ns), op), overload)


def _decode(x: Any, bound: dict[str, Any], done: dict[str, Any], device: torch.device,
            sizes: dict[str, int]) -> Any:
    if isinstance(x, tuple):
        tag = x[0] if x and isinstance(x[0], str) and x[0].startswith("@") else None
        if tag == "@size":  # c0 + sum(c * size): a literal fitted to the lengths (transfer.generalize)
            return sized(x, sizes)
        if tag == "@arg":
            t = lookup(bound, x[1])
            return t.to("meta") if device.type == "meta" and isinstance(t, torch.Tensor) else t
        if tag == "@step":
            return done[x[1]]
        if tag == "@const":
            return _constant(x, device)
        if tag == "@dtype":
            return getattr(torch, x[1])
        if tag == "@dtype_of":  # the dtype of this call's argument
            return lookup(bound, x[1]).dtype
        if tag == "@device":
            return device
        if tag == "@layout":
            return getattr(torch, x[1])
        if tag == "@memory_format":
            return getattr(torch, x[1])
        if tag is not None:
            raise ValueError(f"unknown prologue value {x!r}")
        return [_decode(i, bound, done, device, sizes) for i in x]
    return x


def sized(x: Any, sizes: dict[str, int]) -> Any:
    """Step arguments `x` with every literal fitted to the lengths ("@size") at these lengths."""
    if isinstance(x, tuple):
        if x and x[0] == "@size":
            return x[1] + sum(c * sizes[n] for n, c in x[2])
        return tuple(sized(i, sizes) for i in x)
    return x


def step_refs(x: Any):
    """Names of the earlier steps that step arguments `x` read."""
    if isinstance(x, tuple):
        if len(x) == 2 and x[0] == "@step":
            yield x[1]
        else:
            for i in x:
                yield from step_refs(i)


_CONSTANTS: dict[tuple[int, str], tuple[tuple, torch.Tensor]] = {}


def _constant(x: tuple, device: torch.device) -> torch.Tensor:
    """A captured constant ("@const", dtype, nested values) as a tensor, made once per program and
    device (real tensors only): building it from nested lists took 60 ms a call for a 1M-element table (falcon). No step
    writes it (an in-place op on a constant is refused at transfer, transfer/prologue.py)."""
    key = (id(x), str(device))
    hit = _CONSTANTS.get(key)
    if hit is not None and hit[0] is x:  # the held tuple keeps its id from being reused
        return hit[1]
    t = torch.tensor(_lists(x[2]), dtype=getattr(torch, x[1]), device=device)
    # a run over fake tensors (transfer/lengths.py) makes a fake one: kept, a later real call would read
    # memory that was never allocated (an illegal address on the GPU)
    if not isinstance(t, FakeTensor):
        _CONSTANTS[key] = (x, t)
    return t


def _lists(x: Any) -> Any:
    return [_lists(i) for i in x] if isinstance(x, (tuple, list)) else x


_RESHAPE = "aten.reshape.default"


def run_steps(steps: tuple[Step, ...], bound: dict[str, Any], device: torch.device,
              sizes: dict[str, int] | None = None, rewrite: Any = None,
              given: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every step's result by name. Tensors read from the call stay where they are; made ones go
    on `device` (the query's). sizes: Sq and Skv, for literals fitted to them. rewrite(op, args):
    the arguments a step runs with instead (transfer/lengths.py's symbolic run)."""
    done: dict[str, Any] = dict(given or {})  # results made elsewhere (the epilogue's attention output)
    sizes = sizes or {}
    for s in steps:  # under the caller's grad mode: a result that needs a backward says so
        args = [_decode(a, bound, done, device, sizes) for a in s.args]
        if rewrite is not None:
            args = rewrite(s.op, args)
        kwargs = {k: _decode(v, bound, done, device, sizes) for k, v in s.kwargs}
        # shapes only on meta: a meta kernel may give a made tensor other strides than the device's (a
        # convolution's), so the spec's own view, valid where it ran, is taken as the reshape it equals
        fn = resolve_op(_RESHAPE if device.type == "meta" and s.op == "aten.view.default" else s.op)
        done[s.name] = args[0][args[1]] if fn is None else fn(*args, **kwargs)
    return done


def needed_steps(steps: tuple[Step, ...], names: set[str]) -> tuple[Step, ...]:
    """The steps the named results need, in order."""
    by_name = {s.name: s for s in steps}
    keep: set[str] = set()
    todo = list(names)
    while todo:
        n = todo.pop()
        if n in keep:
            continue
        keep.add(n)
        todo += list(step_refs((by_name[n].args, by_name[n].kwargs)))
    return tuple(s for s in steps if s.name in keep)


def run_prologue(p: Program, bound: dict[str, Any], device: torch.device,
                 in_place: tuple[str, ...] = (), also: set[str] | frozenset = frozenset()) -> dict[str, torch.Tensor]:
    """The results the program reads (computed operands, extra tensors), by step name, on `device`.
    in_place: operands ("k", "v") the kernel reads where they lie (paged KV, pieces), so not computed;
    also: more steps to return (the pieces of a concatenated K and V)."""
    if not p.prologue:
        return {}
    used = [op.step for r, op in (("q", p.q), ("k", p.k), ("v", p.v)) if op.step and r not in in_place] + \
        [x.step for x in p.extras if x.step] + sorted(also)
    steps = needed_steps(p.prologue, set(used)) if in_place else p.prologue
    done = run_steps(steps, bound, device, call_lengths(p, bound))
    return {s: done[s].to(device) for s in used}


ATTENTION = "__attention__"  # the step name epilogue steps read the attention output by
RESULT = "__result__"  # the epilogue's last step where the function returns a tuple (op "tuple")


def _pack(*items: Any) -> tuple:
    return items


def _pack_list(*items: Any) -> list:
    return list(items)


def run_epilogue(p: Program, out: torch.Tensor, bound: dict[str, Any]) -> torch.Tensor:
    """The spec's ops after its attention output (transfer/epilogue.py), run by PyTorch on `out`, the
    attention output in the spec's layout; the function's result."""
    done = run_steps(p.epilogue, bound, out.device, call_lengths(p, bound), given={ATTENTION: out})
    return done[p.epilogue[-1].name]


def call_lengths(p: Program, bound: dict[str, Any]) -> dict[str, int]:
    """Sq and Skv of a call, read from its arguments: an operand's own, or for a computed one the
    argument dim its length follows (`Operand.length`); {} where one has neither (held at one shape).
    B too where the program's literals are fitted to it (`Program.batch`)."""
    out = {}
    for name, op in (("Sq", p.q), ("Skv", p.k)):
        n = operand_length(op, bound)
        if n is None:
            return {}
        out[name] = n
    if p.batch:
        path, d = p.batch[0]
        out["B"] = int(lookup(bound, path).shape[d])
    return out


def operand_length(op: Any, bound: dict[str, Any]) -> int | None:
    """The sequence length of operand `op` in this call, from its arguments' sizes alone; None for a
    computed operand held at its shape."""
    if op.step is None:
        return int(lookup(bound, op.arg).shape[op.dims.index("s")])
    rule = length_rule(op)
    if rule is None:
        return None
    path, d, off, _, scale = rule
    return off if path == FIXED else int(lookup(bound, path).shape[d]) * scale + off


FIXED = ""  # the path of a length rule that no argument moves: the length is its offset


def length_rule(op: Any) -> tuple[str, int, int, tuple, int] | None:
    """A computed operand's (path, dim, offset, moved dims, scale): its length is that argument dim
    times scale plus offset (a block table's width times the page size has scale P); with path FIXED,
    the offset alone (latent queries a module holds). None: held at the call's shape, or an argument
    operand (its length is its own)."""
    if op.length is None:
        return None
    path, d, off, moved = op.length[:4]
    return path, d, off, tuple(moved), (op.length[4] if len(op.length) > 4 else 1)


def operand_inputs(p: Program) -> set[str]:
    """Paths of the arguments the prologue reads to compute q, k or v."""
    made = {op.step for op in (p.q, p.k, p.v) if op.step}
    if not made:
        return set()
    steps = needed_steps(p.prologue, made)
    return {x[1] for st in steps for x in _arg_refs((st.args, st.kwargs))}


def _arg_refs(x: Any):
    if isinstance(x, tuple):
        if len(x) == 2 and x[0] == "@arg":
            yield x
        else:
            for i in x:
                yield from _arg_refs(i)


def computes_operands(p: Program) -> bool:
    return any(op.step for op in (p.q, p.k, p.v))


def operand_shapes(p: Program, bound: dict[str, Any]) -> dict[str, torch.Tensor]:
    """q, k and v of a call ("q", "k", "v"): the arguments, or for computed ones meta tensors of the
    shape and dtype the prologue gives (no maths is done)."""
    made = run_prologue(p, bound, torch.device("meta")) if computes_operands(p) else {}
    return {r: made[op.step] if op.step else lookup(bound, op.arg) for r, op in (("q", p.q), ("k", p.k), ("v", p.v))}
