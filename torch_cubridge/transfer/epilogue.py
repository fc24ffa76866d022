"""Pass: the spec's ops after the attention output, left for PyTorch to run on the kernel's output.

A spec that goes on after softmax(q.k) @ v (an output projection o @ W_o, a gate, a scale and shift,
heads merged into [B, S, H*D] and projected) is attention followed by ordinary PyTorch. The walk stops
at the attention output (symbolic/graph.py); every op from there to the function's result becomes an
epilogue step, the spec's own aten call, replayed on each call with the kernel's output in the
attention output's place (ir/prologue.py, run_epilogue). The epilogue may not read the scores or the
probabilities: the kernel never writes them.
"""
from __future__ import annotations

import torch
from torch.fx import Node

from ..errors import UnsupportedSpec
from ..ir.program import Step
from ..ir.prologue import ATTENTION
from .prologue import Prologue, cone_of, mutates_input, op_name


def epilogue_steps(gm: torch.fx.GraphModule, boundary: Node, on_score: set[Node], encoder: Prologue
                   ) -> tuple[Step, ...]:
    """The steps from the attention output `boundary` to the function's result, in graph order."""
    result = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    if not isinstance(result, Node):
        raise UnsupportedSpec("the function returns several values computed after the attention output",
                              op="output")
    after = _downstream(boundary)
    if result not in after:
        raise UnsupportedSpec("the function's result does not use the attention output", op="output")
    cone = cone_of(result, stop=frozenset({boundary}))
    for n in cone:
        if n in on_score and n not in after:
            e = UnsupportedSpec("the output reads the scores or probabilities apart from the attention "
                                "output (the kernel does not write them)", op=op_name(n))
            e.node = n.name
            raise e
        if mutates_input(n):
            raise UnsupportedSpec("an in-place op on an argument after the attention output", op="epilogue")
    renamed = {boundary: ATTENTION}
    return tuple(encoder.step_for(n, renamed) for n in cone)


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
