"""Pass: the spec's ops after the attention output, left for PyTorch to run on the kernel's output.

A spec that goes on after softmax(q.k) @ v (an output projection o @ W_o, a gate, a scale and shift,
heads merged into [B, S, H*D] and projected) is attention followed by ordinary PyTorch. The walk stops
at the attention output (symbolic/graph.py); every op from there to the function's result becomes an
epilogue step, the spec's own aten call, replayed on each call with the kernel's output in the
attention output's place (ir/prologue.py, run_epilogue). The epilogue may not read the scores or the
probabilities: the kernel never writes them.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.fx import Node

from ..errors import UnsupportedSpec
from ..ir.program import Step
from ..ir.prologue import ATTENTION, RESULT
from .prologue import Prologue, cone_of, mutates_input, op_name


def epilogue_steps(gm: torch.fx.GraphModule, boundary: Node, on_score: set[Node], encoder: Prologue,
                   is_weights: Callable[[Node], bool]) -> tuple[tuple[Step, ...], int, int]:
    """The steps from the attention output `boundary` to the function's result, in graph order, and
    (tuple length, index of the item made from the attention output) where the result is a tuple
    (else (0, 0)). A tuple's other items are None, the attention weights (served as None, as a
    tuple result without an epilogue serves them; `is_weights` says which node is) or values off the
    score path (a module's bias returned beside the output); the last step packs them."""
    result = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    after = _downstream(boundary)
    items = list(result) if isinstance(result, (tuple, list)) else [result]
    made = [i for i, r in enumerate(items) if isinstance(r, Node) and r in after]
    if not made:
        raise UnsupportedSpec("the function's result does not use the attention output", op="output")
    if len(made) > 1:
        raise UnsupportedSpec("the function returns several values computed after the attention output",
                              op="output")
    for r in items:  # weights are served as None; any other value of the scores (a log-sum-exp) is not
        if isinstance(r, Node) and r in on_score and r not in after and not is_weights(r):
            raise UnsupportedSpec("the function returns a value of the scores other than the attention weights "
                                  "beside an output computed after the attention (a log-sum-exp?)", op=op_name(r))
    kept = [r if isinstance(r, Node) and (r in after or r not in on_score) else None for r in items]
    if any(not isinstance(r, Node) and r is not None for r in items):
        raise UnsupportedSpec("the function returns a value that is not a tensor beside the attention output",
                              op="output")
    steps: list[Step] = []
    renamed = {boundary: ATTENTION}
    for n in cone_of([r for r in kept if r is not None], stop=frozenset({boundary})):
        if n in on_score and n not in after:
            e = UnsupportedSpec("the output reads the scores or probabilities apart from the attention "
                                "output (the kernel does not write them)", op=op_name(n))
            e.node = n.name
            raise e
        if mutates_input(n):
            raise UnsupportedSpec("an in-place op on an argument after the attention output", op="epilogue")
        steps.append(encoder.step_for(n, renamed))
    if not isinstance(result, (tuple, list)):
        return tuple(steps), 0, 0
    pack = Step(RESULT, "list" if isinstance(result, list) else "tuple", tuple(None if r is None else encoder.encode(r, renamed) for r in kept))
    return tuple(steps) + (pack,), len(items), made[0]


def _downstream(node: Node) -> set[Node]:
    """`node` and every node that reads it, directly or not."""
    out: set[Node] = set()
    todo = [node]
    while todo:
        n = todo.pop()
        if n in out:
            continue
        out.add(n)
        todo.extend(n.users)
    return out
