"""The backward kernel's translation unit for one program: the forward's Variant (lower/variant.py) plus its
score_grad hook, d score / d s derived from the score's Expr (ir/derivative.py), and three extern "C" entries:
the preprocess (delta and the LSE in padded rows, dQ's accumulator zeroed), the main kernel and the
postprocess (dQ in the input dtype). The main kernel is csrc/cubridge/bwd_kernel_sm90.cuh's on sm_90a (wgmma,
TMA, a producer warp) up to head dim 128, else bwd_kernel.cuh's (FA2-class, mma.sync, sm_80 and later). Where
learnable tensors the score reads get gradients, their site hooks come from lower/sites.py."""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import UnsupportedSpec
from ..ir.derivative import derivative
from ..ir.expr import loads, var
from ..ir.program import Program
from .cexpr import CExpr
from .choice import C_TYPES
from .sites import hopper_site_refusal, score_sites, site_hooks, site_smem
from .source import prepass_entries
from .tiles import pad16
from .variant import ParamField, default_scale, variant_source

BWD_NAME = "cubridge_bwd"
PRE_NAME = "cubridge_bwd_pre"
POST_NAME = "cubridge_bwd_post"
PREPOST_THREADS = 256  # the pre- and postprocess's CTA (bwd_prepost.cuh): prepost_lanes a query row


def prepost_lanes(head_dim: int, value_dim: int) -> int:
    """Lanes a query row in the pre- and postprocess: one a piece of 8 columns of the wider head dim (16-byte
    accesses), to a power of two. A warp a row left most lanes idle at D 64 and 128, and each row's loads in
    2-byte pieces: both kernels took 0.46 of the main kernel's 1.07 ms at 1k, D 64."""
    pieces = -(-max(head_dim, value_dim) // 8)
    return min(32, 1 << (pieces - 1).bit_length())


SQ_PAD = 64  # bwd_config.cuh BwdArgs::sq_pad: query rows padded to whole blocks of the Hopper kernel's


@dataclass(frozen=True)
class BwdTile:
    """bwd_config.cuh's BwdTile: BM query rows a step, 16 keys a warp (block_n = 16 * warps)."""
    head_dim: int
    block_m: int = 64
    warps: int = 8
    kernel = "sm80"

    @property
    def block_n(self) -> int:
        return 16 * self.warps

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def smem_bytes(self) -> int:
        ld, lds = pad16(self.head_dim) + 8, self.block_n + 8
        return (2 * self.block_n * ld + 4 * self.block_m * ld + self.block_m * lds) * 2 + 4 * self.block_m * 4


@dataclass(frozen=True)
class BwdSm90Tile:
    """bwd_config.cuh's BwdSm90Tile: 64 query rows a step; a consumer warpgroup per 64 keys, a producer's;
    deterministic: dQ's shares added in a fixed (descending) key-block order; value_dim: V's head dim (0: Q's)."""
    head_dim: int
    block_n: int = 128
    stages: int = 2
    deterministic: bool = False
    value_dim: int = 0
    block_m = 64
    kernel = "sm90"

    @property
    def threads(self) -> int:
        return 128 * (self.block_n // 64 + 1)

    @property
    def smem_bytes(self) -> int:
        pd, pdv = (-(-d // 64) * 64 for d in (self.head_dim, self.value_dim or self.head_dim))
        q, o, ds, rows = self.block_m * pd * 2, self.block_m * pdv * 2, self.block_m * self.block_n * 2, self.block_m * 4
        dq = (self.block_n // 64) * 64 * 64 * 4  # each consumer's staged dQ share
        return 1024 + self.block_n * (pd + pdv) * 2 + self.stages * (q + o) + 2 * ds + dq + self.stages * 2 * rows \
            + 8 * (1 + 2 * self.stages) + 8 * self.stages


def hopper_backward(arch: str, head_dim: int, value_dim: int | None = None) -> bool:
    """Whether the Hopper backward kernel serves these head dims on `arch`: sm_90a (its wgmma), and dK and dV
    rows of at most 128 padded columns each (a consumer thread holds half of each for the whole walk)."""
    return arch == "sm_90a" and head_dim <= 128 and (value_dim or head_dim) <= 128


# The most dynamic shared memory one CTA may take (bytes) by compute capability; others take the least
# (sm_86, sm_89, sm_120: 99 KB).
_SMEM_MAX = {80: 166912, 87: 166912, 90: 232448, 100: 232448, 103: 232448}
_SMEM_LEAST = 101376


def smem_max(arch: str) -> int:
    """The dynamic shared memory one CTA may take on `arch` ("sm_80", "sm_90a", ...)."""
    digits = "".join(ch for ch in arch.removeprefix("sm_") if ch.isdigit())
    return _SMEM_MAX.get(int(digits), _SMEM_LEAST) if digits else _SMEM_LEAST


def bwd_block_m(head_dim: int, arch: str = "sm_80") -> int:
    """Query rows a step. A warp's dK and dV rows take pad16(D) registers a thread and S^T and dP^T BM / 2
    each: 64 rows up to 64 columns; past them 64 spills at 255 registers where a mask or score hook is called
    (sm_80 and sm_90), so 32. Halved while the tile's shared memory passes the arch's."""
    bm = 64 if pad16(head_dim) <= 64 else 32
    while bm > 16 and BwdTile(head_dim, bm).smem_bytes > smem_max(arch):
        bm //= 2
    return bm


@dataclass(frozen=True)
class LoweredBackward:
    source: str
    tile: BwdTile | BwdSm90Tile
    params: tuple[ParamField, ...]
    scale: object | None   # the folded score scale (FwdArgs.scale), or None when the score hook is generated
    dtype: str
    kernels: tuple[str, str, str] = (PRE_NAME, BWD_NAME, POST_NAME)
    prepass: bool = False  # the mask reads data: the block-class pre-pass and scan (source.py) at this tile
    sites: tuple[str, ...] = ()  # the learnable extras the kernel gives gradients of (lower/sites.py)
    site_smem: int = 0           # their windows' shared memory, past the tile's

    @property
    def prepost_rows(self) -> int:
        """Query rows a CTA of the pre- and postprocess (prepost_lanes a row; the FA2-class tile: V's dims Q's)."""
        t = self.tile
        return PREPOST_THREADS // prepost_lanes(t.head_dim, getattr(t, "value_dim", 0) or t.head_dim)

    @property
    def smem_bytes(self) -> int:
        """The main kernel's dynamic shared memory."""
        return self.tile.smem_bytes + self.site_smem


def backward_refusal(p: Program, head_dim: int, value_dim: int | None, arch: str = "sm_80") -> str | None:
    """Why the backward kernel cannot serve this program at these head dims on `arch`; None where it can."""
    if value_dim is not None and value_dim != head_dim and not hopper_backward(arch, head_dim, value_dim):
        return "the backward kernel takes V's head dim equal to Q's (the Hopper kernel: both up to 128)"
    if value_dim is not None and not (value_dim % 8 == 0 and 8 <= value_dim <= 128):
        return f"the backward kernel takes V's head dims in steps of 8 up to 128, not {value_dim}"
    # a warp keeps its 16 keys' dK and dV rows in registers for the whole walk: pad16(D) floats a thread each,
    # so past 128 columns the tile no longer fits in 255 registers
    if not (head_dim % 8 == 0 and 8 <= head_dim <= 128):
        return f"the backward kernel takes head dims in steps of 8 up to 128, not {head_dim}"
    return None


def _agrees(tile: BwdTile | BwdSm90Tile) -> list[str]:
    """The generated source's check that this module's copy of the tile's shared memory and threads is the
    header's."""
    name = type(tile).__name__
    return [f"static_assert(Cfg::kSmemBytes == {tile.smem_bytes} && Cfg::kThreads == {tile.threads},",
            f'              "lower/backward.py\'s {name} agrees with bwd_config.cuh\'s");']


def score_grad_hook(p: Program, cg: CExpr) -> list[str]:
    """The Variant's score_grad: d score / d s, lowered like the score (none where the scale is folded)."""
    if default_scale(p) is not None:
        return []
    g = derivative(p.score, var("s"))
    sig = "const cubridge::FwdArgs& a, const Params& p"
    return [f"  __device__ __forceinline__ static float score_grad({sig}, float s, int b, int h, int q, int kv) {{",
            f"    return {cg.as_kind(g, 'float')};", "  }"]


def lower_backward(p: Program, arch: str = "sm_80", dtype: str = "bfloat16", head_dim: int = 128,
                   value_dim: int | None = None, fast_tanh: bool = True,
                   block_m: int | None = None, kernel: str | None = None,
                   deterministic: bool = False, stages: int | None = None,
                   learnable: tuple[str, ...] = ()) -> LoweredBackward:
    """The backward kernels' translation unit for `p`. kernel: "sm90" (wgmma, sm_90a only) or "sm80"
    (FA2-class, mma.sync: sm_80 and later); None: hopper_backward's choice. block_m: the FA2-class kernel's
    query rows a step (16, 32 or 64; None: bwd_block_m's choice for the arch), for benchmarks to compare.
    deterministic: bitwise-equal gradients run to run (the Hopper kernel's dQ added in a fixed key order; the FA2-class
    kernel's dQ atomics have no such mode, and it is refused). stages: the Hopper kernel's ring of query blocks
    (2 or 3; None: 2), for benchmarks to compare. learnable: the extras that get gradients; those the score
    reads are the kernel's learnable sites (lower/sites.py: the Hopper kernel takes point and diagonal sites
    beside a dscore/ds uniform over the tile, the FA2-class kernel any)."""
    if dtype not in C_TYPES:
        raise UnsupportedSpec(f"the backward kernel computes in {sorted(C_TYPES)}, not {dtype}", op="lower")
    why = backward_refusal(p, head_dim, value_dim, arch)
    dv = value_dim if value_dim is not None and value_dim != head_dim else None  # None: V's head dim is Q's
    if why:
        raise UnsupportedSpec(why, op="lower")
    if p.row_scale is not None:
        # the op gives O before the row scale and PyTorch scales it (ops/op_calls.py): the op's backward is the
        # attention's alone, and autograd carries the scale into dO (a scale that reads the LSE gives the LSE a
        # gradient, which the backward runner keeps from this kernel); the tensors only the scale reads go too,
        # so a gated program's kernel is the ungated one's (one build in the cache)
        read = set().union(*(loads(e) for e in (p.score, p.mask, p.sink) if e is not None))
        p = replace(p, row_scale=None, extras=tuple(x for x in p.extras if x.name in read))
    if p.empty_rows == "mean_v":
        # rows with every key masked take the mean of V, whose gradient this kernel does not give: the
        # backward runner sends calls that have such a row (an LSE of -inf) to the reference, so the kernel
        # only meets rows with keys, where the two rules agree
        p = replace(p, empty_rows="zero")
    if block_m not in (None, 16, 32, 64):
        raise UnsupportedSpec(f"the backward kernel steps 16, 32 or 64 query rows, not {block_m}", op="lower")
    sites = score_sites(p, tuple(learnable))
    if sites and deterministic:
        raise UnsupportedSpec("gradients of learnable tensors the score reads are added by atomics: no "
                              "deterministic mode", op="lower")
    hopper_sites = hopper_site_refusal(p, sites, BwdSm90Tile(head_dim, stages=stages or 2, value_dim=dv or 0),
                                       smem_max(arch))
    if kernel is None:
        kernel = "sm90" if hopper_backward(arch, head_dim, dv) and block_m is None and hopper_sites is None else "sm80"
    if kernel == "sm90" and hopper_sites is not None:
        raise UnsupportedSpec(f"the Hopper backward kernel cannot add these learnable tensors' gradients: "
                              f"{hopper_sites}", op="lower")
    if kernel == "sm80" and dv is not None:
        raise UnsupportedSpec("the FA2-class backward kernel takes V's head dim equal to Q's", op="lower")
    if kernel == "sm90" and not hopper_backward(arch, head_dim, dv):
        raise UnsupportedSpec(f"the Hopper backward kernel takes sm_90a and head dims up to 128, not {arch} "
                              f"and {head_dim}", op="lower")
    if deterministic and kernel != "sm90":
        raise UnsupportedSpec("the FA2-class backward kernel adds dQ by atomics: no deterministic mode (the Hopper "
                              "kernel, sm_90a and head dims up to 128, has one)", op="lower")
    if stages is not None and (kernel != "sm90" or stages not in (2, 3)):
        raise UnsupportedSpec(f"the Hopper backward kernel rings 2 or 3 stages, not {stages}", op="lower")
    tile = BwdSm90Tile(head_dim, stages=stages or 2, deterministic=deterministic, value_dim=dv or 0) \
        if kernel == "sm90" else \
        BwdTile(head_dim, block_m or _sites_block_m(head_dim, arch, sites))
    fast = fast_tanh and "tanh" in str(p.score)
    names = tuple(dict.fromkeys(s.node.attr for s in sites))
    variant, fields, scale = variant_source(p, head_dim, fast, tile.block_m, tile.block_n, "sm80", names)
    cg = CExpr(p, head_dim, fast)
    grad = score_grad_hook(p, cg) + site_hooks(p, cg, tuple(learnable), tile.block_m, tile.block_n, tile.kernel)
    assert variant.endswith("};")
    variant = variant[:-2].rstrip("\n") + "\n" + "\n".join(grad + ["};"]) if grad else variant
    t = C_TYPES[dtype]
    D = head_dim
    lanes = prepost_lanes(D, dv or D)  # the pre- and postprocess's (LoweredBackward.prepost_rows: the same rule)
    if kernel == "sm90":
        tma = "const __grid_constant__ cubridge::TmaDesc"
        DV = dv or D
        cfg = [f"using Cfg = cubridge::BwdSm90Tile<{D}, {DV}, {tile.block_n}, {tile.stages}, {int(tile.deterministic)}>;",
               *_agrees(tile)]
        main = [f"{BWD_NAME}(cubridge::BwdArgs a, Variant::Params p, {tma} tq, {tma} tk, {tma} tv, {tma} tdo) {{",
                f"  cubridge::attention_bwd_sm90<Cfg, Variant, {t}>(a, p, &tq, &tk, &tv, &tdo);"]
        header = '#include "cubridge/bwd_kernel_sm90.cuh"'
        chunks = "Cfg::kDqSplitN ? Cfg::kPadD / 64 : 1"  # the tiled accumulator's (bwd_prepost.cuh dq_tiled_at)
        pre = f"<{D}, {DV}, {t}, {chunks}, {lanes}>"
        post = f"<{D}, {t}, {chunks}, cubridge::ds_unscaled<Variant>(), {lanes}>"
    else:
        cfg = [f"using Cfg = cubridge::BwdTile<{D}, {tile.block_m}, {tile.warps}>;", *_agrees(tile)]
        main = [f"{BWD_NAME}(cubridge::BwdArgs a, Variant::Params p) {{",
                f"  cubridge::attention_bwd<Cfg, Variant, {t}>(a, p);"]
        header = '#include "cubridge/bwd_kernel.cuh"'
        pre, post = f"<{D}, {D}, {t}, 0, {lanes}>", f"<{D}, {t}, 0, false, {lanes}>"
    src = "\n".join([
        "// Generated by torch_cubridge.lower.backward from a CuIR program. Do not edit.",
        header,
        '#include "cubridge/interval.cuh"',
        '#include "cubridge/fastmath.cuh"',
        '#include "cubridge/block_prepass.cuh"',
        "",
        variant,
        "",
        *cfg,
        f'extern "C" __global__ void __launch_bounds__({PREPOST_THREADS})',
        f"{PRE_NAME}(cubridge::BwdArgs a) {{",
        f"  cubridge::bwd_preprocess{pre}(a);",
        "}",
        'extern "C" __global__ void __launch_bounds__(Cfg::kThreads, 1)',
        *main,
        "}",
        f'extern "C" __global__ void __launch_bounds__({PREPOST_THREADS})',
        f"{POST_NAME}(cubridge::BwdArgs a) {{",
        f"  cubridge::bwd_postprocess{post}(a);",
        "}",
        "",
        # a mask that reads data (document ids): the backward's own block map, at its own tile, as the forward
        # makes one at its tile (the forward's is laid out for other tiles), so it skips the same blocks
    ] + (prepass_entries(tile.block_m, tile.block_n) if p.block_rule == "prepass" else []))
    return LoweredBackward(src, tile, tuple(fields), scale, dtype, prepass=p.block_rule == "prepass", sites=names,
                           site_smem=site_smem(sites, tile.block_m, tile.block_n, tile.kernel))


def _sites_block_m(head_dim: int, arch: str, sites: tuple) -> int:
    """bwd_block_m's rows, at most 32 where a site stages or gathers its pairs (at 64 rows of 64 columns the
    step's 32 pairs a thread and their additions spill), and halved further while the sites' shared memory
    (which grows with the rows) does not fit beside the tile."""
    bm = bwd_block_m(head_dim, arch)
    if any(s.kind != "point" for s in sites):
        bm = min(bm, 32)
    while bm > 16 and BwdTile(head_dim, bm).smem_bytes + site_smem(sites, bm, BwdTile(head_dim, bm).block_n) \
            > smem_max(arch):
        bm //= 2
    return bm
