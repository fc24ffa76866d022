"""The backward kernel's learnable sites: the gradients of the tensors a score reads (a relative-position
table, ALiBi slopes or a temperature held as parameters), filled into the FA2-class kernel's site hooks
(csrc/cubridge/bwd_kernel.cuh).

Each `load` of a learnable tensor in the score is a site (ir/backward.derive): a live pair adds
dX * d score / d element at the element it read, dX = P (dP - delta) being d loss / d score. Where the additions
go is decided by the site's indices, from the graph:
- a point site (no index reads the query or the key: a per-head slope or temperature) sums the tile's pairs in
  a register per thread, then a warp's sum is added by one atomic, per step;
- any other site gathers a step's additions in a window of shared memory: the box its indices span over the
  tile (their intervals, cubridge::Iv, as the masks' block classes use), clipped to the tensor, when it holds
  at most WINDOW elements (a relative table's diagonals, a bucket table), flushed by one atomic per touched
  element after the step; an element outside the box, or a box too large, goes to global memory directly.
The gradients accumulate in float32 tensors of the learnable tensors' shapes, named in Params as
`<name>_g` with strides `<name>_gs<d>` and sizes `<name>_gn<d>` (variant.param_fields).
"""
from __future__ import annotations

from ..ir.backward import derive
from ..ir.expr import Expr, free_vars
from ..ir.program import Program
from .cexpr import CExpr

WINDOW = 1024  # floats a site's window of shared memory holds (4 KB)

_SIG = "const cubridge::FwdArgs& a, const Params& p"


def score_sites(p: Program, learnable: tuple[str, ...]) -> tuple[tuple[Expr, Expr], ...]:
    """(load node, d score / d element) per learnable site of the score."""
    return derive(p, set(learnable)).score_sites if learnable else ()


def is_point(node: Expr) -> bool:
    """The site reads one element per (batch, head): none of its indices reads the query or the key."""
    return not any(free_vars(i) & {"q", "kv"} for i in node.args)


def window_count(sites: tuple[tuple[Expr, Expr], ...]) -> int:
    return sum(not is_point(n) for n, _ in sites)


def site_hooks(p: Program, cg: CExpr, learnable: tuple[str, ...]) -> list[str]:
    """The Variant's kSites, Sites, site_tile, site_add and site_flush (none where the score reads no
    learnable tensor)."""
    sites = score_sites(p, learnable)
    if not sites:
        return []
    windows = {i: w for w, i in enumerate(i for i, (n, _) in enumerate(sites) if not is_point(n))}
    members, tile, add, flush = [], [], [], []
    for i, (node, d) in enumerate(sites):
        x, rank = node.attr, len(node.args)
        idx = [cg.index(x, k, e) for k, e in enumerate(node.args)]
        grad_at = " + ".join(f"i{k} * p.{x}_gs{k}" for k in range(rank)) or "0"
        read = [f"const long long i{k} = {idx[k]};" for k in range(rank)]
        # a dropped pair adds nothing (its derivative may be inf or nan there)
        value = f"live ? dx * ({cg.as_kind(d, 'float')}) : 0.f"
        if i not in windows:
            members.append(f"float pt{i};")
            tile.append(f"t.pt{i} = 0.f;")
            add.append(f"t.pt{i} += {value};")
            flush += [f"{{ const float v = cubridge::warp_sum(t.pt{i});",
                      f"  if (lane == 0 && v != 0.f) {{ {' '.join(read)} atomicAdd(p.{x}_g + {grad_at}, v); }} }}"]
            continue
        w = windows[i]
        members += [f"int lo{i}_{k}, w{i}_{k};" for k in range(rank)] + [f"int n{i};"]
        tile.append("{ long long n = 1;")
        for k, e in enumerate(node.args):
            tile += [f"  {{ const cubridge::Iv v = {cg.interval(e)};",
                     f"    const float lo = fmaxf(v.lo, 0.f), hi = fminf(v.hi, (float)(p.{x}_gn{k} - 1));",
                     f"    t.lo{i}_{k} = (int)floorf(lo);",
                     f"    t.w{i}_{k} = hi >= lo ? (int)ceilf(hi) - t.lo{i}_{k} + 1 : 0;",
                     f"    n *= t.w{i}_{k}; }}"]
        tile.append(f"  t.n{i} = n > 0 && n <= kSiteWin ? (int)n : 0; }}")
        rel = [f"const long long r{k} = i{k} - t.lo{i}_{k};" for k in range(rank)]
        inside = " && ".join([f"t.n{i} > 0"] + [f"r{k} >= 0 && r{k} < t.w{i}_{k}" for k in range(rank)])
        flat = "r0"
        for k in range(1, rank):
            flat = f"({flat}) * t.w{i}_{k} + r{k}"
        add += [f"{{ const float v = {value};", *(f"  {r}" for r in read + rel),
                f"  cubridge::site_window_add(win + {w} * kSiteWin, {inside} ? (int)({flat}) : -1, "
                f"p.{x}_g + {grad_at}, v); }}"]
        unflat = []
        for k in reversed(range(rank)):
            unflat.append(f"const long long i{k} = {'r % ' + f't.w{i}_{k}' + ' + ' if k else 'r + '}t.lo{i}_{k};"
                          + (f" r /= t.w{i}_{k};" if k else ""))
        flush += [f"for (int e = tid; e < t.n{i}; e += nthreads) {{",
                  f"  float* c = win + {w} * kSiteWin + e;",
                  "  const float v = *c;",
                  "  if (v == 0.f) continue;",
                  "  *c = 0.f;",
                  "  int r = e;",
                  *(f"  {u}" for u in unflat),
                  f"  atomicAdd(p.{x}_g + {grad_at}, v);", "}"]
    ind = lambda lines: [f"    {ln}" for ln in lines]  # noqa: E731
    return [f"  static constexpr int kSites = {len(sites)}, kSiteWindows = {len(windows)}, kSiteWin = {WINDOW};",
            "  struct Sites {", *ind(members), "  };",
            f"  __device__ __forceinline__ static void site_tile(Sites& t, {_SIG}, int b, int h, int q_lo, int q_hi,"
            " int kv_lo, int kv_hi) {", *ind(tile), "  }",
            f"  __device__ __forceinline__ static void site_add(Sites& t, float* win, {_SIG}, float s, bool live, float dx,"
            " int b, int h, int q, int kv) {", *ind(add), "  }",
            f"  __device__ __forceinline__ static void site_flush(Sites& t, float* win, {_SIG}, int b, int h, int tid,"
            " int nthreads, int lane) {", *ind(flush), "  }"]
