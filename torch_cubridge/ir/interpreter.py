"""The CuIR interpreter: executes a program the way the kernel does.

Query tiles, a loop over key blocks that skips empty ones and skips the mask
on full ones, online softmax, final normalisation. It never builds the full
score matrix. Runs on any device; float64 inputs compute in float64.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: Program.run and str() call into this module
    from .program import Program

import contextlib
import math
from typing import Any

import torch

from .bind import as_result, bind_args, call_device, extra_tensors, head_index, operand_value, scalar_values, sizes_of, to_canonical
from .expr import COMPARE, FLOAT_UNARY, ROW_LSE, Expr
from .interval import classify_tile
from .prologue import run_epilogue, run_prologue

BLOCK_M = 64
BLOCK_N = 64

# Steps the interpreter takes, named as the expert kernel's @cuir annotations name
# them; tests compare this with the lifted reference so the two cannot drift.
_TRACE: list[str] | None = None


@contextlib.contextmanager
def tracing():
    """Record the orchestration steps of the next runs: `with tracing() as steps: p.run(...)`."""
    global _TRACE
    _TRACE = []
    try:
        yield _TRACE
    finally:
        _TRACE = None


def _step(name: str) -> None:
    if _TRACE is not None:
        _TRACE.append(name)


# Ops whose result jumps where a float operand crosses a boundary (an integer, a threshold). The kernel
# computes their float operands in float32 (lower/cexpr.py: floorf, (int) of a float, compares against
# 0.1f), and at a boundary float32 and float64 land on different sides (T5's log-spaced buckets). So the
# float maths under them runs in float32 here too, even in a float64 run: a float64 verdict must judge the
# integers and predicates the kernel makes. Continuous maths stays in the run's dtype. A where's condition,
# a load's indices and a mask (evaluated to bool) are the same kind of boundary.
_DISCRETE = COMPARE | {"floor", "to_int", "to_bool", "sign", "floordiv", "mod", "not", "and", "or"}
DISCRETE_FDT = torch.float32


def _tensor(x: Any, dt: torch.dtype) -> torch.Tensor:
    """x as a tensor; a Python float in dt (torch.as_tensor would make it float32, and a float64 run would
    compute with its constants rounded to float32)."""
    return torch.tensor(x, dtype=dt) if isinstance(x, float) else torch.as_tensor(x)


def _promote(x: Any, y: Any, fdt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Both operands as tensors in the float dtype they meet in: float64 where either is a float64 tensor
    (a loaded one: the kernel computes with it in float64, with a constant's own value, as torch), else fdt."""
    def is_f(z: Any) -> bool:
        return isinstance(z, float) or (isinstance(z, torch.Tensor) and z.is_floating_point())
    if not (is_f(x) or is_f(y)):
        return torch.as_tensor(x), torch.as_tensor(y)
    dt = torch.float64 if any(isinstance(z, torch.Tensor) and z.dtype == torch.float64 for z in (x, y)) else fdt
    return tuple(z.to(dt) if isinstance(z, torch.Tensor) else torch.tensor(float(z), dtype=dt) for z in (x, y))


def evaluate(e: Expr, env: dict[str, Any], fdt: torch.dtype) -> Any:
    """Evaluate over broadcastable tensors. env: vars, "$name" scalars, "@name" tensors."""
    op, a = e.op, e.args
    if op in _DISCRETE:
        fdt = DISCRETE_FDT
    if op == "const":
        return e.attr
    if op == "var":
        return env[e.attr]
    if op == "scalar":
        return env["$" + e.attr]
    if op == "load":
        t = env["@" + e.attr]
        idx = [torch.as_tensor(evaluate(i, env, DISCRETE_FDT)).long() for i in a]
        idx = torch.broadcast_tensors(*idx)
        out = t[tuple(idx)]
        return out.to(fdt) if out.is_floating_point() and out.dtype != torch.float64 else out
    if op == "where":
        c = torch.as_tensor(evaluate(a[0], env, DISCRETE_FDT)).bool()
        x, y = _promote(evaluate(a[1], env, fdt), evaluate(a[2], env, fdt), fdt)
        return torch.where(c, x, y)
    xs = [evaluate(x, env, fdt) for x in a]
    if len(xs) == 1:
        x = _tensor(xs[0], fdt)
        if op in FLOAT_UNARY:
            x = x.to(fdt)
        return {
            "neg": lambda: -x, "tanh": lambda: torch.tanh(x), "exp": lambda: torch.exp(x),
            "log": lambda: torch.log(x), "abs": lambda: torch.abs(x), "sqrt": lambda: torch.sqrt(x),
            "rsqrt": lambda: torch.rsqrt(x), "sigmoid": lambda: torch.sigmoid(x),
            "not": lambda: ~x.bool(), "floor": lambda: torch.floor(x),
            "sin": lambda: torch.sin(x), "cos": lambda: torch.cos(x), "exp2": lambda: torch.exp2(x),
            "log2": lambda: torch.log2(x), "log1p": lambda: torch.log1p(x), "expm1": lambda: torch.expm1(x),
            "reciprocal": lambda: torch.reciprocal(x), "sign": lambda: torch.sign(x),
            "to_float": lambda: x.to(fdt), "to_int": lambda: x.long() if x.is_floating_point() else x.long(),
            "to_bool": lambda: x.bool(),
        }[op]()
    x, y = _promote(xs[0], xs[1], fdt)
    if op in ("and", "or"):
        return (x.bool() & y.bool()) if op == "and" else (x.bool() | y.bool())
    fn = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.true_divide,
          "floordiv": torch.floor_divide, "mod": torch.remainder, "max": torch.maximum,
          "min": torch.minimum, "pow": torch.pow, "eq": torch.eq, "ne": torch.ne,
          "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge}[op]
    if op == "div" and not x.is_floating_point() and not y.is_floating_point():
        x = x.to(fdt)
    return fn(x, y)


def run_program(p: Program, /, *args: Any, **kwargs: Any) -> Any:
    return run_bound_program(p, bind_args(p.signature, args, kwargs))


def run_bound_program(p: Program, bound: dict[str, Any], core: torch.dtype | None = None) -> Any:
    """The program on bound arguments. core: the dtype the attention runs in after the prologue (None:
    float64 for float64 operands, float32 otherwise, as the kernel; float64 on operands a prologue made
    in a half dtype is the exact attention of what the kernel reads)."""
    made = run_prologue(p, bound, call_device(bound))
    q = to_canonical(operand_value(bound, p.q, made), p.q)
    k = to_canonical(operand_value(bound, p.k, made), p.k)
    v = to_canonical(operand_value(bound, p.v, made), p.v)
    out_dtype = q.dtype
    fdt = core or (torch.float64 if q.dtype == torch.float64 else torch.float32)
    sizes = sizes_of(p, q, k)
    B, H, Sq, D = q.shape
    Skv = sizes["Skv"]
    # query head h reads KV head hk[h]: gathered per key block, as the kernel maps indices (a gather of
    # the whole cache in float64 took 1 GB and most of a paged decode's verification)
    hk = head_index(p, H, sizes["Hkv"]).to(q.device)
    k = k.to(fdt)
    v = v.to(fdt)
    q = q.to(fdt)
    scal = scalar_values(p, bound, sizes)
    dev = q.device
    env = index_env(sizes, scal, extra_tensors(p, bound, dev, made), B, H, dev)
    box = {k2: (float(x), float(x)) for k2, x in sizes.items()}
    box.update({n: (float(x), float(x)) for n, x in scal.items()})
    box.update({"b": (0.0, B - 1.0), "h": (0.0, H - 1.0)})

    Dv = v.shape[-1]  # the value head dim may differ from the query's
    out = torch.zeros(B, H, Sq, Dv, dtype=fdt, device=dev)
    lse = torch.empty(B, H, Sq, 1, dtype=fdt, device=dev)  # of the scores alone, before any sink
    for q0 in range(0, Sq, BLOCK_M):
        _step("tile q")
        _step("load q")
        q1 = min(q0 + BLOCK_M, Sq)
        m = torch.full((B, H, q1 - q0, 1), -math.inf, dtype=fdt, device=dev)
        l = torch.zeros_like(m)
        acc = torch.zeros(B, H, q1 - q0, Dv, dtype=fdt, device=dev)
        env["q"] = torch.arange(q0, q1, device=dev).view(1, 1, -1, 1)
        for k0 in range(0, Skv, BLOCK_N):
            k1 = min(k0 + BLOCK_N, Skv)
            env["kv"] = torch.arange(k0, k1, device=dev).view(1, 1, 1, -1)
            _step("loop kv")
            _step("hook block_class")
            cls = _classify(p, env, box, q0, q1, k0, k1, fdt)
            _step("skip empty")
            if cls == 0:
                continue
            _step("load k")
            _step("mma qk")
            env["s"] = q[:, :, q0:q1] @ k[:, hk, k0:k1].transpose(-1, -2)
            _step("hook score")
            # the kernel holds each score in float32: a fill such as -1e9 absorbs s * scale there
            # (every masked key of a row gets one value), so the model rounds as the kernel does
            x = torch.as_tensor(evaluate(p.score, env, fdt)).to(torch.float32).to(fdt).expand(B, H, q1 - q0, k1 - k0)
            if cls == 1 and p.mask is not None:
                _step("hook mask")
                keep = torch.as_tensor(evaluate(p.mask, env, DISCRETE_FDT)).bool()
                x = torch.where(keep, x, torch.tensor(-math.inf, dtype=fdt, device=dev))
            _step("softmax online")
            m_new = torch.maximum(m, x.amax(-1, keepdim=True))
            m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            alpha = torch.exp(m - m_safe)
            pexp = torch.exp(x - m_safe)
            l = l * alpha + pexp.sum(-1, keepdim=True)
            _step("load v")
            _step("mma pv")
            acc = acc * alpha + pexp @ v[:, hk, k0:k1]
            m = m_new
        _step("endloop kv")
        lse[:, :, q0:q1] = m + torch.log(l)  # -inf for an empty row
        _step("hook sink")
        if p.sink is not None:
            sink = _tensor(evaluate(p.sink, env, fdt), fdt).to(dev, fdt).expand(B, H, 1, 1)
            m_new = torch.maximum(m, sink)
            alpha = torch.exp(m - m_new)
            l = l * alpha + torch.exp(sink - m_new)
            acc = acc * alpha
        _step("epilogue normalise")
        empty = l == 0
        res = acc / torch.where(empty, torch.ones_like(l), l)
        if p.empty_rows == "mean_v":
            res = torch.where(empty, v.mean(dim=2, keepdim=True)[:, hk], res)
        _step("store o")
        out[:, :, q0:q1] = res
    if p.row_scale is not None:  # not a kernel step: PyTorch scales the kernel's output (ops/runner.py)
        out = out.to(out_dtype).to(fdt) * row_factor(p.row_scale, dict(env, **{ROW_LSE: lse}), B, H, Sq, fdt)
    res = _to_output_layout(p, out.to(out_dtype), lse[..., 0] if p.out.lse_index >= 0 else None)
    return run_epilogue(p, res, bound) if p.epilogue else res


def index_env(sizes: dict[str, int], scal: dict[str, Any], tensors: dict[str, torch.Tensor], B: int, H: int,
              dev: torch.device) -> dict[str, Any]:
    """What expressions read: sizes, "$" scalars, "@" extra tensors, and b, h as [B, 1, 1, 1] and
    [1, H, 1, 1] index grids (q and kv are added per tile)."""
    env: dict[str, Any] = dict(sizes)
    env.update({"$" + n: x for n, x in scal.items()})
    env.update({"@" + n: t for n, t in tensors.items()})
    env["b"] = torch.arange(B, device=dev).view(B, 1, 1, 1)
    env["h"] = torch.arange(H, device=dev).view(1, H, 1, 1)
    return env


def row_factor(e: Expr, env: dict[str, Any], B: int, H: int, Sq: int, fdt: torch.dtype) -> torch.Tensor:
    """A program's row scale as a [B, H, Sq, 1] tensor; env holds sizes, scalars, extras, b, h and, where
    the scale reads it, the rows' LSE ([B, H, Sq, 1])."""
    dev = env["b"].device
    env = dict(env, q=torch.arange(Sq, device=dev).view(1, 1, -1, 1))
    return _tensor(evaluate(e, env, fdt), fdt).to(dev, fdt).expand(B, H, Sq, 1)


def _classify(p: Program, env: dict, box: dict, q0: int, q1: int, k0: int, k1: int, fdt: torch.dtype) -> int:
    if p.mask is None:
        return 2
    if p.block_rule == "interval":
        b2 = dict(box)
        b2.update({"q": (float(q0), float(q1 - 1)), "kv": (float(k0), float(k1 - 1))})
        return classify_tile(p.mask, b2)
    # runtime pre-pass: evaluate the predicate on the tile (the kernel's block table)
    keep = torch.as_tensor(evaluate(p.mask, env, DISCRETE_FDT)).bool()
    return 0 if not keep.any() else (2 if keep.all() else 1)


def _to_output_layout(p: Program, o: torch.Tensor, lse: torch.Tensor | None = None) -> Any:
    dims = [d for x in p.out.dims for d in x.split("*")]
    if "b" not in dims:
        o = o.squeeze(0)
        order = [list("hsd").index(c) for c in dims]
    else:
        order = [list("bhsd").index(c) for c in dims]
    o = o.permute(order).contiguous()
    shape, i = [], 0
    for x in p.out.dims:
        n = 1
        for _ in x.split("*"):
            n *= o.shape[i]
            i += 1
        shape.append(n)
    return as_result(p, o.reshape(shape), lse, o.dtype)
