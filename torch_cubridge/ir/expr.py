"""CuIR expressions: one small immutable node type.

An `Expr` is an op name, its operands and an optional attribute. The same node
type serves score expressions, mask predicates, load indices and derived
scalars, so every pass (printing, JSON, interval analysis, interpretation,
CUDA lowering) walks one structure.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

# Index variables a CuIR expression may read. `s` is the raw q.k dot product.
INDEX_VARS = ("b", "h", "q", "kv")
SIZE_VARS = ("B", "H", "Hkv", "Sq", "Skv", "D")
# The variable a row scale reads for its row's natural-log LSE of the scores, which the kernel writes
# (Program.row_scale; a sink logit per query row).
ROW_LSE = "lse"
VARS = ("s",) + INDEX_VARS + SIZE_VARS + (ROW_LSE,)

# FLOAT_UNARY: float results, in fp32 on the kernel as in the interpreter
FLOAT_UNARY = {"tanh", "exp", "log", "sqrt", "rsqrt", "sigmoid", "sin", "cos", "exp2", "log2", "log1p", "expm1",
               "reciprocal"}
UNARY = FLOAT_UNARY | {"neg", "abs", "not", "floor", "sign", "to_float", "to_int", "to_bool"}
BINARY = {"add", "sub", "mul", "div", "floordiv", "mod", "max", "min", "pow",
          "eq", "ne", "lt", "le", "gt", "ge", "and", "or"}
COMPARE = {"eq", "ne", "lt", "le", "gt", "ge"}
# "dim" (attr "path:i", size i of a call argument) and "arg" (attr path, a Python
# scalar argument) appear only in guards: predicates over the call, not the tile.
LEAVES = {"const", "var", "scalar", "dim", "arg"}
OPS = UNARY | BINARY | LEAVES | {"where", "load"}
CANON = ("b", "h", "s", "d")  # canonical operand dims: batch, head, sequence, head dim


@dataclass(frozen=True)
class Expr:
    op: str
    args: tuple["Expr", ...] = ()
    attr: Any = None  # const value, var/scalar/tensor name

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"unknown CuIR op {self.op!r}")

    # -- JSON ------------------------------------------------------------
    def to_obj(self) -> Any:
        if self.op == "const":
            v = self.attr
            if isinstance(v, float) and not math.isfinite(v):
                v = repr(v)  # "inf" / "-inf" / "nan" survive JSON as strings
            return {"const": v}
        if self.op in ("var", "scalar", "dim", "arg") and not self.args:
            return {self.op: self.attr}
        d: dict[str, Any] = {"op": self.op, "args": [a.to_obj() for a in self.args]}
        if self.attr is not None:
            d["attr"] = self.attr
        return d

    @staticmethod
    def from_obj(o: Any) -> "Expr":
        if "const" in o:
            v = o["const"]
            if isinstance(v, str) and v in ("inf", "-inf", "nan"):
                v = float(v)  # a guard's string argument value stays a string
            return Expr("const", (), v)
        for leaf in ("var", "scalar", "dim", "arg"):
            if leaf in o:
                return Expr(leaf, (), o[leaf])
        return Expr(o["op"], tuple(Expr.from_obj(a) for a in o["args"]), o.get("attr"))

    def __str__(self) -> str:
        return render(self)


def const(v: Any) -> Expr:
    return Expr("const", (), v)


def var(name: str) -> Expr:
    assert name in VARS, name
    return Expr("var", (), name)


def scalar(name: str) -> Expr:
    return Expr("scalar", (), name)


def dim(path: str, index: int) -> Expr:
    return Expr("dim", (), f"{path}:{index}")


def arg(path: str, *default: Any) -> Expr:
    """A Python argument's value; with a default, the value when the call leaves it out."""
    return Expr("arg", tuple(const(d) for d in default), path)


def load(tensor: str, *index: Expr) -> Expr:
    return Expr("load", tuple(index), tensor)


def call(op: str, *args: Expr) -> Expr:
    return Expr(op, tuple(args))


def where(c: Expr, a: Expr, b: Expr) -> Expr:
    return Expr("where", (c, a, b))


def walk(e: Expr):
    """Yield every node, parents first."""
    yield e
    for a in e.args:
        yield from walk(a)


def rewrite(e: Expr, fn: Callable[[Expr], Expr | None]) -> Expr:
    """Bottom-up rewrite: fn returns a replacement or None to keep the node."""
    new_args = tuple(rewrite(a, fn) for a in e.args)
    node = e if new_args == e.args else Expr(e.op, new_args, e.attr)
    out = fn(node)
    return node if out is None else out


def substitute(e: Expr, mapping: dict[str, Expr]) -> Expr:
    """Replace variables by expressions."""
    return rewrite(e, lambda n: mapping.get(n.attr) if n.op == "var" else None)


def free_vars(e: Expr) -> set[str]:
    return {n.attr for n in walk(e) if n.op == "var"}


def loads(e: Expr) -> set[str]:
    return {n.attr for n in walk(e) if n.op == "load"}


def scalars(e: Expr) -> set[str]:
    return {n.attr for n in walk(e) if n.op == "scalar"}


_INFIX = {"add": "+", "sub": "-", "mul": "*", "div": "/", "floordiv": "//", "mod": "%",
          "eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">=",
          "and": "&", "or": "|", "pow": "**"}


def render(e: Expr) -> str:
    """Readable one-line text form."""
    if e.op == "const":
        return repr(e.attr)
    if e.op in ("var", "scalar"):
        return str(e.attr) if e.op == "var" else f"${e.attr}"
    if e.op == "dim":
        path, _, i = e.attr.rpartition(":")
        return f"{path}.shape[{i}]"
    if e.op == "arg":
        return str(e.attr)
    if e.op == "load":
        return f"{e.attr}[{', '.join(render(a) for a in e.args)}]"
    if e.op in _INFIX:
        return f"({render(e.args[0])} {_INFIX[e.op]} {render(e.args[1])})"
    if e.op == "neg":
        return f"-{render(e.args[0])}"
    if e.op == "not":
        return f"~{render(e.args[0])}"
    return f"{e.op}({', '.join(render(a) for a in e.args)})"
