"""Small integer functions written in Python, rendered to C for the host module (build/host.py).

A launch rule (how many splits a decode call takes, the page-division word, whether a tensor's rows are
aligned for the kernel's copies) is written once, as a plain Python function that the Python runner calls,
and this module renders that function's own source to C for the C launch path: one source, two languages,
no copy to drift.

The subset is what such rules need and nothing more:
  - parameters annotated `int`, `bool` or `tuple[int, ...]` (a tuple becomes `const long long *`), defaults
    allowed; the return annotated `int`, `bool` or `tuple[int, int]` (a tuple returns through out-pointers);
  - statements: a docstring, `name = expr`, `name += expr` (and -=, *=), `if`/`elif`/`else`, `return`,
    `a, b = rule(...)` of a tuple-returning rule;
  - expressions: int literals, names, `t[i]` of a tuple parameter at a literal index, + - * // % << >> | &,
    unary -, `not`, comparisons (chained too), `and`/`or`, `x if c else y`, `max`/`min`, `x.bit_length()`,
    calls of other rules rendered alongside.
All integers are C `long long`; `//` and `%` keep Python's floor semantics (cb_floordiv, cb_mod), so a rule
means the same in both languages for every value that fits 64 bits. Anything else raises CodegenError
naming the construct.
"""
from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Callable

PRELUDE = """\
static inline long long cb_floordiv(long long a, long long b) {
    long long q = a / b;
    return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}
static inline long long cb_mod(long long a, long long b) {
    long long r = a % b;
    return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}
static inline long long cb_max(long long a, long long b) { return a > b ? a : b; }
static inline long long cb_min(long long a, long long b) { return a < b ? a : b; }
static inline long long cb_bit_length(long long x) {
    unsigned long long u = x < 0 ? 0ULL - (unsigned long long)x : (unsigned long long)x;
    return u ? 64 - __builtin_clzll(u) : 0;
}
"""

_BIN = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.LShift: "<<", ast.RShift: ">>", ast.BitOr: "|",
        ast.BitAnd: "&", ast.BitXor: "^"}
_CMP = {ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">="}


class CodegenError(ValueError):
    pass


def _kind(ann: ast.expr | None, where: str) -> str:
    """"int", "bool", "tuple" (a tuple of ints), or "pair" (tuple[int, int], a return)."""
    text = ast.unparse(ann) if ann is not None else ""
    if text in ("int", "bool"):
        return text
    if text == "tuple[int, int]":
        return "pair"
    if text.startswith("tuple[int"):
        return "tuple"
    raise CodegenError(f"{where}: annotate as int, bool or a tuple of ints (got {text or 'nothing'})")


class _Func:
    """One rule: its name, parameters (name, kind, default) and return kind, from its source."""

    def __init__(self, fn: Callable) -> None:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        node = tree.body[0]
        if not isinstance(node, ast.FunctionDef):
            raise CodegenError(f"{fn.__name__}: not a plain function")
        self.name, self.node = node.name, node
        a = node.args
        if a.vararg or a.kwarg or a.kwonlyargs or a.posonlyargs:
            raise CodegenError(f"{self.name}: positional parameters only")
        defaults = [None] * (len(a.args) - len(a.defaults)) + list(a.defaults)
        self.params = []
        for p, d in zip(a.args, defaults):
            kind = _kind(p.annotation, f"{self.name}({p.arg})")
            if d is not None and not (isinstance(d, ast.Constant) and type(d.value) in (int, bool)):
                raise CodegenError(f"{self.name}({p.arg}): a default must be an int literal")
            self.params.append((p.arg, kind, None if d is None else int(d.value)))
        self.ret = _kind(node.returns, f"{self.name} -> ")
        if self.ret == "tuple":
            raise CodegenError(f"{self.name}: returns int, bool or tuple[int, int]")

    def signature(self) -> str:
        args = [f"const long long *{n}" if k == "tuple" else f"long long {n}" for n, k, _ in self.params]
        if self.ret == "pair":
            return f"static inline void {self.name}({', '.join(args + ['long long *ret0', 'long long *ret1'])})"
        return f"static inline long long {self.name}({', '.join(args) or 'void'})"


class _Render:
    def __init__(self, f: _Func, funcs: dict[str, _Func]) -> None:
        self.f, self.funcs = f, funcs
        self.tuples = {n for n, k, _ in f.params if k == "tuple"}
        self.locals: list[str] = []

    def fail(self, node: ast.AST, what: str) -> CodegenError:
        return CodegenError(f"{self.f.name}, line {getattr(node, 'lineno', '?')}: {what}: {ast.unparse(node)}")

    # -- statements ----------------------------------------------------------------
    def body(self, stmts: list[ast.stmt], depth: int) -> list[str]:
        pad, out = "    " * depth, []
        for s in stmts:
            if isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant) and isinstance(s.value.value, str):
                continue  # a docstring
            if isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.targets[0], ast.Name):
                out.append(f"{pad}{self.local(s.targets[0])} = {self.expr(s.value)};")
            elif isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.targets[0], ast.Tuple):
                names = [self.local(t) if isinstance(t, ast.Name) else None for t in s.targets[0].elts]
                if len(names) != 2 or None in names:
                    raise self.fail(s, "unpack two names only")
                out.append(f"{pad}{self.pair_call(s.value, f'&{names[0]}, &{names[1]}')};")
            elif isinstance(s, ast.AugAssign) and isinstance(s.target, ast.Name) and type(s.op) in _BIN:
                out.append(f"{pad}{self.local(s.target)} {_BIN[type(s.op)]}= {self.expr(s.value)};")
            elif isinstance(s, ast.If):
                out.append(f"{pad}if ({self.expr(s.test)}) {{")
                out += self.body(s.body, depth + 1)
                if s.orelse:
                    out.append(f"{pad}}} else {{")
                    out += self.body(s.orelse, depth + 1)
                out.append(f"{pad}}}")
            elif isinstance(s, ast.Return) and s.value is not None:
                out += self.ret(s.value, pad)
            else:
                raise self.fail(s, "no C rendering for this statement")
        return out

    def local(self, t: ast.Name) -> str:
        if t.id in {n for n, _, _ in self.f.params}:
            raise self.fail(t, "parameters are not reassigned")
        if t.id not in self.locals:
            self.locals.append(t.id)
        return t.id

    def ret(self, v: ast.expr, pad: str) -> list[str]:
        if self.f.ret != "pair":
            return [f"{pad}return {self.expr(v)};"]
        if isinstance(v, ast.Tuple) and len(v.elts) == 2:
            return [f"{pad}*ret0 = {self.expr(v.elts[0])};", f"{pad}*ret1 = {self.expr(v.elts[1])};",
                    f"{pad}return;"]
        return [f"{pad}{self.pair_call(v, 'ret0, ret1')};", f"{pad}return;"]

    def pair_call(self, v: ast.expr, outs: str) -> str:
        if not (isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id in self.funcs
                and self.funcs[v.func.id].ret == "pair"):
            raise self.fail(v, "a pair comes from a rule that returns tuple[int, int]")
        return f"{v.func.id}({self.call_args(v, self.funcs[v.func.id])}, {outs})"

    # -- expressions ---------------------------------------------------------------
    def expr(self, e: ast.expr) -> str:
        if isinstance(e, ast.Constant) and type(e.value) in (int, bool):
            return f"{int(e.value)}LL"
        if isinstance(e, ast.Name):
            if e.id in self.tuples:
                raise self.fail(e, "a tuple parameter is read by index")
            return e.id
        if isinstance(e, ast.Subscript) and isinstance(e.value, ast.Name) and e.value.id in self.tuples:
            if not (isinstance(e.slice, ast.Constant) and type(e.slice.value) is int and e.slice.value >= 0):
                raise self.fail(e, "index a tuple parameter with a literal")
            return f"{e.value.id}[{e.slice.value}]"
        if isinstance(e, ast.BinOp) and isinstance(e.op, ast.Pow):  # of literals only: folded here
            if not all(isinstance(x, ast.Constant) and type(x.value) is int for x in (e.left, e.right)):
                raise self.fail(e, "** of int literals only")
            return f"{e.left.value ** e.right.value}LL"
        if isinstance(e, ast.BinOp):
            x, y = self.expr(e.left), self.expr(e.right)
            if isinstance(e.op, ast.FloorDiv):
                return f"cb_floordiv({x}, {y})"
            if isinstance(e.op, ast.Mod):
                return f"cb_mod({x}, {y})"
            if type(e.op) in _BIN:
                return f"({x} {_BIN[type(e.op)]} {y})"
        if isinstance(e, ast.UnaryOp):
            if isinstance(e.op, ast.USub):
                return f"(-{self.expr(e.operand)})"
            if isinstance(e.op, ast.Not):
                return f"(!{self.expr(e.operand)})"
        if isinstance(e, ast.BoolOp):
            j = " && " if isinstance(e.op, ast.And) else " || "
            return "(" + j.join(self.expr(v) for v in e.values) + ")"
        if isinstance(e, ast.Compare) and all(type(o) in _CMP for o in e.ops):
            terms, left = [], e.left
            for op, right in zip(e.ops, e.comparators):
                terms.append(f"{self.expr(left)} {_CMP[type(op)]} {self.expr(right)}")
                left = right
            return "(" + " && ".join(terms) + ")"
        if isinstance(e, ast.IfExp):
            return f"({self.expr(e.test)} ? {self.expr(e.body)} : {self.expr(e.orelse)})"
        if isinstance(e, ast.Call) and not e.keywords:
            return self.call(e)
        raise self.fail(e, "no C rendering for this expression")

    def call(self, e: ast.Call) -> str:
        fn = e.func
        if isinstance(fn, ast.Name) and fn.id in ("max", "min") and len(e.args) >= 2:
            out = self.expr(e.args[0])
            for a in e.args[1:]:
                out = f"cb_{fn.id}({out}, {self.expr(a)})"
            return out
        if isinstance(fn, ast.Attribute) and fn.attr == "bit_length" and not e.args:
            return f"cb_bit_length({self.expr(fn.value)})"
        if isinstance(fn, ast.Name) and fn.id in self.funcs and self.funcs[fn.id].ret != "pair":
            return f"{fn.id}({self.call_args(e, self.funcs[fn.id])})"
        raise self.fail(e, "calls only max, min, bit_length and other rules")

    def call_args(self, e: ast.Call, callee: _Func) -> str:
        if len(e.args) > len(callee.params):
            raise self.fail(e, "too many arguments")
        out = []
        for i, (name, kind, default) in enumerate(callee.params):
            if i < len(e.args):
                a = e.args[i]
                if kind == "tuple":
                    if not (isinstance(a, ast.Name) and a.id in self.tuples):
                        raise self.fail(e, "a tuple argument passes a tuple parameter on")
                    out.append(a.id)
                else:
                    out.append(self.expr(a))
            elif default is not None:
                out.append(f"{default}LL")
            else:
                raise self.fail(e, f"no value for {name}")
        return ", ".join(out)


def render(rules: list[Callable]) -> str:
    """C for `rules` (plain Python functions in the subset above), each a `static inline` function of the same
    name and meaning, after the prelude's helpers; prototypes first, so rules may call one another in any
    order."""
    funcs = {f.name: f for f in map(_Func, rules)}
    protos, bodies = [], []
    for f in funcs.values():
        r = _Render(f, funcs)
        lines = r.body(f.node.body, 1)
        decl = [f"    long long {', '.join(r.locals)};"] if r.locals else []
        protos.append(f.signature() + ";")
        bodies.append("\n".join([f.signature() + " {"] + decl + lines + ["}"]))
    return PRELUDE + "\n".join(protos) + "\n\n" + "\n\n".join(bodies) + "\n"
