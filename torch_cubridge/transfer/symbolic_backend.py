"""The default transfer backend: symbolic analysis of the captured graph.

Passes, in order: walk (symbolic values for every node) -> assemble (roles,
layouts, loads) -> extract_mask -> lift_literals -> classify blocks.
"""
from __future__ import annotations

from dataclasses import replace

from ..capture.trace import Captured
from ..errors import HeldTensorRefused, OutputLayoutRefused, SplitLayoutRefused, UnsupportedSpec
from ..ir.expr import free_vars, loads
from ..ir.program import Program, row_sink
from .assemble import assemble
from .epilogue import epilogue_steps
from .masks import extract_mask
from .prologue import Prologue
from .scalars import lift_literals
from .symbolic.graph import Walker, input_sym, tensor_name
from .symbolic.simplify import simplify
from .symbolic.sym import Ctx


def symbolic_transfer(cap: Captured, prologue: bool = True) -> Program:
    """The program for a captured spec; `prologue=False` refuses values off the score path that
    no rule covers instead of leaving them to PyTorch.

    A walk takes the first matmul of two call tensors as q.k. Where that fails and the prologue is
    on, the walk runs again with that matmul left to the prologue (an MLP over positions fed by
    weight arguments comes before q.k), a few times at most. If every such walk fails and the spec
    holds tensors of its own, the walks run once more letting one side of q.k be such a tensor (a
    module's latent query, made by the prologue). An argument that packs dims the spec splits apart
    ([B, S, H*D] viewed as [B, S, H, D]) is taken again as its split view, made by the prologue (a view,
    no copy). An output whose views no layout names (its query axis split into image rows and columns) is
    taken again with those views in the epilogue, the output as the attention matmul gives it. A refusal reports the first walk's reason, or the held-operand walk's where that names
    the cause (a tensor baked in from outside the arguments).
    """
    first: UnsupportedSpec | None = None
    for held in (False, True):  # then: q.k may have a side the function holds (a module's latent query)
        if held and (not prologue or not cap.constants):
            break
        not_score: set[str] = set()
        split: set[str] = set()
        views_out = False  # the attention output's views left to the epilogue
        for _ in range(12):  # each retry leaves one more matmul or split view to the prologue
            walker: list[Walker] = []
            try:
                return _transfer_once(cap, prologue, not_score, walker, held, split, views_out)
            except OutputLayoutRefused as e:
                first = first or e
                if not prologue or views_out:
                    break
                views_out = True
                continue
            except SplitLayoutRefused as e:
                first = first or e
                if not prologue or e.input in split:
                    break
                split.add(e.input)  # again, with that argument's split view made by the prologue
                continue
            except UnsupportedSpec as e:
                first = e if isinstance(e, HeldTensorRefused) else first or e
                tried = walker[0].score_node if walker else None
                if not prologue or tried is None or tried in not_score:
                    break
                not_score.add(tried)
    assert first is not None
    raise first


def _transfer_once(cap: Captured, prologue: bool, not_score: set[str], walker_out: list,
                   held: bool = False, split: frozenset[str] | set[str] = frozenset(),
                   views_out: bool = False) -> Program:
    ctx = Ctx()
    inputs, paths, consts = {}, {}, {}
    for path in cap.tensor_paths:
        name = tensor_name(path)
        inputs[name] = input_sym(ctx, name, cap.example[path])
        paths[name] = path
    const_names = {}
    for i, (attr, t) in enumerate(sorted(cap.constants.items())):
        owner = cap.constant_paths.get(attr)
        name = tensor_name(owner) if owner else f"const{i}"
        inputs[name] = input_sym(ctx, name, t)
        const_names[attr] = name
        consts[name] = t
        if owner:
            paths[name] = owner
    nodes = list(cap.graph.graph.nodes)
    placeholders = dict(zip([n for n in nodes if n.op == "placeholder"], cap.tensor_paths))
    sources = {n: (cap.constant_paths.get(n.target), cap.constants[n.target]) for n in nodes if n.op == "get_attr"}
    pro = Prologue(placeholders, sources) if prologue else None
    walker = Walker(ctx, inputs, pro)
    walker.not_score = set(not_score)
    walker.held_operand = held
    walker.split_inputs = set(split)
    walker.epilogue_at_attention = views_out
    walker_out.append(walker)
    result = walker.run(cap.graph, [tensor_name(p) for p in cap.tensor_paths], const_names)
    parts = assemble(ctx, result, paths, _q_dtype(ctx), cap.signature, consts)
    score, mask, empty = extract_mask(parts.pop("score"))
    mask = None if mask is None else simplify(mask, {})
    sink = parts.pop("sink")
    if sink is not None:
        empty = "zero"  # the sink takes all the weight of a fully masked row
        if "q" in free_vars(sink):  # per query row: sum e^x V / (sum e^x + e^c) = O sigmoid(lse - c)
            parts["row_scale"] = row_sink(sink, parts["row_scale"])
            sink = None
    (score, mask, sink), scalars = lift_literals([score, mask, sink])
    rule = "none" if mask is None else ("prepass" if loads(mask) else "interval")
    used = set().union(*(loads(e) for e in (score, mask, sink, parts["row_scale"]) if e is not None))
    extras = tuple(x for x in parts.pop("extras") if x.name in used)
    computed = {op.step for op in (parts["q"], parts["k"], parts["v"]) if op.step}
    steps = pro.needed({x.step for x in extras if x.step} | computed) if pro is not None else ()
    weights = lambda n: getattr(walker.env.get(n), "kind", None) == "probs"  # noqa: E731
    after, n, i = epilogue_steps(cap.graph, walker.boundary, walker.on_score, Prologue(placeholders, sources),
                                 weights) if walker.boundary is not None else ((), 0, 0)
    if n:
        parts["out"] = replace(parts["out"], tuple_len=n, index=i)
    prog = Program(score=score, mask=mask, sink=sink, scalars=tuple(scalars), block_rule=rule,
                   empty_rows=empty, extras=extras, prologue=steps, epilogue=after, **parts)
    prog.validate()
    return prog


def _q_dtype(ctx: Ctx):
    q = ctx.facts.get("score", {}).get("q")
    if q is None:
        raise UnsupportedSpec("no q.k matmul found: this is not attention", op="matmul")
    return ctx.facts["inputs"][q.attr].dtype
