"""Fill the expert kernel's hook sites from a program: the Params struct and the Variant.

Which hook each program field fills comes from the lifted reference; a
program feature with no hook site in the kernel is refused, never dropped.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import UnsupportedSpec
from ..ir.expr import Expr, free_vars, loads, var, walk
from ..ir.program import Program
from ..lift.reference import KERNELS, lift_reference
from .cexpr import CExpr, ctype


@dataclass(frozen=True)
class ParamField:
    """One 8-byte field of Params: a tensor pointer, a stride of it, or a scalar."""
    name: str
    kind: str          # ptr | stride | size | f64 | i64 | rt_ptr | rt_i64 (runtime: the block table)
    source: str        # extra tensor name or scalar name
    dim: int = -1


def default_scale(p: Program) -> Expr | None:
    """If score is s * c or s / c (c free of indices), the kernel folds c into exp2."""
    e = p.score
    if e == var("s"):
        return Expr("const", (), 1.0)
    if e.op in ("mul", "div") and e.args[0] == var("s"):
        c = e.args[1]
        if not (free_vars(c) - {"B", "H", "Hkv", "Sq", "Skv", "D"}) and not loads(c):
            return c if e.op == "mul" else Expr("div", (Expr("const", (), 1.0), c))
    return None


def param_fields(p: Program, learnable: tuple[str, ...] = ()) -> list[ParamField]:
    """Params' fields: each extra tensor's pointer, strides and (where a read is clamped) sizes, the scalars,
    the pre-pass's block table; then, for the backward, each learnable tensor's float32 gradient (grad_ptr),
    its strides and sizes (lower/sites.py's hooks add into it)."""
    from ..ir.bounds import data_indexed_dims
    clamped = data_indexed_dims(p)  # the kernel clamps these reads into the tensor: it needs the size
    out = []
    for x in p.extras:
        out.append(ParamField(x.name, "ptr", x.name))
        out += [ParamField(f"{x.name}_s{d}", "stride", x.name, d) for d in range(x.rank)]
        out += [ParamField(f"{x.name}_n{d}", "size", x.name, d) for d in range(x.rank) if (x.name, d) in clamped]
    for s in p.scalars:
        out.append(ParamField(s.name, "f64" if s.kind == "float" else "i64", s.name))
    if p.block_rule == "prepass":
        out += [ParamField("blk", "rt_ptr", "blk"), ParamField("blk_sb", "rt_i64", "blk_sb"),
                ParamField("blk_sh", "rt_i64", "blk_sh"), ParamField("blk_nk", "rt_i64", "blk_nk")]
    for x in p.extras:
        if x.name in learnable:
            out.append(ParamField(f"{x.name}_g", "grad_ptr", x.name))
            out += [ParamField(f"{x.name}_gs{d}", "grad_stride", x.name, d) for d in range(x.rank)]
            out += [ParamField(f"{x.name}_gn{d}", "grad_size", x.name, d) for d in range(x.rank)]
    return out


def variant_source(p: Program, head_dim: int, fast_tanh: bool, block_m: int = 128,
                   block_n: int = 64, kernel: str = "sm80", learnable: tuple[str, ...] = ()
                   ) -> tuple[str, list[ParamField], Expr | None]:
    """The Variant's source, its Params' fields and the folded score scale (None: the score hook is
    generated). learnable: the backward's tensors whose gradients Params points to (param_fields)."""
    hooks = lift_reference(kernel=KERNELS[kernel]).hooks()  # the hook sites of the kernel it fills
    needed = {"score"} | ({"mask", "block_class"} if p.mask is not None else set()) | \
        ({"sink"} if p.sink is not None else set())
    missing = needed - set(hooks)
    if missing:
        raise UnsupportedSpec(f"the expert kernel has no hook site for {sorted(missing)}", op="lower")
    if p.head_map not in ("group", "tile"):
        raise UnsupportedSpec(f"no kernel head map for {p.head_map!r}", op="lower")
    cg = CExpr(p, head_dim, fast_tanh)
    fields = param_fields(p, learnable)
    lines = ["struct Variant : cubridge::DefaultVariant {", "  struct Params {"]
    for f in fields:
        if f.kind == "ptr":
            x = next(e for e in p.extras if e.name == f.source)
            lines.append(f"    const {ctype(x.dtype)}* {f.name};")
        elif f.kind == "rt_ptr":
            lines.append(f"    int* {f.name};")
        elif f.kind == "grad_ptr":
            lines.append(f"    float* {f.name};")
        elif f.kind in ("stride", "size", "i64", "rt_i64", "grad_stride", "grad_size"):
            lines.append(f"    long long {f.name};")
        elif f.kind == "f64":
            lines.append(f"    double {f.name};")
        else:  # the struct must match ops/pack.py field for field
            raise UnsupportedSpec(f"no Params member for a field of kind {f.kind!r}", op="lower")
    if not fields:
        lines.append("    long long unused;")
    lines.append("  };")
    sig = "const cubridge::FwdArgs& a, const Params& p"
    scale = default_scale(p)
    if scale is None:
        lines += [f"  __device__ __forceinline__ static float score({sig}, float s, int b, int h, int q, int kv) {{",
                  f"    return {cg.as_kind(p.score, 'float')};", "  }"]
    if p.mask is not None:
        by_head = p.block_rule == "prepass" or "h" in free_vars(p.mask)
        lines += ["  static constexpr bool kHasMask = true;",
                  f"  static constexpr bool kClassByHead = {str(by_head).lower()};",
                  f"  __device__ __forceinline__ static bool mask({sig}, int b, int h, int q, int kv) {{",
                  f"    return {cg.as_kind(p.mask, 'bool')};", "  }",
                  f"  __device__ __forceinline__ static int block_class({sig}, {_TILE}) {{"]
        if p.block_rule == "prepass":  # the pre-pass wrote every tile's class and the row's live counts
            lines += [f"    return cubridge::table_class(p.blk + b * p.blk_sb + h * p.blk_sh"
                      f" + (long long)(q_lo / {block_m}) * p.blk_nk, kv_lo / {block_n}, (kv_hi + {block_n - 1}) / {block_n});",
                      "  }"] + _prepass_hooks(cg, p, sig)
        else:
            lines += [f"    return cubridge::iv_class({cg.interval(p.mask)});", "  }"]
    if p.sink is not None:
        lines += ["  static constexpr bool kHasSink = true;",
                  f"  __device__ __forceinline__ static float sink({sig}, int b, int h) {{",
                  f"    return {cg.as_kind(p.sink, 'float')};", "  }"]
    if p.head_map == "tile":  # k.repeat(...): query head h reads key head h % Hkv
        lines += ["  __device__ __forceinline__ static int kv_head(const cubridge::FwdArgs& a, int h) {",
                  "    return h % static_cast<int>(a.Hkv);", "  }",
                  "  __device__ __forceinline__ static int q_head(const cubridge::FwdArgs& a, int hk, int g) {",
                  "    return g * static_cast<int>(a.Hkv) + hk;", "  }"]
    if p.empty_rows == "mean_v":
        lines.append("  static constexpr bool kEmptyRowMeanV = true;")
    lines.append("};")
    return "\n".join(lines), fields, scale


_TILE = "int b, int h, int q_lo, int q_hi, int kv_lo, int kv_hi"


def bound_sites(mask: Expr) -> list[tuple[Expr, str]]:
    """Loads whose indices vary along one tile axis only (doc[b, q], doc[b, kv]): the pre-pass bounds
    each by the values it reads over the tile's rows or columns. Loads indexed by both stay unknown."""
    out: list[tuple[Expr, str]] = []
    for e in walk(mask):
        if e.op != "load" or any(e == x for x, _ in out):
            continue
        axes = set().union(*(free_vars(i) for i in e.args)) & {"q", "kv"}
        if len(axes) == 1 and not any(loads(i) for i in e.args):
            out.append((e, axes.pop()))
    return out


def _prepass_hooks(cg: CExpr, p: Program, sig: str) -> list[str]:
    """The pre-pass's cheaper tests (block_prepass.cuh): the interval rule with loads unknown, then
    with each bound site's [min, max] over the tile."""
    sites = bound_sites(p.mask)
    lines = [f"  static constexpr int kBoundSites = {len(sites)};",
             f"  __device__ __forceinline__ static int index_class({sig}, {_TILE}) {{",
             f"    return cubridge::iv_class({cg.interval(p.mask)});", "  }"]
    if not sites:
        return lines
    lines += ["  __device__ __forceinline__ static int bound_axis(int s) {",
              "    return " + " : ".join(f"s == {i} ? {int(ax == 'kv')}" for i, (_, ax) in enumerate(sites[:-1]))
              + (" : " if len(sites) > 1 else "") + f"{int(sites[-1][1] == 'kv')};", "  }",
              f"  __device__ __forceinline__ static double bound_value({sig}, int s, int b, int h, int x) {{"]
    for i, (e, ax) in enumerate(sites):
        lines.append(f"    if (s == {i}) {{ const int {ax} = x; return (double)({cg.value(e)}); }}")
    lines += ["    return 0.0;", "  }",
              f"  __device__ __forceinline__ static int data_class({sig}, {_TILE}, const cubridge::Iv* lb) {{",
              f"    return cubridge::iv_class({cg.interval(p.mask, {e: f'lb[{i}]' for i, (e, _) in enumerate(sites)})});",
              "  }"]
    return lines
