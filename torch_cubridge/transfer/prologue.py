"""Pass: values of the spec that do not depend on q.k, left for PyTorch to compute.

When the symbolic walk meets an op it has no rule for (or a gather of a computed table, or a
matmul that is not q.k), and the value does not depend on the scores, the node and everything
it reads become prologue steps: the spec's own aten calls, replayed on each call's tensors
(ir/prologue.py). Its result enters the program as one more extra tensor.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
from torch.fx import Node

from ..errors import UnsupportedSpec
from ..ir.program import Step
from ..ir.prologue import needed_steps


class Prologue:
    """The steps recorded so far, in graph order, and what each placeholder reads."""

    def __init__(self, placeholder_paths: dict[Node, str], const_values: dict[Node, tuple[str | None, Any]]) -> None:
        self.paths = placeholder_paths      # placeholder node -> call argument path
        self.consts = const_values          # get_attr node -> (owner path or None, tensor)
        self.steps: dict[str, Step] = {}    # by step name, in the order they were made
        # a float dtype the capture saw on an argument is that argument's dtype: a cast to bfloat16 in
        # a bf16 capture (rms_norm casts back) is a cast to float64 when verification runs in float64
        self.dtype_of: dict[torch.dtype, str] = {}
        for n, path in placeholder_paths.items():
            val = n.meta.get("val")
            if isinstance(val, torch.Tensor) and val.dtype.is_floating_point:
                self.dtype_of.setdefault(val.dtype, path)

    def record(self, node: Node) -> str:
        """Steps computing `node` (and what it reads that is not recorded yet); its step name."""
        for dep in cone_of(node):
            if mutates_input(dep):  # replaying it would change the caller's tensor on every call
                raise UnsupportedSpec("an in-place op on an argument, off the score path", op="prologue")
            if dep.name not in self.steps:
                self.steps[dep.name] = self.step_for(dep)
        return node.name

    def record_view(self, node: Node, shape: tuple[int, ...]) -> str:
        """Steps computing `node`, then its value reshaped to `shape` (merged dims unflattened, unit dims
        dropped; a copy where a permuted value has no such view); the last step's name."""
        self.record(node)
        name = f"{node.name}_atoms"
        self.steps.setdefault(name, Step(name, "aten.reshape.default", (("@step", node.name), shape), ()))
        return name

    def record_by_distance(self, diff: Node, sign: int, chain: list[Node], sq: int, skv: int) -> str:
        """Steps computing `chain` (diff's elementwise descendants, in graph order) on the Sq + Skv - 1
        distances instead of diff's grid (symbolic/distance.py); the last one's step name. Entry t of the
        distances is t - (Sq - 1) where diff is col - row, (Sq - 1) - t where it is row - col."""
        base = f"{diff.name}_dist"
        start, end, step = (1 - sq, skv, 1) if sign > 0 else (sq - 1, -skv, -1)
        dtype = self.encode(diff.meta["val"].dtype)
        self.steps.setdefault(base + "_range", Step(base + "_range", "aten.arange.start_step", (start, end, step),
                                                    (("dtype", dtype), ("device", ("@device",)))))
        self.steps.setdefault(base, Step(base, "aten.unsqueeze.default", (("@step", base + "_range"), 0), ()))
        renamed = {diff: base}
        for n in chain:
            for a in n.all_input_nodes:  # what the chain reads besides diff's descendants: as recorded
                if a not in renamed and a.op == "call_function":
                    self.record(a)
            renamed[n] = f"{n.name}_dist"
            self.steps.setdefault(renamed[n], self.step_for(n, renamed))
        return renamed[chain[-1]]

    def step_for(self, node: Node, renamed: dict[Node, str] | None = None) -> Step:
        """`node` as a step: its aten op and arguments, the nodes it reads named by their steps (those in
        `renamed` by the names given there, the node's own too)."""
        return Step((renamed or {}).get(node, node.name), op_name(node),
                    tuple(self.encode(a, renamed) for a in node.args),
                    tuple((k, self.encode(v, renamed)) for k, v in node.kwargs.items()))

    def reads_arguments_only(self, node: Node) -> bool:
        """Every tensor `node` reads comes from the call (an argument or a tensor an argument holds),
        none is baked into the program."""
        return all(self.consts[a][0] is not None for dep in cone_of(node) for a in dep.all_input_nodes
                   if a.op == "get_attr")

    def needed(self, names: set[str]) -> tuple[Step, ...]:
        """The steps the named results need, in order."""
        return needed_steps(tuple(self.steps.values()), names)

    def encode(self, x: Any, renamed: dict[Node, str] | None = None) -> Any:
        """A step argument: nodes as tagged references (see Step), literals as they are."""
        if isinstance(x, Node):
            if renamed and x in renamed:
                return ("@step", renamed[x])
            if x.op == "placeholder":
                return ("@arg", self.paths[x])
            if x.op == "get_attr":
                owner, t = self.consts[x]
                return ("@arg", owner) if owner else ("@const", str(t.dtype).replace("torch.", ""), _tuples(t.tolist()))
            return ("@step", x.name)
        if isinstance(x, (list, tuple)):
            return tuple(self.encode(i, renamed) for i in x)
        if isinstance(x, torch.dtype):
            if x in self.dtype_of:
                return ("@dtype_of", self.dtype_of[x])
            return ("@dtype", str(x).replace("torch.", ""))
        if isinstance(x, torch.device):
            return ("@device",)
        if isinstance(x, torch.layout):
            return ("@layout", str(x).replace("torch.", ""))
        if isinstance(x, torch.memory_format):
            return ("@memory_format", str(x).replace("torch.", ""))
        if x is None or isinstance(x, (bool, int, float, str)):
            if isinstance(x, str) and x.startswith("@"):
                raise UnsupportedSpec("a string argument the prologue cannot record", op="prologue")
            return x
        raise UnsupportedSpec(f"an argument of type {type(x).__name__} the prologue cannot record", op="prologue")


def cone_of(node: Node | list[Node], stop: frozenset[Node] = frozenset()) -> list[Node]:
    """The call nodes `node` (or each of a list) depends on, itself last, in an order that runs; none
    past a node in `stop`."""
    seen: set[Node] = set()
    out: list[Node] = []

    def visit(n: Node) -> None:
        if n in seen or n.op != "call_function" or n in stop:
            return
        seen.add(n)
        for a in n.all_input_nodes:
            visit(a)
        out.append(n)
    for root in node if isinstance(node, list) else [node]:
        visit(root)
    return out


def mutates_input(n: Node) -> bool:
    """An in-place aten op (its schema writes its first argument) on a call argument or constant."""
    t = n.target
    if not isinstance(t, torch._ops.OpOverload) or not n.args or not isinstance(n.args[0], Node):
        return False
    writes = any(a.alias_info is not None and a.alias_info.is_write for a in t._schema.arguments)
    return writes and n.args[0].op in ("placeholder", "get_attr")


def op_name(n: Node) -> str:
    t = n.target
    if t is operator.getitem:
        return "getitem"
    if isinstance(t, torch._ops.OpOverload):
        return f"{t.namespace}.{t._opname}.{t._overloadname}"
    raise UnsupportedSpec(f"the prologue cannot replay {t}", op="prologue")


def _tuples(x: Any) -> Any:
    return tuple(_tuples(i) for i in x) if isinstance(x, list) else x
