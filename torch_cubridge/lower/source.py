"""The whole translation unit for one program: headers, Variant, extern "C" kernel."""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..ir.expr import Expr
from ..ir.program import Program
from .tiles import Tile, decode_dims_refusal, decode_tile, tile_for
from .variant import ParamField, default_scale, variant_source

KERNEL_NAME = "cubridge_fwd"
DECODE_NAME = "cubridge_decode"
PREPASS_NAME = "cubridge_block_prepass"
SCAN_NAME = "cubridge_block_scan"
PREPASS_THREADS = 128
_DTYPES = {"bfloat16": "__nv_bfloat16", "float16": "__half"}


@dataclass(frozen=True)
class Lowered:
    source: str
    kernel: str
    tile: Tile
    params: tuple[ParamField, ...]
    scale: Expr | None        # folded score scale, or None when the score hook is generated
    dtype: str
    fast_tanh: bool
    prepass: str | None = None  # kernel name of the block-class pre-pass, when the mask reads data
    paged: bool = False         # K and V read in place from pages through a block table (ir/paged.py)
    segmented: bool = False     # decode: K and V read in place as the pieces the spec concatenates (ir/segments.py)


def _entry(tile: Tile, head_dim: int, t: str, paged: bool = False, segmented: bool = False) -> list[str]:
    """The extern "C" kernel: FwdArgs and Params by value (plus Q/K/V tensor maps for TMA)."""
    if tile.kernel == "decode":  # split-KV partials go through fp32 buffers; the last split merges
        kv = "cubridge::SegKV" if segmented else "cubridge::PagedKV"
        # K/V pieces (eight piece bases live in the loop): given the thread count alone, ptxas chose 168
        # registers (three CTAs per SM) and, after a63aadd changed the merge, spilled one around the loop; the
        # split rule never puts more than two on one SM. The other decode kernels keep the bound their H100
        # figures were measured with (s1127h run 7, NOTES v35); one CTA per SM there too, not yet measured.
        return [f"using Cfg = cubridge::DecodeTile<{head_dim}, {tile.dv}, {tile.stages}, {tile.block_n}>;",
                f'extern "C" __global__ void __launch_bounds__({tile.threads}{", 1" if segmented else ""})',
                f"{DECODE_NAME}(cubridge::FwdArgs a, Variant::Params p, float* part_o, float* part_lse, "
                f"int* counters, long long chunk, {kv} pg) {{",
                f"  cubridge::attention_decode<Cfg, Variant, {t}, {str(paged).lower()}, {kv}>(a, p, part_o, "
                "part_lse, counters, (int)chunk, pg);",
                "}", ""]
    if tile.kernel == "sm90":  # paged: the block tables after the tensor maps (K's and V's map the pages)
        tma = "const __grid_constant__ cubridge::TmaDesc"
        pg = ", cubridge::PagedKV pg" if paged else ""
        return [f"using Cfg = cubridge::Sm90Tile<{head_dim}, {tile.dv}, {tile.block_m}, {tile.block_n}, {tile.stages}, {int(tile.own_o)}, "
                f"{int(tile.persistent)}>;",
                'extern "C" __global__ void __launch_bounds__(Cfg::kThreads, 1)',
                f"{KERNEL_NAME}(cubridge::FwdArgs a, Variant::Params p, {tma} tq, {tma} tk, {tma} tv{pg}) {{",
                f"  cubridge::attention_fwd_sm90<Cfg, Variant, {t}, {str(paged).lower()}>(a, p, &tq, &tk, &tv, "
                f"{'pg' if paged else 'cubridge::PagedKV{}'});", "}", ""]
    pg = ", cubridge::PagedKV pg" if paged else ""  # paged: the block tables after Params
    return [f"using Cfg = cubridge::FwdConfig<{head_dim}, {t}, {tile.dv}>;",
            'extern "C" __global__ void __launch_bounds__(Cfg::kThreads, 1)',
            f"{KERNEL_NAME}(cubridge::FwdArgs a, Variant::Params p{pg}) {{",
            f"  cubridge::attention_fwd<Cfg, Variant, {t}{', true' if paged else ''}>(a, p{', pg' if paged else ''});",
            "}", ""]


def decode_refusal(p: Program, head_dim: int, value_dim: int | None = None, paged: bool = False) -> str | None:
    """Why the decode kernel cannot serve this program at these head dims; None when it can. paged: K
    and V read in place (pages or pieces)."""
    return decode_dims_refusal(head_dim, value_dim) or (in_place_refusal(p) if paged else None)


def in_place_refusal(p: Program) -> str | None:
    """Why no kernel reads this program's K and V in place (pages or pieces); None where one may."""
    if p.empty_rows == "mean_v":
        return "rows with every key masked take the mean of V, which the kernels read in one piece only"
    return None


def program_tile(p: Program, arch: str, head_dim: int, value_dim: int | None = None, decode: bool = False,
                 paged: bool = False) -> Tile:
    """The tile lower() builds this program's kernel with."""
    if decode:
        return decode_tile(head_dim, value_dim, paged)
    return tile_for(head_dim, arch, value_dim, plain_scores=p.mask is None and default_scale(p) is not None)


def lower(p: Program, arch: str = "sm_90", dtype: str = "bfloat16", head_dim: int = 128,
          fast_tanh: bool = True, decode: bool = False, value_dim: int | None = None,
          paged: bool = False, segmented: bool = False) -> Lowered:
    """The translation unit of the prefill kernel for `arch`, or with `decode` of the decode kernel.
    `value_dim`: V's head dim where it differs from Q's and K's (the Hopper kernel takes that).
    `paged`: the kernel reads K and V from pages through block tables (ir/paged.py);
    `segmented`: the decode kernel reads them as the pieces the spec concatenates (ir/segments.py)."""
    from ..errors import UnsupportedSpec
    if dtype not in _DTYPES:
        raise UnsupportedSpec(f"the kernel computes in bfloat16 or float16, not {dtype}", op="lower")
    if segmented and not decode:
        raise UnsupportedSpec("K and V are read in place as pieces only by the decode kernel", op="lower")
    why = decode_refusal(p, head_dim, value_dim, paged or segmented) if decode else \
        in_place_refusal(p) if paged else None
    if why:
        raise UnsupportedSpec(why, op="lower")
    if decode and p.block_rule == "prepass":
        # a few query rows read every key once: a block map would cost a pass over the mask's data as
        # large as the kernel's. Blocks are classed by the index rule with the loads unknown (a block
        # the rule cannot rule out is partial), and the mask reads its data per element there.
        p = replace(p, block_rule="interval")
    tile = program_tile(p, arch, head_dim, value_dim, decode, paged)
    fast = fast_tanh and "tanh" in str(p.score)
    variant, fields, scale = variant_source(p, head_dim, fast, tile.block_m, tile.block_n, tile.kernel)
    prepass = []
    if p.block_rule == "prepass":
        prepass = [
            f'extern "C" __global__ void __launch_bounds__({PREPASS_THREADS})',
            f"{PREPASS_NAME}(cubridge::FwdArgs a, Variant::Params p, long long hb) {{",
            f"  cubridge::block_prepass<Variant, {tile.block_m}, {tile.block_n}, {PREPASS_THREADS}>(a, p, p.blk, (int)hb);",
            "}",
            f'extern "C" __global__ void __launch_bounds__({PREPASS_THREADS})',
            f"{SCAN_NAME}(int* table, long long rows, long long nk) {{",
            f"  cubridge::block_scan<{PREPASS_THREADS}>(table, rows, (int)nk);",
            "}",
            "",
        ]
    t = _DTYPES[dtype]
    src = "\n".join([
        "// Generated by torch_cubridge.lower from a CuIR program. Do not edit.",
        {"sm90": '#include "cubridge/fwd_kernel_sm90.cuh"', "decode": '#include "cubridge/decode_kernel.cuh"'}.get(
            tile.kernel, '#include "cubridge/fwd_kernel.cuh"'),
        '#include "cubridge/interval.cuh"',
        '#include "cubridge/fastmath.cuh"',
        '#include "cubridge/block_prepass.cuh"',
        "",
        variant,
        "",
    ] + _entry(tile, head_dim, t, paged, segmented) + prepass)
    return Lowered(src, DECODE_NAME if decode else KERNEL_NAME, tile, tuple(fields), scale, dtype, fast,
                   PREPASS_NAME if prepass else None, paged, segmented)
