"""CuIR expressions to CUDA C expressions (values) and interval code (tiles).

Types follow the interpreter: indices and int scalars are 64-bit integers,
float work is fp32, except where a float64 tensor is read: arithmetic and
comparisons with it are float64 (kind "double"), as torch computes them (a
threshold of 64.0000001 is not 64); float functions of it take fp32.
Comparisons are bool. Integer // and % keep Python's floor semantics, as the
spec did.
"""
from __future__ import annotations

import math
import struct

from ..errors import UnsupportedSpec
from ..ir.expr import FLOAT_UNARY, ROW_LSE, Expr
from ..ir.program import Program

_SIZE = {"B": "a.B", "H": "a.Hq", "Hkv": "a.Hkv", "Sq": "a.Sq", "Skv": "a.Skv"}
_CMP = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}
_ARITH = {"add": "+", "sub": "-", "mul": "*"}
_FLOAT_DTYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16", "float64": "double"}
_INT_DTYPES = {"int64": "long long", "int32": "int", "int16": "short", "int8": "signed char",
               "uint8": "unsigned char", "bool": "bool"}


def ctype(dtype: str) -> str:
    if dtype in _FLOAT_DTYPES:
        return _FLOAT_DTYPES[dtype]
    if dtype in _INT_DTYPES:
        return _INT_DTYPES[dtype]
    raise UnsupportedSpec(f"extra tensors of dtype {dtype} are not supported by the kernel", op="lower")


def _widest(kinds: set[str]) -> str:
    """The kind two operands meet in: float64 over fp32 over integers."""
    return "double" if "double" in kinds else "float" if "float" in kinds else "int"


def _free_of(e: Expr, variables: tuple[str, ...], loads: bool) -> bool:
    """Reads none of `variables` (and, unless `loads`, no tensor) anywhere in e."""
    if e.op == "var":
        return e.attr not in variables
    if e.op == "load" and not loads:
        return False
    return all(_free_of(x, variables, loads) for x in e.args)


def _f32_around(v: float) -> tuple[float, float]:
    """The nearest fp32 values at or below and at or above v (equal where fp32 holds v)."""
    f = struct.unpack("f", struct.pack("f", v))[0]
    if f == v:
        return f, f
    bits = struct.unpack("i", struct.pack("f", f))[0]
    step = 1 if (f < v) == (f >= 0) else -1  # toward v in magnitude order of the bit pattern
    g = struct.unpack("f", struct.pack("i", bits + step))[0]
    return (f, g) if f < v else (g, f)


class CExpr:
    """Code generation for one program (knows its tensors, scalars, head dim)."""

    def __init__(self, p: Program, head_dim: int, fast_tanh: bool = False) -> None:
        self.p = p
        self.D = head_dim
        self.fast_tanh = fast_tanh
        self.extras = {x.name: x for x in p.extras}
        self.scalars = {s.name: s for s in p.scalars}

    # -- types -------------------------------------------------------------------
    def kind(self, e: Expr) -> str:
        op = e.op
        if op == "const":
            v = e.attr
            return "bool" if isinstance(v, bool) else ("int" if isinstance(v, int) else "float")
        if op == "var":
            return "float" if e.attr == "s" else "int"
        if op == "scalar":
            return self.scalars[e.attr].kind
        if op == "load":
            dt = self.extras[e.attr].dtype
            return "double" if dt == "float64" else "float" if dt in _FLOAT_DTYPES else ("bool" if dt == "bool" else "int")
        if op in _CMP or op in ("and", "or", "not", "to_bool"):
            return "bool"
        if op in ("div", "pow"):
            return "double" if "double" in {self.kind(x) for x in e.args} else "float"
        if op in FLOAT_UNARY or op == "to_float":
            return "float"
        if op == "to_int":
            return "int"
        if op == "where":
            ks = {self.kind(e.args[1]), self.kind(e.args[2])}
            return _widest(ks) if ks - {"bool"} else "bool"
        return _widest({self.kind(a) for a in e.args})

    # -- values ------------------------------------------------------------------
    def value(self, e: Expr) -> str:
        op, a = e.op, e.args
        if op == "const":
            v = e.attr
            if isinstance(v, bool):
                return "true" if v else "false"
            if isinstance(v, int):
                return f"{v}" if -2**31 <= v < 2**31 else f"{v}LL"
            if math.isinf(v):
                return "(-__int_as_float(0x7f800000))" if v < 0 else "__int_as_float(0x7f800000)"
            return f"{float(v)!r}f".replace("inff", "INF")
        if op == "var":
            if e.attr == "s":
                return "s"
            if e.attr in ("b", "h", "q", "kv"):
                return e.attr  # 32-bit index math: 64-bit integer ops are emulated on the GPU
            if e.attr == "D":
                return f"{self.D}"
            return f"(int){_SIZE[e.attr]}"
        if op == "scalar":
            s = self.scalars[e.attr]
            return f"(float)p.{e.attr}" if s.kind == "float" else f"(int)p.{e.attr}"
        if op == "load":
            return self.load(e)
        if op == "where":
            k = self.kind(e)
            x, y = self.as_kind(a[1], k), self.as_kind(a[2], k)
            return f"({self.as_kind(a[0], 'bool')} ? {x} : {y})"
        if op in _CMP:
            k = _widest({self.kind(a[0]), self.kind(a[1])})
            return f"({self.as_kind(a[0], k)} {_CMP[op]} {self.as_kind(a[1], k)})"
        if op in ("and", "or"):
            j = "&&" if op == "and" else "||"
            return f"({self.as_kind(a[0], 'bool')} {j} {self.as_kind(a[1], 'bool')})"
        if op == "not":
            return f"(!{self.as_kind(a[0], 'bool')})"
        if op == "neg":
            return f"(-{self.value(a[0])})"
        if op in _ARITH:
            k = self.kind(e)
            return f"({self.as_kind(a[0], k)} {_ARITH[op]} {self.as_kind(a[1], k)})"
        if op == "div":
            if self.kind(e) == "double":
                return f"({self.as_kind(a[0], 'double')} / {self.as_kind(a[1], 'double')})"
            if self.uniform(a[1]):  # a loop-invariant reciprocal: one multiply per element, not a divide
                return f"({self.as_kind(a[0], 'float')} * (1.0f / {self.as_kind(a[1], 'float')}))"
            return f"({self.as_kind(a[0], 'float')} / {self.as_kind(a[1], 'float')})"
        if op in ("floordiv", "mod"):
            if self.kind(e) == "int":
                fn = "cubridge::py_floordiv" if op == "floordiv" else "cubridge::py_mod"
                # one integer type for both operands (the template deduces one): 64-bit only where an
                # int64 tensor is read, since 64-bit division is emulated on the GPU
                t = "long long" if any(self._wide(x) for x in a) else "int"
                return f"{fn}<{t}>(({t})({self.value(a[0])}), ({t})({self.value(a[1])}))"
            k = self.kind(e)
            fl = "floor" if k == "double" else "floorf"
            x, y = self.as_kind(a[0], k), self.as_kind(a[1], k)
            return f"{fl}({x} / {y})" if op == "floordiv" else f"({x} - {fl}({x} / {y}) * {y})"
        if op in ("max", "min"):
            k = self.kind(e)
            if k in ("float", "double"):
                fn = ("fmax" if op == "max" else "fmin") + ("f" if k == "float" else "")
                return f"{fn}({self.as_kind(a[0], k)}, {self.as_kind(a[1], k)})"
            if k == "int":  # one integer type for both (min(long long, int) has no overload): 64-bit where an
                t = "long long" if any(self._wide(x) for x in a) else "int"  # int64 tensor is read
                return f"{op}(({t})({self.value(a[0])}), ({t})({self.value(a[1])}))"
            return f"{op}({self.as_kind(a[0], k)}, {self.as_kind(a[1], k)})"
        if op == "pow":
            k = self.kind(e)
            return f"{'pow' if k == 'double' else 'powf'}({self.as_kind(a[0], k)}, {self.as_kind(a[1], k)})"
        if op == "tanh":
            fn = "cubridge::tanh_fast" if self.fast_tanh else "tanhf"
            return f"{fn}({self.as_kind(a[0], 'float')})"
        unary = {"exp": "expf", "log": "logf", "sqrt": "sqrtf", "rsqrt": "rsqrtf", "abs": None, "floor": "floorf",
                 "sin": "sinf", "cos": "cosf", "exp2": "exp2f", "log2": "log2f", "log1p": "log1pf",
                 "expm1": "expm1f"}
        if op in unary:
            if op == "abs":
                k = self.kind(a[0])
                return f"{ {'float': 'fabsf', 'double': 'fabs'}.get(k, 'llabs') }({self.value(a[0])})"
            return f"{unary[op]}({self.as_kind(a[0], 'float')})"
        if op == "reciprocal":
            return f"(1.0f / {self.as_kind(a[0], 'float')})"
        if op == "sign":
            x = self.value(a[0])
            return f"(({x} > 0) - ({x} < 0))" if self.kind(a[0]) not in ("float", "double") else \
                f"(float)(({x} > 0.0f) - ({x} < 0.0f))"
        if op == "sigmoid":
            return f"(1.0f / (1.0f + expf(-{self.as_kind(a[0], 'float')})))"
        if op == "to_float":
            return self.as_kind(a[0], "float")
        if op == "to_int":
            return f"(int)({self.value(a[0])})"
        if op == "to_bool":
            return f"({self.value(a[0])} != 0)"
        raise UnsupportedSpec(f"no CUDA lowering for {op}", op="lower")

    def as_kind(self, e: Expr, k: str) -> str:
        src = self.kind(e)
        if k == "double" and src != "double":  # a Python number meets a float64 tensor: its own value, as torch's
            if e.op == "const" and not isinstance(e.attr, bool):
                return repr(float(e.attr)) if not math.isinf(float(e.attr)) else self.value(e)
            if e.op == "scalar" and self.scalars[e.attr].kind == "float":
                return f"p.{e.attr}"
            return f"(double)({self.value(e)})"
        v = self.value(e)
        if src == k:
            return v
        if k == "float":
            return f"(float)({v})"
        if k == "int":
            return f"(int)({v})"
        return f"({v} != 0)"

    def load(self, e: Expr) -> str:
        x = self.extras[e.attr]
        off = " + ".join(f"{self.index(x.name, d, i)} * p.{x.name}_s{d}" for d, i in enumerate(e.args)) or "0"
        ptr = f"&p.{x.name}[{off}]"
        if x.dtype == "bool":  # __ldg has no bool overload: read the byte
            ptr = f"reinterpret_cast<const unsigned char*>({ptr})"
        raw = f"__ldg({ptr})"  # read-only path; lets the compiler hoist per-head loads
        if x.dtype == "bfloat16":
            return f"__bfloat162float({raw})"
        if x.dtype == "float16":
            return f"__half2float({raw})"
        if x.dtype == "bool":
            return f"({raw} != 0)"
        return raw

    def index(self, name: str, d: int, i: Expr) -> str:
        """An index as a 64-bit int; one read from data is wrapped and clamped into the tensor (bounds.py)."""
        from ..ir.bounds import reads_data
        v = f"(long long)({self.as_kind(i, 'int')})"
        return f"cubridge::cb_index({v}, p.{name}_n{d})" if reads_data(i) else v

    def _wide(self, e: Expr) -> bool:
        """Reads an int64 tensor somewhere below (its values may not fit 32 bits)."""
        if e.op == "load" and self.extras[e.attr].dtype == "int64":
            return True
        return any(self._wide(x) for x in e.args)

    def uniform(self, e: Expr) -> bool:
        """No per-element dependence: only scalars, constants and sizes."""
        return _free_of(e, ("s", "b", "h", "q", "kv"), loads=False)

    def _tile_free(self, e: Expr) -> bool:
        """Depends on neither the tile's queries nor its keys (nor the score or a row's LSE): the same value in
        every element of a tile, whose block_class call knows b and h. ir/interval.py keeps loads unknown: a
        program whose mask loads data is classed by evaluation there (the pre-pass rule), never by intervals."""
        return _free_of(e, ("s", "q", "kv", ROW_LSE), loads=True)

    # -- intervals over a tile -------------------------------------------------------
    def interval(self, e: Expr, loads: dict[Expr, str] | None = None) -> str:
        """Interval code over the tile. `loads` names runtime bounds (an Iv) for some load sites."""
        op, a = e.op, e.args
        if loads and op == "load" and e in loads:
            return loads[e]
        iv = lambda x: self.interval(x, loads)  # noqa: E731
        if op == "const":
            v = float(e.attr)
            if math.isinf(v):
                return "cubridge::iv_unknown()"
            lo, hi = _f32_around(v)  # an fp32 pair holding v: the kernel may compare it in float64
            return f"cubridge::iv({lo!r}f)" if lo == hi else f"cubridge::iv({lo!r}f, {hi!r}f)"
        if op == "var":
            return {"q": "cubridge::iv(q_lo, q_hi - 1)", "kv": "cubridge::iv(kv_lo, kv_hi - 1)",
                    "b": "cubridge::iv(b)", "h": "cubridge::iv(h)"}.get(e.attr) or f"cubridge::iv((float){self.value(e)})"
        if op == "scalar":  # a float one may meet a float64 value: a point only where fp32 holds it exactly
            return f"cubridge::iv_exact(p.{e.attr})" if self.scalars[e.attr].kind == "float" else \
                f"cubridge::iv((float)p.{e.attr})"
        if op == "load" and self._tile_free(e):  # one value over the tile (len[b]): read it, a point
            return f"cubridge::iv_exact((double)({self.value(e)}))"
        if op in ("load", "s"):
            return "cubridge::iv_bool_unknown()" if self.kind(e) == "bool" else "cubridge::iv_unknown()"
        if op in ("floordiv", "mod") and a[1].op == "const" and isinstance(a[1].attr, int) and a[1].attr > 0:
            return f"cubridge::iv_{op}({iv(a[0])}, {float(a[1].attr)!r}f)"
        if op in ("add", "sub", "mul", "max", "min", "and", "or", "lt", "le", "gt", "ge", "eq", "ne"):
            return f"cubridge::iv_{op}({iv(a[0])}, {iv(a[1])})"
        if op in ("neg", "not", "abs"):
            return f"cubridge::iv_{op}({iv(a[0])})"
        if op in ("to_float", "to_int"):
            return iv(a[0])
        if op == "where":
            return f"cubridge::iv_where({', '.join(iv(x) for x in a)})"
        return "cubridge::iv_bool_unknown()" if self.kind(e) == "bool" else "cubridge::iv_unknown()"
