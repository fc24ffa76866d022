"""The whole translation unit for one program: headers, Variant, extern "C" kernel."""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import UnsupportedSpec
from ..ir.expr import Expr, substitute
from ..ir.program import Program
from .choice import C_TYPES, KernelChoice, choose
from .tiles import Tile
from .variant import ParamField, variant_source

KERNEL_NAME = "cubridge_fwd"
DECODE_NAME = "cubridge_decode"
PREPASS_NAME = "cubridge_block_prepass"
SCAN_NAME = "cubridge_block_scan"
PREPASS_THREADS = 128
_UNSTATED = ("sm_90", "bfloat16", 128, None, False, False, False)  # lower()'s defaults, arch to segmented


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
        # registers (three CTAs per SM) and, with the present split merge, spilled one around the loop; the
        # split rule never puts more than two on one SM. The other decode kernels keep the bound their H100
        # figures were measured with; one CTA per SM there too, not yet measured.
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


def prepass_entries(block_m: int, block_n: int) -> list[str]:
    """The block-class pre-pass and its scan (block_prepass.cuh) for a kernel of block_m x block_n tiles: the
    table they write is the one that kernel's block_class reads (the forward's, and the backward's own)."""
    return [
        f'extern "C" __global__ void __launch_bounds__({PREPASS_THREADS})',
        f"{PREPASS_NAME}(cubridge::FwdArgs a, Variant::Params p, long long hb) {{",
        f"  cubridge::block_prepass<Variant, {block_m}, {block_n}, {PREPASS_THREADS}>(a, p, p.blk, (int)hb);",
        "}",
        f'extern "C" __global__ void __launch_bounds__({PREPASS_THREADS})',
        f"{SCAN_NAME}(int* table, long long rows, long long nk) {{",
        f"  cubridge::block_scan<{PREPASS_THREADS}>(table, rows, (int)nk);",
        "}",
        "",
    ]


def _with_head_dim(p: Program, head_dim: int) -> Program:
    """p with its expressions' D (the head dim, which the generated code bakes in) the constant head_dim."""
    d = {"D": Expr("const", (), head_dim)}
    return replace(p, score=substitute(p.score, d), mask=None if p.mask is None else substitute(p.mask, d),
                   sink=None if p.sink is None else substitute(p.sink, d))


def lower(p: Program, arch: str = "sm_90", dtype: str = "bfloat16", head_dim: int = 128,
          fast_tanh: bool = True, decode: bool = False, value_dim: int | None = None,
          paged: bool = False, segmented: bool = False, *, choice: KernelChoice | None = None) -> Lowered:
    """The translation unit of the prefill kernel for `arch`, or with `decode` of the decode kernel.
    `value_dim`: V's head dim where it differs from Q's and K's (the Hopper kernel takes that).
    `paged`: the kernel reads K and V from pages through block tables (ir/paged.py);
    `segmented`: the decode kernel reads them as the pieces the spec concatenates (ir/segments.py).
    `choice`: the kernel already chosen (lower/choice.py), taken as given in place of the arguments from
    `arch` to `segmented`: its tile and refusal are not worked out again."""
    if choice is None:
        choice = choose(p, arch, dtype, head_dim, value_dim, decode, paged, segmented)
    elif (arch, dtype, head_dim, value_dim, decode, paged, segmented) != _UNSTATED:
        raise TypeError("lower: give the kernel either as a choice or as arguments, not both")
    if choice.refusal:
        raise UnsupportedSpec(choice.refusal, op="lower")
    tile, head_dim, decode = choice.tile, choice.head_dim, choice.decode
    if choice.pad_from is not None:  # the hooks read the call's own head dim, not the padded one the kernel takes
        p = _with_head_dim(p, choice.pad_from[0])
    if decode and p.block_rule == "prepass":
        # a few query rows read every key once: a block map would cost a pass over the mask's data as
        # large as the kernel's. Blocks are classed by the index rule with the loads unknown (a block
        # the rule cannot rule out is partial), and the mask reads its data per element there.
        p = replace(p, block_rule="interval")
    fast = fast_tanh and "tanh" in str(p.score)
    variant, fields, scale = variant_source(p, head_dim, fast, tile.block_m, tile.block_n, tile.kernel)
    prepass = prepass_entries(tile.block_m, tile.block_n) if p.block_rule == "prepass" else []
    t = C_TYPES[choice.dtype]
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
    ] + _entry(tile, head_dim, t, choice.paged, choice.segmented) + prepass)
    return Lowered(src, DECODE_NAME if decode else KERNEL_NAME, tile, tuple(fields), scale, choice.dtype, fast,
                   PREPASS_NAME if prepass else None, choice.paged, choice.segmented)
