"""The backward kernels' learnable sites: the gradients of the tensors a score reads (a relative-position
table, ALiBi slopes or a temperature held as parameters), filled into the kernels' site hooks (site_tile,
site_add, site_flush: csrc/cubridge/bwd_kernel.cuh and, for point and diagonal sites beside a dscore/ds
uniform over the tile, bwd_kernel_sm90.cuh: hopper_site_refusal).

Each `load` of a learnable tensor in the score is a site (ir/backward.derive): a live pair adds
dX * d score / d element at the element it read, dX = P (dP - delta) being d loss / d score. How a step's
additions are gathered is decided from the site's indices, by the graph:
- point: no index reads the query or the key (a per-head slope or temperature). A thread sums its pairs in a
  register, a warp's sum goes by one atomic, per step.
- diagonal: one index moves over the tile, as a q + b kv + c with b = +-1 and c free of both (a table over the
  distance kv - q, which is what the prologue makes of any function of the distance, T5's buckets included):
  each pair's share is staged in shared memory as a [query][key] tile, and after the step a thread per element
  sums the one key of each query row that reads it (deterministic within the step), one atomic per element.
  Shared float atomics are compare-and-swap loops on sm_80 and sm_90: they cost the FA2-class backward 62% of
  its rate, staging 25% (docs/performance.md).
- window: any other index (clamped, read from data, several moving). A step's additions go by shared atomics
  into a window over the box the moving indices span over the tile (their intervals, cubridge::Iv, as the
  masks' block classes use), clipped to the tensor, when it holds at most WINDOW elements, flushed by one
  atomic per touched element; an element outside the box, or a box too large (a dense [B, H, Sq, Skv] bias),
  goes to global memory directly.
The gradients accumulate in float32 tensors of the learnable tensors' shapes, named in Params as `<name>_g`
with strides `<name>_gs<d>` and sizes `<name>_gn<d>` (variant.param_fields).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..ir.backward import derive
from ..ir.derivative import derivative
from ..ir.expr import Expr, const, free_vars, substitute, var
from ..ir.program import Program
from .cexpr import CExpr

WINDOW = 1024  # floats a window site's shared memory holds (4 KB)
# a diagonal site's staged tile: rows of block_n + pad floats; 4 makes the m16n8 fragment's stores conflict-free,
# the Hopper kernel at 128 columns has room for 2 (two-way conflicts)
TILE_PAD = {"sm80": 4, "sm90": 2}

_SIG = "const cubridge::FwdArgs& a, const Params& p"
_MOVING = {"q", "kv"}


@dataclass(frozen=True)
class Site:
    node: Expr            # the load of the learnable tensor
    d: Expr               # d score / d element
    kind: str             # point | diagonal | window
    moving: tuple[int, ...] = ()        # the dims whose index reads the query or the key
    coeffs: tuple[int, int] = (0, 0)    # a diagonal's index: coeffs[0] q + coeffs[1] kv + rest


def score_sites(p: Program, learnable: tuple[str, ...]) -> tuple[Site, ...]:
    """The learnable sites of the score, each with how its additions are gathered."""
    if not learnable:
        return ()
    out = []
    for node, d in derive(p, set(learnable)).score_sites:
        moving = tuple(k for k, e in enumerate(node.args) if free_vars(e) & _MOVING)
        if not moving:
            out.append(Site(node, d, "point"))
            continue
        ab = _affine(node.args[moving[0]]) if len(moving) == 1 else None
        kind = "diagonal" if ab is not None and ab[1] in (-1, 1) else "window"
        out.append(Site(node, d, kind, moving, ab or (0, 0)))
    return tuple(out)


def _affine(e: Expr) -> tuple[int, int] | None:
    """(a, b) where e is a q + b kv plus terms free of both, in integer arithmetic; None where it is not."""
    if not free_vars(e) & _MOVING:
        return 0, 0
    if e.op == "var":
        return (1, 0) if e.attr == "q" else (0, 1)
    if e.op in ("add", "sub"):
        x, y = _affine(e.args[0]), _affine(e.args[1])
        if x is None or y is None:
            return None
        sign = 1 if e.op == "add" else -1
        return x[0] + sign * y[0], x[1] + sign * y[1]
    if e.op == "neg":
        x = _affine(e.args[0])
        return None if x is None else (-x[0], -x[1])
    if e.op == "mul":
        for c, other in ((e.args[0], e.args[1]), (e.args[1], e.args[0])):
            if c.op == "const" and isinstance(c.attr, int) and not isinstance(c.attr, bool):
                x = _affine(other)
                return None if x is None else (c.attr * x[0], c.attr * x[1])
    return None  # a load, a clamp, a division: the window's rule


def site_smem(sites: tuple[Site, ...], block_m: int, block_n: int, kernel: str = "sm80") -> int:
    """Shared memory past the tile's (bytes): the window sites' windows and the diagonal sites' staged tiles."""
    windows = sum(s.kind == "window" for s in sites)
    tiles = sum(s.kind == "diagonal" for s in sites)
    return 4 * (windows * WINDOW + tiles * block_m * (block_n + TILE_PAD[kernel]))


def hopper_site_refusal(p: Program, sites: tuple[Site, ...], tile: Any, smem_limit: int) -> str | None:
    """Why the Hopper backward kernel cannot take these sites; None where it can. It makes P and dS in two
    halves and keeps neither s nor a per-pair dscore/ds between them: the sites' derivatives must not read s
    and dscore/ds must be one value over a tile (a table added to a scaled score); their shares are gathered
    in point sums and diagonals (no shared atomics), staged beside its tile."""
    if not sites:
        return None
    if any(s.kind == "window" for s in sites):
        return "an index that is neither fixed over a tile nor a diagonal (the FA2-class kernel's windows)"
    if free_vars(derivative(p.score, var("s"))) & {"s", "q", "kv"}:
        return "d score / d s varies over the tile"
    if any("s" in free_vars(s.d) for s in sites):
        return "a learnable tensor's derivative reads the score"
    if tile.smem_bytes + site_smem(sites, tile.block_m, tile.block_n, "sm90") > smem_limit:
        return "the staged shares do not fit beside the tile's shared memory"
    return None


def site_hooks(p: Program, cg: CExpr, learnable: tuple[str, ...], block_m: int, block_n: int,
               kernel: str = "sm80") -> list[str]:
    """The Variant's kSites, Sites, site_tile, site_add and site_flush (none where the score reads no
    learnable tensor), for `kernel`'s tile."""
    sites = score_sites(p, learnable)
    if not sites:
        return []
    ld = block_n + TILE_PAD[kernel]
    base, at = {}, 0  # each window's or staged tile's first float in the site memory
    for i, s in enumerate(sites):
        if s.kind != "point":
            base[i] = at
            at += WINDOW if s.kind == "window" else block_m * ld
    members, tile, add, flush = ["int unused;"], [], [], []
    for i, s in enumerate(sites):
        x, rank = s.node.attr, len(s.node.args)
        idx = [cg.index(x, k, e) for k, e in enumerate(s.node.args)]
        grad_at = " + ".join(f"i{k} * p.{x}_gs{k}" for k in range(rank)) or "0"
        read = [f"const long long i{k} = {idx[k]};" for k in range(rank)]
        fixed = [r for k, r in enumerate(read) if k not in s.moving]
        # a dropped pair adds nothing (its derivative may be inf or nan there)
        value = f"live ? dx * ({cg.as_kind(s.d, 'float')}) : 0.f"
        if s.kind == "point":
            members.append(f"float pt{i};")
            tile.append(f"t.pt{i} = 0.f;")
            add.append(f"t.pt{i} += {value};")
            flush.append(f"cubridge::flush_point(t.pt{i}, lane, [&](float v) {{ {' '.join(read)} "
                         f"atomicAdd(p.{x}_g + {grad_at}, v); }});")
            continue
        members += [f"int lo{i}_{k}, w{i}_{k};" for k in s.moving] + [f"int n{i};"]
        spans = [f"cubridge::site_span({cg.interval(s.node.args[k])}, p.{x}_gn{k}, t.lo{i}_{k}, t.w{i}_{k});"
                 for k in s.moving]
        if s.kind == "diagonal":
            (k,) = s.moving
            a, b = s.coeffs
            rest = cg.as_kind(substitute(s.node.args[k], {"q": const(0), "kv": const(0)}), "int")
            tile += spans + [f"t.n{i} = t.w{i}_{k};"]  # every element of the box: one key a query row
            add.append(f"win[{base[i]} + ql * {ld} + kl] = {value};")
            flush += [f"cubridge::flush_diagonal<{ld}, {a}, {b}>(win + {base[i]}, t.n{i}, t.lo{i}_{k}, {rest}, q_lo, "
                      "q_hi, kv_lo, kv_hi, tid, nthreads,",
                      f"    [&](int w, float sum) {{ const long long i{k} = w; {' '.join(fixed)} "
                      f"atomicAdd(p.{x}_g + {grad_at}, sum); }});"]
            continue
        tile.append("{ int n = 1;")
        for k, span in zip(s.moving, spans):  # the box's elements, 0 once past the window
            tile += [f"  {span}", f"  n = t.w{i}_{k} > 0 && n <= kSiteWin ? n * t.w{i}_{k} : 0;"]
        tile.append(f"  t.n{i} = n <= kSiteWin ? n : 0; }}")
        # 32-bit offsets into the window (an index below the tensor's size), checked against the box
        rel = [f"const int r{k} = (int)({idx[k]}) - t.lo{i}_{k};" for k in s.moving]
        inside = " && ".join([f"t.n{i} > 0"] + [f"(unsigned)r{k} < (unsigned)t.w{i}_{k}" for k in s.moving])
        flat = f"r{s.moving[0]}"
        for k in s.moving[1:]:
            flat = f"({flat}) * t.w{i}_{k} + r{k}"
        add += [f"{{ const float v = {value};", *(f"  {r}" for r in rel),
                f"  if (cubridge::site_window_add(win + {base[i]}, {inside} ? {flat} : -1, v)) {{",
                *(f"    {r}" for r in read), f"    atomicAdd(p.{x}_g + {grad_at}, v);", "  } }"]
        unflat = []  # the element's index in each moving dim, from its place in the window (row-major)
        for j, k in enumerate(reversed(s.moving)):
            last = j == len(s.moving) - 1
            unflat.append(f"const long long i{k} = {'r' if last else f'r % t.w{i}_{k}'} + t.lo{i}_{k};"
                          + ("" if last else f" r /= t.w{i}_{k};"))
        flush += [f"cubridge::flush_window(win + {base[i]}, t.n{i}, tid, nthreads, [&](int e, float v) {{",
                  "  int r = e;", *(f"  {u}" for u in unflat + fixed), f"  atomicAdd(p.{x}_g + {grad_at}, v); }});"]
    ind = lambda lines: [f"    {ln}" for ln in lines]  # noqa: E731
    return [f"  static constexpr int kSites = {len(sites)}, kSiteWin = {WINDOW}, kSiteFloats = {at};",
            "  struct Sites {", *ind(members), "  };",
            f"  __device__ __forceinline__ static void site_tile(Sites& t, {_SIG}, int b, int h, int q_lo, int q_hi,"
            " int kv_lo, int kv_hi) {", *ind(tile), "  }",
            f"  __device__ __forceinline__ static void site_add(Sites& t, float* win, {_SIG}, float s, bool live, float dx,"
            " int b, int h, int q, int kv, int ql, int kl) {", *ind(add), "  }",
            f"  __device__ __forceinline__ static void site_flush(Sites& t, float* win, {_SIG}, int b, int h, int q_lo,"
            " int q_hi, int kv_lo, int kv_hi, int tid, int nthreads, int lane) {", *ind(flush), "  }"]
