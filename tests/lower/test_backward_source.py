"""The backward kernels' source (lower/backward.py): lowered from the forward's Variant plus a derived
score_grad hook, compiled for sm_80 and sm_90 with no spills, on the tensor cores. GPU numerics live in
benchmarks/kernel_dev/bwd_check.py."""
import re
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

import torch_cubridge as tc
from torch_cubridge.config import csrc_dir
from torch_cubridge.errors import UnsupportedSpec
from torch_cubridge.lower.backward import BwdTile, bwd_block_m, lower_backward
from zoo import CASES, PROLOGUE
from test_lower import _sass, needs_nvcc

NAMES = ["causal_sdpa", "full_matmul", "softcap_causal", "sliding_window", "gqa_expand", "document_causal"]


def _prog(name, D=64):
    c = next(c for c in CASES + PROLOGUE if c.name == name)
    return tc.transfer(c.fn, *c.make(2, 4, 2, 70, D, torch.float32))


def test_tile_fits_the_arch_and_is_checked_against_the_header():
    assert [bwd_block_m(d, "sm_80") for d in (32, 64, 96, 128)] == [64, 64, 32, 32]
    assert bwd_block_m(128, "sm_90a") == 32
    for arch in ("sm_86", "sm_89", "sm_120"):  # 99 KB of shared memory a CTA: 32 rows of 128 columns do not fit
        assert bwd_block_m(128, arch) == 16 and BwdTile(128, 16).smem_bytes <= 101376 < BwdTile(128, 32).smem_bytes
    low = lower_backward(_prog("causal_sdpa", 128), "sm_86", head_dim=128)
    assert low.tile == BwdTile(128, 16)
    assert "cubridge::BwdTile<128, 16, 8>" in low.source
    assert f"static_assert(Cfg::kSmemBytes == {low.tile.smem_bytes} && Cfg::kThreads == 256" in low.source
    assert lower_backward(_prog("causal_sdpa"), head_dim=64, block_m=16).tile.block_m == 16
    with pytest.raises(UnsupportedSpec, match="16, 32 or 64"):
        lower_backward(_prog("causal_sdpa"), head_dim=64, block_m=48)


def test_score_grad_is_derived_only_where_the_score_is_not_the_folded_scale():
    assert "score_grad" not in lower_backward(_prog("causal_sdpa")).source  # kernel default: the scale
    soft = lower_backward(_prog("softcap_causal")).source
    body = soft[soft.index("static float score_grad("):]
    body = body[:body.index("}")]
    assert "tanh" in body  # c tanh(s k / c)' = k (1 - tanh^2)


def test_entries_and_refusals():
    low = lower_backward(_prog("document_causal"), head_dim=64)
    for name in low.kernels:
        assert f"{name}(cubridge::BwdArgs a" in low.source
    # document ids: the backward's own block map (pre-pass and scan at its tile), read by its block_class
    assert low.prepass and "table_class" in low.source
    assert f"block_prepass<Variant, {low.tile.block_m}, {low.tile.block_n}," in low.source
    assert not lower_backward(_prog("causal_sdpa"), head_dim=64).prepass
    assert tc.cuda_source(_prog("gqa_expand"), backward=True).count("attention_bwd<") == 1
    assert "cubridge_bwd" in lower_backward(_prog("causal_where_finfo")).source  # mean-of-V rows: the runner's
    with pytest.raises(UnsupportedSpec, match="head dims"):
        lower_backward(_prog("causal_sdpa", 256), head_dim=256)
    with pytest.raises(UnsupportedSpec, match="head dims"):
        lower_backward(_prog("causal_sdpa", 136), head_dim=136)
    assert lower_backward(_prog("causal_sdpa", 120), head_dim=120).tile == BwdTile(120, 32)
    with pytest.raises(UnsupportedSpec, match="V's head dim"):
        lower_backward(_prog("causal_sdpa"), head_dim=64, value_dim=128)


def _ptxas(source: str, arch: str) -> tuple[bytes, str]:
    """nvcc -cubin with ptxas' report (registers and spills per entry)."""
    import shutil
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "k.cu").write_text(source)
        r = subprocess.run([nvcc, "-cubin", f"-arch={arch}", "-O3", "-std=c++17", "-Xptxas", "-v",
                            f"-I{csrc_dir()}", str(Path(d) / "k.cu"), "-o", str(Path(d) / "k.cubin")],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-4000:]
        return (Path(d) / "k.cubin").read_bytes(), r.stdout + r.stderr


def _build_case(name, arch, D, tmp_path):
    cubin, log = _ptxas(tc.cuda_source(_prog(name, D), arch=arch, head_dim=D, backward=True), arch)
    main = log[log.index("Compiling entry function 'cubridge_bwd' "):]
    main = main[:main.index("Compile time")]
    regs = int(re.search(r"Used (\d+) registers", main)[1])
    print(f"{name} {arch} D={D}: {regs} registers")
    assert " 0 bytes spill stores, 0 bytes spill loads" in main, main
    assert all(f"cubridge_bwd{x}".encode() in cubin for x in ("", "_pre", "_post"))
    sass = _sass(cubin, tmp_path)
    assert "HMMA" in sass and "LDL" not in sass and "STL" not in sass
    if arch == "sm_90":  # dQ's atomics reduce two columns a request
        assert "ADD.F32x2" in sass


@needs_nvcc
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("name", NAMES)
def test_backward_builds_without_spills_on_the_tensor_cores(name, arch, D, tmp_path):
    _build_case(name, arch, D, tmp_path)


@needs_nvcc
@pytest.mark.parametrize("name, arch, D", [("document_causal", "sm_80", 96), ("softcap_causal", "sm_90", 96),
                                           ("sliding_window", "sm_86", 128), ("causal_sdpa", "sm_80", 32),
                                           ("softcap_causal", "sm_80", 24), ("full_matmul", "sm_90", 80),
                                           ("document_causal", "sm_90", 112), ("gqa_expand", "sm_80", 56)])
def test_other_head_dims_and_archs_build(name, arch, D, tmp_path):
    """96 columns split unevenly over dQ's column groups; sm_86 takes 16 rows a step; 24 and 56 pad their
    last k16 step with zero columns."""
    _build_case(name, arch, D, tmp_path)


# The Hopper kernel at the head dims and programs the device runs measure; at 128 columns softcap's two hooks
# (tanh for the score and for its derivative) and the document mask's block-map reads spill a little, which the
# bounds below admit and no more.
HOPPER_SPILL = {("softcap_causal", 128): 64, ("document_causal", 128): 8}


@needs_nvcc
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("name", NAMES)
def test_hopper_backward_is_wgmma_fed_by_tma(name, D, tmp_path):
    """On sm_90a the backward is the Hopper kernel: warpgroup MMA (HGMMA) on operands the copy engine brought
    (UTMALDG, and the LSE and delta rows by bulk copies), dQ added by one bulk reduction (UBLKRED), dS staged for
    it by transposing matrix stores (STSM), no mma.sync, and the registers handed from the producer to the
    consumers (USETMAXREG)."""
    low = lower_backward(_prog(name, D), "sm_90a", head_dim=D)
    assert low.tile.kernel == "sm90"
    cubin = tc.cubin(_prog(name, D), arch="sm_90a", head_dim=D, backward=True)
    sass = _sass(cubin, tmp_path)
    for op in ("HGMMA", "UTMALDG", "UBLKCP", "UBLKRED", "STSM", "USETMAXREG"):
        assert op in sass, op
    assert "HMMA" not in sass.replace("HGMMA", "")
    _, log = _ptxas(low.source, "sm_90a")
    main = log[log.index("Compiling entry function 'cubridge_bwd' "):]
    spill = int(re.search(r"(\d+) bytes spill stores", main)[1])
    assert spill <= HOPPER_SPILL.get((name, D), 0), main
    # setmaxnreg.inc waits until the registers are free: the consumers may take no more than the producer
    # gave back from the launch's share, or the CTA hangs
    launch = int(re.search(r"Used (\d+) registers", main)[1])
    alloc = {int(x, 16) for x in re.findall(r"USETMAXREG\.TRY_ALLOC\S* \w+, (0x[0-9a-f]+)", sass)}
    dealloc = {int(x, 16) for x in re.findall(r"USETMAXREG\.DEALLOC\S* (0x[0-9a-f]+)", sass)}
    consumers = low.tile.threads // 128 - 1
    assert len(alloc) == len(dealloc) == 1, (alloc, dealloc)
    assert consumers * (alloc.pop() - launch) <= launch - dealloc.pop()


def test_hopper_backward_takes_what_fits_its_registers():
    """sm_90a up to head dim 128 (a consumer thread holds half of dK's and dV's padded rows); past it, and on
    other archs, the FA2-class kernel; a forced Hopper kernel where it does not fit is refused, not built."""
    assert lower_backward(_prog("causal_sdpa", 120), "sm_90a", head_dim=120).tile.kernel == "sm90"
    assert lower_backward(_prog("causal_sdpa"), "sm_90", head_dim=64).tile.kernel == "sm80"
    assert lower_backward(_prog("causal_sdpa"), "sm_90a", head_dim=64, kernel="sm80").tile.kernel == "sm80"
    with pytest.raises(UnsupportedSpec, match="Hopper backward"):
        lower_backward(_prog("causal_sdpa"), "sm_80", head_dim=64, kernel="sm90")


@needs_nvcc
def test_the_deterministic_mode_is_the_hopper_kernels(tmp_path):
    """deterministic=True: the Hopper kernel adds dQ's shares in a fixed key order, waiting on a counter (an acquiring
    load) and releasing it after its bulk reduction completes; the FA2-class kernel has no such mode."""
    low = lower_backward(_prog("causal_sdpa", 128), "sm_90a", head_dim=128, deterministic=True)
    assert "BwdSm90Tile<128, 128, 128, 2, 1>" in low.source
    cubin, _ = _ptxas(low.source, "sm_90a")
    sass = _sass(cubin, tmp_path)
    assert "UBLKRED" in sass and "LDG.E.STRONG.GPU" in sass
    default = _sass(_ptxas(lower_backward(_prog("causal_sdpa", 128), "sm_90a", head_dim=128).source, "sm_90a")[0],
                    tmp_path)
    assert "LDG.E.STRONG.GPU" not in default
    with pytest.raises(UnsupportedSpec, match="no deterministic mode"):
        lower_backward(_prog("causal_sdpa"), "sm_80", head_dim=64, deterministic=True)


@needs_nvcc
@pytest.mark.parametrize("D, DV", [(64, 128), (128, 64), (96, 32)])
def test_the_hopper_backward_takes_a_value_head_dim_of_its_own(D, DV, tmp_path):
    """V's head dim apart from Q's (both in steps of 8 up to 128): dP^T over V's columns, dV over its padded
    width, dO's boxes of its own; no spills. The FA2-class kernel still refuses it."""
    low = lower_backward(_prog("causal_sdpa", D), "sm_90a", head_dim=D, value_dim=DV)
    assert low.tile.kernel == "sm90" and f"BwdSm90Tile<{D}, {DV}," in low.source
    cubin, log = _ptxas(low.source, "sm_90a")
    main = log[log.index("Compiling entry function 'cubridge_bwd' "):]
    assert " 0 bytes spill stores" in main, main
    assert "HGMMA" in _sass(cubin, tmp_path)
    with pytest.raises(UnsupportedSpec, match="V's head dim"):
        lower_backward(_prog("causal_sdpa", D), "sm_80", head_dim=D, value_dim=DV)


def test_a_row_scaled_program_lowers_the_attention_before_its_scale():
    """PyTorch applies a row scale after the op, so the op's backward is the attention's alone: the kernel of
    a gated program is the ungated program's."""
    def gated(q, k, v, gate):
        return (torch.softmax(q @ k.transpose(-1, -2) * 0.25, dim=-1) * gate[..., None]) @ v

    def plain(q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2) * 0.25, dim=-1) @ v
    q, k, v = (torch.randn(2, 4, 70, 64) for _ in range(3))
    p = tc.transfer(gated, q, k, v, torch.rand(2, 4, 70) + 0.5)
    assert p.row_scale is not None
    assert lower_backward(p, head_dim=64).source == lower_backward(tc.transfer(plain, q, k, v), head_dim=64).source


# learnable tensors the score reads: a slope per head (a point site: summed in registers), a relative table and a
# prologue's table over distances (T5's buckets; diagonal sites: staged, then summed along the diagonals), all
# three on the Hopper kernel at sm_90a; a clamped relative table (a window of shared atomics: FA2-class only)
SITES = {"alibi_tensor": ("slopes", "point"), "rel_bias_table": ("table", "diagonal"),
         "t5_relative_bias": ("pro_index_dist", "diagonal"), "rel_bias_clamped": ("table", "window")}
# at 128 columns the sites spill a few loop-invariant words, read back a few times a step
SITE_SPILL = {("rel_bias_table", "sm_80", 128): 48, ("t5_relative_bias", "sm_80", 128): 16,
              ("rel_bias_table", "sm_90a", 128): 32, ("t5_relative_bias", "sm_90a", 128): 32,
              ("alibi_tensor", "sm_90a", 128): 32}


def _learnable(p):
    return tuple(x.name for x in p.extras if x.dtype.startswith(("float", "bfloat")))


@pytest.mark.parametrize("D", [64, 128])
def test_learnable_sites_choose_their_kernel(D):
    """Point and diagonal sites beside a scaled score: the Hopper kernel; a window: the FA2-class one (and the
    Hopper kernel refuses it when asked); no learnable tensor: no sites at all."""
    from torch_cubridge.lower.sites import score_sites, site_smem
    for name, (tensor, kind) in SITES.items():
        p = _prog(name, D)
        low = lower_backward(p, "sm_90a", head_dim=D, learnable=_learnable(p))
        sites = score_sites(p, _learnable(p))
        assert [s.kind for s in sites] == [kind], name
        assert low.tile.kernel == ("sm80" if kind == "window" else "sm90") and low.sites == (tensor,), name
        assert low.site_smem == site_smem(sites, low.tile.block_m, low.tile.block_n, low.tile.kernel)
        assert (low.site_smem == 0) == (kind == "point") and low.smem_bytes == low.tile.smem_bytes + low.site_smem
        assert low.smem_bytes <= 232448 and f"float* {tensor}_g;" in low.source and "site_add" in low.source
        assert lower_backward(p, "sm_80", head_dim=D, learnable=_learnable(p)).tile.kernel == "sm80"
        plain = lower_backward(p, "sm_90a", head_dim=D)
        assert plain.tile.kernel == "sm90" and not plain.sites and "site_add" not in plain.source
        if kind == "window":
            with pytest.raises(UnsupportedSpec, match="Hopper backward kernel cannot"):
                lower_backward(p, "sm_90a", head_dim=D, kernel="sm90", learnable=_learnable(p))
        with pytest.raises(UnsupportedSpec, match="deterministic"):
            lower_backward(p, "sm_90a", head_dim=D, learnable=_learnable(p), deterministic=True)


def test_the_hopper_kernel_refuses_sites_it_cannot_recover():
    """It keeps neither s nor a per-pair dscore/ds between P and dS: a temperature (d score / d t = s) and a
    softcapped score with a table (dscore/ds varies per pair) go to the FA2-class kernel."""
    from dataclasses import replace
    from torch_cubridge.ir.expr import call, const, load, var, walk
    from torch_cubridge.lower.sites import hopper_site_refusal, score_sites
    p = _prog("rel_bias_table")
    tile = type("T", (), {"smem_bytes": 0, "block_m": 64, "block_n": 128})()
    table = next(n for n in walk(p.score) if n.op == "load")
    temp = replace(p, score=call("mul", var("s"), load("table", var("h"), const(0))))  # a temperature per head
    assert "reads the score" in hopper_site_refusal(temp, score_sites(temp, ("table",)), tile, 232448)
    capped = replace(p, score=call("add", call("tanh", var("s")), table))
    assert "varies" in hopper_site_refusal(capped, score_sites(capped, ("table",)), tile, 232448)
    assert hopper_site_refusal(p, score_sites(p, ("table",)), tile, 232448) is None


def test_the_diagonal_rule_reads_the_index_as_a_graph():
    """a q + b kv + c with b = +-1 and c free of both is a diagonal; a clamp, a load or a product of the two
    is not."""
    from torch_cubridge.ir.expr import call, const, var
    from torch_cubridge.lower.sites import _affine
    q, kv = var("q"), var("kv")
    assert _affine(call("add", call("sub", kv, q), var("Sq"))) == (-1, 1)
    assert _affine(call("sub", call("mul", const(2), q), call("neg", kv))) == (2, 1)
    assert _affine(call("add", var("h"), const(3))) == (0, 0)
    assert _affine(call("min", call("sub", kv, q), const(8))) is None
    assert _affine(call("mul", q, kv)) is None


@needs_nvcc
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("name", sorted(SITES))
def test_learnable_sites_build_without_spills(name, arch, D, tmp_path):
    """A window's additions are shared atomics (compare-and-swap loops on these archs), a diagonal's staged
    stores; their flushes and the point sites' warp sums are global reductions. On sm_90a the Hopper kernel's
    wgmma where it takes them."""
    p = _prog(name, D)
    cubin, log = _ptxas(tc.cuda_source(p, arch=arch, head_dim=D, backward=True, learnable=_learnable(p)), arch)
    main = log[log.index("Compiling entry function 'cubridge_bwd' "):]
    main = main[:main.index("Compile time")]
    spill = int(re.search(r"(\d+) bytes spill stores", main)[1])
    assert spill <= SITE_SPILL.get((name, arch, D), 0), main
    sass = _sass(cubin, tmp_path)
    hopper = arch == "sm_90a" and SITES[name][1] != "window"
    assert ("HGMMA" if hopper else "HMMA") in sass and re.search(r"REDG?\.E\.ADD\.F32", sass)
    assert ("ATOMS.CAS" in sass) == (SITES[name][1] == "window")


def test_the_pre_and_postprocess_take_a_row_in_pieces_of_eight_columns():
    """Lanes a query row: one a 16-byte piece of the wider head dim, to a power of two; the CTA's rows follow."""
    from torch_cubridge.lower.backward import PREPOST_THREADS, lower_backward, prepost_lanes
    assert [prepost_lanes(d, d) for d in (8, 24, 64, 96, 128)] == [1, 4, 8, 16, 16]
    assert prepost_lanes(64, 128) == prepost_lanes(128, 64) == 16
    for arch, d in (("sm_90a", 64), ("sm_80", 128)):
        low = lower_backward(_prog("causal_sdpa", d), arch, "bfloat16", d)
        lanes = prepost_lanes(d, d)
        assert low.prepost_rows == PREPOST_THREADS // lanes
        assert f", {lanes}>(a);" in low.source  # both kernels instantiated with those lanes
