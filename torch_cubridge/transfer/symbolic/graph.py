"""Walk the captured aten graph, giving every node a symbolic value.

The walk knows the *algebra* of ops (views, broadcasting, contractions,
reductions, softmax), not a list of attention idioms: masks, biases, scales
and head grouping fall out of how values combine. Each op's algebra is its rule
in the table rules/ fills; the walker looks it up.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
from torch.fx import Node

from ...errors import UnsupportedSpec
from ...ir.expr import walk
from ..prologue import Prologue
from .elementwise import lift_scalar
from .normaliser import NormaliserPath
from .offscore import PENDING, OffScorePath, merges_dims, packed_read
from .rules import RULES, Call, no_rule
from .sym import Ctx, Sym, input_sym, packet_name  # noqa: F401  (input_sym: the backend's too)

_RANDOM = {"native_dropout", "bernoulli", "rand", "randn", "rand_like", "randn_like", "randint", "normal",
           "uniform", "exponential", "random", "multinomial", "randperm"}


def tensor_name(path: str) -> str:
    return path.replace(".", "_").replace("*", "")


class Walker(OffScorePath, NormaliserPath):
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
        self.epilogue_at_attention = False  # every op on the attention output is the epilogue's (symbolic_transfer)

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
        # the arguments whose split views the prologue makes, the views it made, and permutes of those
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
                    and (merges_dims(node) or packet_name(node) in ("select", "slice")) \
                    and not (_made(node.args[0], split_from) and merges_dims(node) and _lowers_rank(node)):
                self.env[node] = self._split_view(node)  # the argument's split view, made by the prologue
                self.from_call.add(node)
                # a view that splits that view further is made there too: [B*S, 3*H*D] viewed [B, S, 3*H*D],
                # then [B, S, 3, H, D], permuted, q selected (a fused qkv: BLIP's and timm's ViTs); a view
                # that merges dims again ([B, H, S, D] as [B*H, S, D] for bmm) is the walk's own
                split_from.add(node)
            elif node.op == "get_attr":
                self.env[node] = self.inputs[consts[node.target]]
            elif node.op == "call_function":
                at = self._attention_output_read_by(node) if self.epilogue_at_attention else None
                if at is not None:  # its views too: the output as the attention matmul leaves it
                    self.boundary = at
                    return self.env[at]
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
                if node.args and _made(node.args[0], split_from) and packet_name(node) in _LAYOUT_ONLY:
                    split_from.add(node)  # a permute of a made split view: selecting from it still splits
                if (not had_score and "score" in self.ctx.facts) or any(a in self.on_score for a in ins):
                    self.on_score.add(node)
                if any(a in self.from_call for a in ins):
                    self.from_call.add(node)
            elif node.op == "output":
                return self.arg(node.args[0])
        raise UnsupportedSpec("graph has no output")

    def _split_view(self, node: Node) -> Sym:
        """The view `node` of an argument to split, made by the prologue. A view that splits the packed dim
        and merges batch with heads at once ([Sq, B, H*D] viewed [Sq, B*H, D] for bmm) is made with the
        merged dim unflattened, so the batch and head axes stay apart for the matmul to name."""
        try:
            sym = self.call(node)
        except UnsupportedSpec:
            return self.materialize(node)
        if isinstance(sym, Sym) and packed_read(sym) and any(len(ax) > 1 for ax in sym.axes):
            return self.materialize_unflattened(node, sym)
        return self.materialize(node)

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
        """The node's value: its op's rule from the table (rules/), or a refusal where there is none."""
        if node.target is operator.getitem:  # one result of an op that gives several
            x = self.arg(node.args[0])
            if x is PENDING:
                return self.materialize(node)
            return x[node.args[1]]
        c = Call.of(self, node)
        return RULES.get(c.name, no_rule)(c)


# ops that only reorder a tensor's dims: a made split view permuted is still one to select q from
_LAYOUT_ONLY = ("permute", "transpose", "t", "unsqueeze", "squeeze")


def _made(a: Any, split_from: set[Node]) -> bool:
    """`a` is a split view the prologue made (or a permute of one), not an argument to split."""
    return a in split_from and a.op != "placeholder"


def _lowers_rank(node: Node) -> bool:
    """A view whose result has fewer dims than its input (it merges some)."""
    val, src = node.meta.get("val"), getattr(node.args[0], "meta", {}).get("val")
    return val is not None and src is not None and val.dim() < src.dim()
