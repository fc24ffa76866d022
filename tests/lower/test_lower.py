"""Lowering on the CPU: generated hook code, and every accepted variant compiles
for sm_80 and sm_90 with the local nvcc (no GPU needed)."""
import itertools
import re
import shutil

import pytest
import torch

import torch_cubridge as tc
from torch_cubridge.config import csrc_dir
from torch_cubridge.lower import lower
from torch_cubridge.errors import UnsupportedSpec
from torch_cubridge.lower.tiles import TILES, decode_tile, fwd_band, pad16, pad64, sm90_tile, tile_for
from zoo import CASES

LOWERED = CASES
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None and not (
    __import__("pathlib").Path("/usr/local/cuda/bin/nvcc").exists()), reason="no nvcc")


def _prog(name, D=64):
    c = next(c for c in CASES if c.name == name)
    return tc.transfer(c.fn, *c.make(2, 4, 2, 70, D, torch.float32))


# Hopper head dims: the fast paths, padded ones, wide ones (no O buffer for 256) and Dv != D
SM90_DIMS = [(64, 64), (128, 128), (256, 256), (32, 32), (96, 96), (192, 192), (40, 72), (256, 64), (64, 256)]


def test_tiles_agree_with_kernel_config():
    text = (csrc_dir() / "cubridge" / "fwd_config.cuh").read_text()
    for band, t in TILES.items():
        m = re.search(rf"FwdBand<D, {band}> : FwdTile<D, (\d+), (\d+), (\d+), (\d+)", text)
        assert m, band
        assert tuple(map(int, m.groups())) == (t.block_m, t.block_n, t.warps, t.stages)
    # the band rule, read from the header and evaluated against lower/tiles.py's fwd_band
    rule = re.search(r"constexpr int fwd_band\(int d, int dv\) \{\s*return ([^;]+);", text).group(1)
    py_rule = re.sub(r"imax_c", "max", re.sub(r"^(.+?) \? (.+?) : (.+)$", r"(\2) if \1 else (\3)", rule.strip()))
    for D, Dv in itertools.product(range(8, 257, 8), (8, 40, 64, 128, 200, 256)):
        got = eval(py_rule.replace("/", "//"), {"d": D, "dv": Dv, "max": max})  # noqa: S307
        assert got == fwd_band(D, Dv) and got in TILES, (D, Dv, py_rule)
    # Sm90Tile: 64-row consumer warpgroups plus a producer; lower/tiles.py's sm90_tile sizes the launch
    assert "kConsumers = BM / 64" in text and "kThreads = 128 * (1 + kConsumers)" in text
    for D, Dv in SM90_DIMS:
        narrow = max(pad64(D), pad64(Dv)) == 64  # three consumers where both head dims pad to 64 ...
        for name, plain in (("causal_sdpa", False), ("full_matmul", True)):  # ... and the scores are plain
            t = sm90_tile(D, Dv, plain)
            assert (t.block_m, t.threads) == ((192, 512) if narrow and plain else (128, 384)), (D, Dv, name)
            head = f"Sm90Tile<{D}, {Dv}, {t.block_m}, {t.block_n}, {t.stages}, {int(t.own_o)}, {int(t.persistent)}>"
            assert head in lower(_prog(name, D), arch="sm_90a", head_dim=D, value_dim=Dv).source, (D, Dv, name)


def test_hopper_kernel_is_chosen_on_sm90a_only():
    assert tile_for(128, "sm_90a").kernel == "sm90" and tile_for(128, "sm_90").kernel == "sm80"
    assert tile_for(256, "sm_90a").smem_bytes <= 232448
    assert tile_for(40, "sm_90a", 72).kernel == "sm90"  # any head dims in steps of 8 on Hopper
    for D in (36, 264):
        with pytest.raises(UnsupportedSpec):
            tile_for(D, "sm_90a")
    # the FA2 kernel: any head dims in steps of 8, V narrower or wider than Q
    assert tile_for(64, "sm_90", 32).dv == 32 and tile_for(40, "sm_90").head_dim == 40
    assert tile_for(64, "sm_90", 128).warps == 8  # a wide V: 16-row warps (fwd_band)
    for dims in ((36, 36), (64, 44), (264, 264)):
        with pytest.raises(UnsupportedSpec, match="steps of 8"):
            tile_for(dims[0], "sm_90", dims[1])
    src = lower(_prog("causal_sdpa"), arch="sm_90a").source
    assert "attention_fwd_sm90" in src and "__grid_constant__ cubridge::TmaDesc" in src


def test_default_scale_is_folded_and_scalars_are_parameters():
    low = lower(_prog("sliding_window"))
    assert low.scale is not None                    # s * c: the kernel folds c into exp2
    assert "static float score" not in low.source    # so no score hook is generated
    assert "(int)p.p1" in low.source                 # the window is a kernel argument, not a literal
    assert any(f.kind == "i64" for f in low.params)


def test_softcap_uses_fast_tanh_and_a_reciprocal():
    src = lower(_prog("softcap_causal")).source
    assert "tanh_fast" in src and "(1.0f /" in src
    assert "tanhf" in lower(_prog("softcap_causal"), fast_tanh=False).source


def test_document_mask_loads_through_strides():
    low = lower(_prog("document_causal"))
    assert "p.doc_s1" in low.source
    # data-dependent mask: a runtime pre-pass classifies tiles, block_class reads its table
    assert low.prepass and low.prepass in low.source and "p.blk + " in low.source
    assert not lower(_prog("causal_sdpa")).prepass
    # the table holds live counts, so it answers for a span of key blocks too
    assert "cubridge::table_class(" in low.source and "cubridge_block_scan" in low.source
    # the pre-pass's cheaper tests: the index rule (loads unknown), then the ids' bounds per tile axis
    assert "kBoundSites = 2" in low.source and "iv_eq(lb[0], lb[1])" in low.source
    assert "iv_eq(cubridge::iv_unknown(), cubridge::iv_unknown())" in low.source


def test_tiled_head_map_overrides_the_kv_head_hook():
    assert "h % static_cast<int>(a.Hkv)" in lower(_prog("gqa_tile_repeat")).source
    assert "kv_head" not in lower(_prog("gqa_expand")).source  # the kernel's default: h // (H // Hkv)


# (source, arch) -> cubin: 34 zoo cases lower to 22 sources (the plain full-attention styles to one), and
# compiling the same source for the same arch again proves nothing new
_CUBINS: dict[tuple[str, str], bytes] = {}


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("case", LOWERED, ids=[c.name for c in LOWERED])
def test_cubin_compiles(case, arch):
    p = tc.transfer(case.fn, *case.make(2, 4, 2, 70, 64, torch.float32))
    key = (tc.cuda_source(p, arch=arch, dtype="bfloat16", head_dim=64), arch)
    if key not in _CUBINS:
        _CUBINS[key] = tc.cubin(p, arch=arch, dtype="bfloat16", head_dim=64)
    cubin = _CUBINS[key]
    assert cubin[:4] == b"\x7fELF" and b"cubridge_fwd" in cubin


def _sass(cubin: bytes, tmp_path) -> str:
    import subprocess
    try:
        import triton  # its wheel carries cuobjdump
    except ImportError:
        pytest.skip("no cuobjdump (pip install triton)")
    tool = __import__("pathlib").Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        pytest.skip("no cuobjdump in the triton wheel")
    f = tmp_path / "k.cubin"
    f.write_bytes(cubin)
    return subprocess.run([str(tool), "-sass", str(f)], capture_output=True, text=True, check=True).stdout


@needs_nvcc
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("name", ["causal_sdpa", "softcap_causal", "document_causal", "full_matmul"])
def test_sm90a_cubin_uses_wgmma_and_tma(name, D, tmp_path):
    """The Hopper kernel is on the fast path: warpgroup MMA (HGMMA) fed by bulk tensor copies (UTMALDG)."""
    cubin = tc.cubin(_prog(name, D), arch="sm_90a", dtype="bfloat16", head_dim=D)
    sass = _sass(cubin, tmp_path)
    assert "HGMMA" in sass and "UTMALDG" in sass and "USETMAXREG" in sass
    assert "HMMA" not in sass.replace("HGMMA", "")  # no mma.sync left on this path
    assert "LDL" not in sass and "STL" not in sass  # no local-memory spills


@needs_nvcc
@pytest.mark.parametrize("dims", [(32, 32), (40, 72), (96, 96), (192, 192), (64, 256), (256, 64)],
                         ids=lambda d: f"{d[0]}x{d[1]}")
@pytest.mark.parametrize("name", ["softcap_causal", "document_causal"])
def test_sm90a_any_head_dims_build_without_spills(name, dims, tmp_path):
    """Head dims in steps of 8, padded to 64-column chunks, and Dv != D: still wgmma fed by TMA, no spills."""
    D, Dv = dims
    sass = _sass(tc.cubin(_prog(name, D), arch="sm_90a", head_dim=D, value_dim=Dv), tmp_path)
    assert "HGMMA" in sass and "UTMALDG" in sass
    assert "LDL" not in sass and "STL" not in sass


@needs_nvcc
@pytest.mark.parametrize("D", [32, 160, 192, 224, 40, 72, 200])
def test_fa2_kernel_new_head_dims_build_without_spills(D, tmp_path):
    """Head dims in steps of 8: those not a multiple of 16 are computed over zeroed pad columns."""
    sass = _sass(tc.cubin(_prog("document_causal", D), arch="sm_80", head_dim=D), tmp_path)
    assert "HMMA" in sass and "LDL" not in sass and "STL" not in sass


def test_sm90_shared_memory_agrees_with_the_kernel_header():
    """lower/tiles.py sizes the launch; Sm90Tile::kSmemBytes is what the kernel lays out. Same formula."""
    text = (csrc_dir() / "cubridge" / "fwd_config.cuh").read_text()
    rhs = re.search(r"struct Sm90Tile.*?kSmemBytes\s*=\s*([^;]+);", text, re.S).group(1)
    for (D, Dv), plain in itertools.product(SM90_DIMS, (False, True)):
        t = sm90_tile(D, Dv, plain)
        expr = re.sub(r"\bkPadDv\b", str(pad64(Dv)), re.sub(r"\bkPadD\b", str(pad64(D)), rhs))
        expr = re.sub(r"\bOwnO\b", str(int(t.own_o)), re.sub(r"\bStages\b", str(t.stages),
                      re.sub(r"\bBN\b", str(t.block_n), re.sub(r"\bBM\b", str(t.block_m), expr))))
        assert re.fullmatch(r"[\d\s+*()]+", expr), expr  # only numbers left: safe to evaluate
        assert eval(expr) == t.smem_bytes, (D, expr)  # noqa: S307


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_decode_kernel_builds_without_spills(arch, D, tmp_path):
    """Few-query calls: the split-KV decode kernel (mma.sync on every arch), whose last split merges
    the others in the same launch (no combine kernel)."""
    low = lower(_prog("softcap_causal", D), arch=arch, head_dim=D, decode=True)
    assert low.kernel == "cubridge_decode" and "combine" not in low.source and "int* counters" in low.source
    assert low.tile.kernel == "decode" and low.tile.threads == 128
    sass = _sass(tc_cubin(low.source, arch), tmp_path)
    assert "HMMA" in sass and "LDL" not in sass and "STL" not in sass


@needs_nvcc
@pytest.mark.parametrize("D,DV", [(192, 128), (96, 64), (64, 32), (64, 128), (40, 72), (64, 256)])
def test_fa2_kernel_takes_a_value_head_dim_of_its_own(D, DV, tmp_path):
    """Multi-head latent attention's prefill on the FA2-class kernel (sm_80), and V wider than Q: V's own
    pitch, O staged in Q's rows (the wider pitch); shared memory as lower/tiles.py sizes it."""
    low = lower(_prog("softcap_causal", D), arch="sm_80", head_dim=D, value_dim=DV)
    assert f"FwdConfig<{D}, __nv_bfloat16, {DV}>" in low.source and low.tile.dv == DV
    assert low.tile.smem_bytes <= TILES[fwd_band(D, DV)].smem_bytes
    sass = _sass(tc_cubin(low.source, "sm_80"), tmp_path)
    assert "HMMA" in sass and "LDL" not in sass and "STL" not in sass


@needs_nvcc
@pytest.mark.parametrize("D,DV", [(48, 32), (192, 128), (64, 128), (40, 40), (72, 72), (40, 72), (200, 200)])
def test_decode_kernel_takes_a_value_head_dim_of_its_own(D, DV, tmp_path):
    """Multi-head latent attention decodes with V narrower than Q and K (deepseek: 192 and 128); head dims
    in steps of 8 (computed over zeroed pad columns)."""
    low = lower(_prog("softcap_causal", D), arch="sm_90a", head_dim=D, decode=True, value_dim=DV)
    assert f"DecodeTile<{D}, {DV}, " in low.source and low.tile.dv == DV
    sass = _sass(tc_cubin(low.source, "sm_90a"), tmp_path)
    assert "HMMA" in sass and "LDL" not in sass and "STL" not in sass


def tc_cubin(source: str, arch: str) -> bytes:
    from torch_cubridge.build import compile_cubin
    return compile_cubin(source, arch, include_dirs=[csrc_dir()])


@needs_nvcc
def test_decode_kernel_reads_data_masks_per_element(tmp_path):
    """Few query rows read each key once: no block-map pre-pass. The decode kernel classes blocks by
    the index rule with the loads unknown and evaluates the mask (reading the ids) per element."""
    prog = _prog("document_causal")
    assert prog.block_rule == "prepass"
    low = lower(prog, arch="sm_90a", head_dim=128, decode=True)
    assert low.prepass is None and not any(f.name.startswith("blk") for f in low.params)
    assert "doc" in low.source and "iv_class" in low.source
    sass = _sass(tc_cubin(low.source, "sm_90a"), tmp_path)
    assert "HMMA" in sass and "LDL" not in sass and "STL" not in sass


def test_decode_kernel_smem_matches_the_header():
    text = (csrc_dir() / "cubridge" / "decode_kernel.cuh").read_text()
    ring = re.search(r"kRingBytes\s*=\s*([^;]+);", text).group(1)
    merge = re.search(r"kMergeBytes\s*=\s*([^;]+);", text).group(1)
    for D, DV in ((64, 64), (128, 128), (256, 256), (48, 32), (192, 128), (64, 256), (40, 40), (72, 200)):
        t = decode_tile(D, DV)
        env = {"kRows": t.block_m, "kStages": t.stages, "kBlockN": t.block_n, "kSmemLd": pad16(D) + 8,
               "kSmemLdV": pad16(DV) + 8, "kWarps": t.warps, "kPadDv": pad16(DV), "D": D, "DV": DV}
        val = [eval(re.sub(r"\b(\w+)\b", lambda m: str(env.get(m.group(1), m.group(1))), e)) for e in (ring, merge)]  # noqa: S307
        assert max(val) == t.smem_bytes, (D, val)


def test_fa2_smem_matches_the_header():
    """lower/tiles.py sizes the FA2-class kernel's launch; FwdValueDim::kSmemBytes is what it lays out."""
    text = (csrc_dir() / "cubridge" / "fwd_config.cuh").read_text()
    rhs = re.search(r"struct FwdValueDim.*?kSmemBytes\s*=\s*([^;]+);", text, re.S).group(1)
    for D, DV in ((64, 64), (128, 128), (40, 40), (72, 200), (192, 128), (64, 256), (256, 256)):
        t = tile_for(D, "sm_80", DV)
        ld, ldv = pad16(D) + 8, pad16(DV) + 8
        env = {"Base::kBlockM": t.block_m, "Base::kStages": t.stages, "Base::kBlockN": t.block_n,
               "Base::kSmemLd": ld, "kSmemLdV": ldv, "kSmemLdQ": max(ld, ldv)}
        expr = re.sub(r"\b(Base::)?\w+\b", lambda m: str(env.get(m.group(0), m.group(0))), rhs)
        assert re.fullmatch(r"[\d\s+*()]+", expr), expr
        assert eval(expr) == t.smem_bytes, (D, DV, expr)  # noqa: S307


def key_padding(q, k, v, pad):
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    return s.masked_fill(~pad[:, None, None, :], float("-inf")).softmax(-1) @ v


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_bool_extra_tensor_compiles(arch):
    """A boolean mask tensor is read as bytes (__ldg has no bool overload; NVRTC refused it)."""
    q, k, v = (torch.randn(2, 4, 70, 64) for _ in range(3))
    p = tc.transfer(key_padding, q, k, v, torch.rand(2, 70) > 0.3)
    assert p.extras[0].dtype == "bool"
    assert tc_cubin(lower(p, arch=arch, head_dim=64).source, arch)


def doc_mod_buckets(q, k, v, doc):
    """int64 ids through Python's modulo (bucketed documents)."""
    same = (doc[:, None, :, None] % 4) == (doc[:, None, None, :] % 4)
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    return s.masked_fill(~same, float("-inf")).softmax(-1) @ v


@needs_nvcc
def test_int64_tensor_modulo_compiles():
    """py_mod deduces one integer type: an int64 load against an int constant did not compile."""
    q, k, v = (torch.randn(2, 4, 70, 64) for _ in range(3))
    p = tc.transfer(doc_mod_buckets, q, k, v, torch.randint(-50, 50, (2, 70)))
    src = lower(p, arch="sm_90a", head_dim=64).source
    assert "py_mod<long long>" in src
    assert tc_cubin(src, "sm_90a")


def doc_capped(q, k, v, doc):
    """int64 ids capped by a Python int: min(long long, int) has no CUDA overload."""
    same = doc[:, None, :, None].clamp(max=3) == doc[:, None, None, :].clamp(max=3)
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    return s.masked_fill(~same, float("-inf")).softmax(-1) @ v


@needs_nvcc
def test_int64_tensor_min_compiles():
    q, k, v = (torch.randn(2, 4, 70, 64) for _ in range(3))
    p = tc.transfer(doc_capped, q, k, v, torch.randint(0, 6, (2, 70)))
    src = lower(p, arch="sm_90a", head_dim=64).source
    assert "min((long long)(" in src
    assert tc_cubin(src, "sm_90a")


def test_a_per_sequence_length_classes_decode_blocks_by_its_value():
    """A mask load with no query or key index (len[b]) is one value over a tile: the decode kernel's block rule
    reads it, so blocks past a sequence's length are empty (skipped) and blocks inside it full. A load along
    the keys stays unknown (the block is partial)."""
    def lengths(q, k, v, lens):
        keep = torch.arange(k.shape[2])[None, :] < lens[:, None]
        s = (q @ k.transpose(-1, -2)).masked_fill(~keep[:, None, None, :], float("-inf"))
        return torch.softmax(s, -1) @ v

    def per_key(q, k, v, bias):
        s = (q @ k.transpose(-1, -2)).masked_fill(bias[:, None, None, :] < 0, float("-inf"))
        return torch.softmax(s, -1) @ v
    q, k, v = torch.randn(2, 4, 1, 64), torch.randn(2, 4, 256, 64), torch.randn(2, 4, 256, 64)
    src = lower(tc.transfer(lengths, q, k, v, torch.tensor([100, 256])), arch="sm_90a", head_dim=64,
                decode=True).source
    rule = re.search(r"static int block_class\(.*?\n(.*?)\n", src).group(1)
    assert "iv_exact((double)(__ldg(&p.lens" in rule and "iv_unknown" not in rule
    src = lower(tc.transfer(per_key, q, k, v, torch.randn(2, 256)), arch="sm_90a", head_dim=64, decode=True).source
    assert "iv_unknown" in re.search(r"static int block_class\(.*?\n(.*?)\n", src).group(1)


def keys_below_a_threshold(q, k, v, thr):
    """Keys before a per-sequence float64 threshold, compared in float64 as torch does."""
    kv = torch.arange(k.shape[2], dtype=torch.float64)
    keep = kv[None, :] < thr[:, None]
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    return s.masked_fill(~keep[:, None, None, :], float("-inf")).softmax(-1) @ v


@needs_nvcc
def test_a_float64_value_is_compared_in_float64():
    """A float64 tensor read by the mask is compared in float64 by the kernel and by the interpreter that models
    it (in fp32 64.0000001 reads as 64, which dropped key 64 where the spec keeps it); the block rule reads it
    as a point only where fp32 holds it."""
    from torch_cubridge.ir.interpreter import run_program
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, s, 64, generator=g) for s in (1, 256, 256))
    k[:, :, 64] = 4 * q[:, :, 0]  # key 64 dominates its row: dropping it moves the output
    thr = torch.tensor([64.0000001, 200.5], dtype=torch.float64)
    p = tc.transfer(keys_below_a_threshold, q, k, v, thr)
    src = lower(p, arch="sm_90a", head_dim=64, decode=True).source
    assert "< __ldg(&p.thr" in src and "iv_exact((double)(__ldg(&p.thr" in src
    assert tc_cubin(src, "sm_90a")
    want = keys_below_a_threshold(*(x.double() for x in (q, k, v)), thr)
    got = run_program(p, q.bfloat16(), k.bfloat16(), v.bfloat16(), thr)  # the kernel's arithmetic: fp32 work
    assert (got.double() - want).abs().max() < 5e-2


def test_a_mask_that_never_reads_the_head_is_classed_once_per_tile():
    """kClassByHead: false where the mask never reads h (a per-sequence length), so the decode kernel classes a
    tile of several query heads once; true where it does (a bias per head), and for the pre-pass rule."""
    def lengths(q, k, v, lens):
        keep = torch.arange(k.shape[2])[None, :] < lens[:, None]
        s = (q @ k.transpose(-1, -2)).masked_fill(~keep[:, None, None, :], float("-inf"))
        return torch.softmax(s, -1) @ v

    def per_head(q, k, v, bias):
        s = (q @ k.transpose(-1, -2)).masked_fill(bias[None, :, None, :] < 0, float("-inf"))
        return torch.softmax(s, -1) @ v
    q, k, v = torch.randn(2, 4, 1, 64), torch.randn(2, 4, 256, 64), torch.randn(2, 4, 256, 64)
    src = lower(tc.transfer(lengths, q, k, v, torch.tensor([100, 256])), arch="sm_90a", head_dim=64,
                decode=True).source
    assert "kClassByHead = false" in src
    src = lower(tc.transfer(per_head, q, k, v, torch.randn(4, 256)), arch="sm_90a", head_dim=64, decode=True).source
    assert "kClassByHead = true" in src


@needs_nvcc
@pytest.mark.parametrize("D,DV", [(64, 64), (128, 128), (192, 128), (256, 256)])
def test_paged_decode_kernel_builds_without_spills(D, DV, tmp_path):
    """The paged decode kernel (two CTAs a multiprocessor: at most 255 registers a thread) with its K/V ring
    swizzled at head dims 64 and 128 (copy.cuh tile_chunk) and padded otherwise; pages of 16, the per-row
    walk, slots-first pages with an int32 table (the most words a row). D 256 (Gemma) holds 16 rows' table entries
    a thread a block ahead: one register an entry (paged.cuh Entry), Q read from shared memory (it spilled 344
    bytes with two an entry and Q in registers)."""
    import paged_specs as ps
    from torch_cubridge.capture.trace import bind_example
    from torch_cubridge.pipeline import transfer_stage
    q, kp, vp, table, _ = ps.pages(2, 8, 2, 100, D, 16, torch.float32, slots_first=True)
    vp = torch.randn(*vp.shape[:-1], DV)
    res = transfer_stage(ps.flash_slots_first, bind_example(ps.flash_slots_first, (q, kp, vp, table), {}))
    low = lower(res.program, "sm_90a", "bfloat16", D, decode=True, value_dim=DV, paged=True)
    sass = _sass(tc_cubin(low.source, "sm_90a"), tmp_path)
    assert "HMMA" in sass and "LDGSTS" in sass and "LDL" not in sass and "STL" not in sass
