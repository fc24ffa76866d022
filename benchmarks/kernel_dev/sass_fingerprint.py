"""SASS fingerprints of the kernels the library builds, without a GPU: a check that a change to the kernel
headers (csrc/cubridge/*.cuh) left the machine code alone.

For a fixed set of programs (plain, causal, softcap, ALiBi, sliding window, a document mask read from data
with the block pre-pass, the log-sum-exp output, GQA, empty rows that take the mean of V) it asks the package
for the translation unit the library would build (`torch_cubridge.lower.lower`, which picks the tile as a call
would: FA2-class for sm_80; the Hopper kernel for sm_90a with three or two consumers, persistent or not, with
or without its own O buffer; the decode kernel at head dims 64, 128 and 256, paged (also with V narrower than
K), segmented; paged prefill on both prefill kernels), compiles each with nvcc as torch_cubridge/build/nvcc.py
does (`-cubin`, the arch flags, `-O3 -std=c++17 -I csrc`; plus `-Xptxas -v`, which only reports), disassembles
it with `cuobjdump -sass` and prints per build:

    name  arch  sha256 of the SASS (16 hex)  instructions  registers  spill bytes (stores/loads)  stack

Builds run one after another (a few seconds each). Typical use, around a refactor:

    python benchmarks/kernel_dev/sass_fingerprint.py --out /tmp/sass_before.txt   # untouched tree
    ... edit the headers ...
    python benchmarks/kernel_dev/sass_fingerprint.py --out /tmp/sass_after.txt --compare /tmp/sass_before.txt

`--only a,b` runs the named builds; `--sources DIR` compiles the translation units an earlier `--keep DIR`
saved instead of lowering them again (so a change to torch_cubridge/lower beside the headers' does not move
the hashes); `--keep DIR` keeps each build's .cu, .cubin and .sass there (diff two
.sass files to see where code moved); `--list` prints the names. cuobjdump: $CUOBJDUMP, else the one on PATH
or under CUDA_HOME, else the copy that ships with triton (site-packages/triton/backends/nvidia/bin/).
The SASS text is hashed after dropping cuobjdump's header lines (file names), so the hash depends on the code only.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"


# ---- specs, written as a user would (the tests' zoo has the same kinds) ----
def plain(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, -1) @ v


def plain_gqa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def causal(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def causal_gqa_lse(q, k, v):
    s = q @ k.repeat_interleave(q.shape[1] // k.shape[1], 1).transpose(-1, -2) * q.shape[-1] ** -0.5
    n = s.shape[-1]
    keep = torch.ones(s.shape[-2], n, dtype=torch.bool, device=q.device).tril(n - s.shape[-2])
    s = s.masked_fill(~keep, float("-inf"))
    lse = s.logsumexp(-1)
    return torch.softmax(s, -1) @ v.repeat_interleave(q.shape[1] // v.shape[1], 1), lse


def softcap_causal(q, k, v):
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    s = 30.0 * torch.tanh(s / 30.0)
    n = s.shape[-1]
    keep = torch.ones(s.shape[-2], n, dtype=torch.bool, device=q.device).tril(n - s.shape[-2])
    return torch.softmax(s.masked_fill(~keep, float("-inf")), -1) @ v


def empty_rows_mean_v(q, k, v):
    """Bottom-right causal with more queries than keys and a finite fill: the first rows, every key masked,
    take the mean of V (the kernels' kEmptyRowMeanV)."""
    Sq, Skv = q.shape[-2], k.shape[-2]
    keep = torch.ones(Sq, Skv, dtype=torch.bool, device=q.device).tril(diagonal=Skv - Sq)
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return s.masked_fill(~keep, torch.finfo(s.dtype).min).softmax(-1) @ v


def alibi_causal(q, k, v):
    H, S = q.shape[1], q.shape[2]
    slopes = torch.tensor([2 ** (-8 * (h + 1) / H) for h in range(H)], device=q.device)
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    pos = torch.arange(S, device=q.device)
    s = s + slopes[:, None, None] * (pos[None, :] - pos[:, None])
    return torch.softmax(s.masked_fill(pos[:, None] < pos[None, :], float("-inf")), -1) @ v


def sliding_window(q, k, v, window: int = 48):
    i = torch.arange(q.shape[2], device=q.device)
    keep = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


def document_causal(q, k, v, doc):
    same = doc[:, None, :, None] == doc[:, None, None, :]
    S = q.shape[-2]
    keep = torch.arange(S, device=q.device)[:, None] >= torch.arange(S, device=q.device)[None, :]
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    return s.masked_fill(~(same & keep), float("-inf")).softmax(-1) @ v


def paged_slots_first(q, k_cache, v_cache, block_table):
    """flash-attn's paged cache [pages, page rows, Hkv, D], gathered and flattened."""
    k = k_cache[block_table].flatten(1, 2).transpose(1, 2)
    v = v_cache[block_table].flatten(1, 2).transpose(1, 2)
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def cached_concat(q, k_new, v_new, k_cache, v_cache):
    k = torch.cat([k_cache, k_new], dim=2)
    v = torch.cat([v_cache, v_new], dim=2)
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


# ---- example arguments (float32 on the CPU: transfer verifies against float64) ----
def qkv(B: int, H: int, Hkv: int, Sq: int, Skv: int, D: int) -> tuple:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(B, H, Sq, D, generator=g), torch.randn(B, Hkv, Skv, D, generator=g),
            torch.randn(B, Hkv, Skv, D, generator=g))


def with_docs(B: int, H: int, S: int, D: int) -> tuple:
    doc = torch.tensor([[0] * (S // 3) + [1] * (S - S // 3)] * B)
    return qkv(B, H, H, S, S, D) + (doc,)


def paged(B: int, H: int, Hkv: int, Sq: int, S: int, D: int, page: int, Dv: int | None = None) -> tuple:
    g = torch.Generator().manual_seed(0)
    per = -(-S // page)
    n = B * per + 3
    table = torch.randperm(n, generator=g)[:B * per].reshape(B, per)
    return (torch.randn(B, H, Sq, D, generator=g), torch.randn(n, page, Hkv, D, generator=g),
            torch.randn(n, page, Hkv, Dv or D, generator=g), table)


def pieces(B: int, H: int, Hkv: int, cached: int, D: int) -> tuple:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, 1, D, generator=g)
    new = tuple(torch.randn(B, Hkv, 1, D, generator=g) for _ in range(2))
    return (q,) + new + tuple(torch.randn(B, Hkv, cached, D, generator=g) for _ in range(2))


@dataclass(frozen=True)
class Build:
    name: str
    spec: Callable
    args: Callable[[], tuple]
    arch: str          # sm_80 or sm_90a
    head_dim: int
    value_dim: int | None = None
    decode: bool = False
    paged: bool = False
    segmented: bool = False


BUILDS = [
    # FA2-class kernel (mma.sync + cp.async), sm_80
    Build("fwd80_plain_d128", plain, lambda: qkv(2, 4, 4, 70, 70, 128), "sm_80", 128),
    Build("fwd80_causal_gqa_lse_d64", causal_gqa_lse, lambda: qkv(2, 4, 2, 70, 70, 64), "sm_80", 64),
    Build("fwd80_doc_prepass_d128", document_causal, lambda: with_docs(2, 4, 70, 128), "sm_80", 128),
    Build("fwd80_paged_d128", paged_slots_first, lambda: paged(2, 4, 2, 96, 200, 128, 64), "sm_80", 128, paged=True),
    # Hopper kernel (wgmma + TMA, warp-specialised), sm_90a
    Build("sm90_plain_d64_3wg", plain, lambda: qkv(2, 4, 4, 70, 70, 64), "sm_90a", 64),
    Build("sm90_causal_d128", causal, lambda: qkv(2, 4, 4, 70, 70, 128), "sm_90a", 128),
    Build("sm90_softcap_d256", softcap_causal, lambda: qkv(2, 4, 4, 70, 70, 256), "sm_90a", 256),
    Build("sm90_alibi_d128", alibi_causal, lambda: qkv(2, 4, 4, 70, 70, 128), "sm_90a", 128),
    Build("sm90_gqa_lse_d128", causal_gqa_lse, lambda: qkv(2, 4, 2, 70, 70, 128), "sm_90a", 128),
    Build("sm90_meanv_d96", empty_rows_mean_v, lambda: qkv(2, 4, 4, 100, 60, 96), "sm_90a", 96),
    Build("sm90_doc_prepass_d128", document_causal, lambda: with_docs(2, 4, 70, 128), "sm_90a", 128),
    Build("sm90_paged_d128", paged_slots_first, lambda: paged(2, 4, 2, 96, 200, 128, 16), "sm_90a", 128,
          paged=True),
    # decode kernel (split-KV, packed GQA rows), sm_90a
    Build("dec_plain_gqa_d64", plain_gqa, lambda: qkv(2, 8, 2, 1, 300, 64), "sm_90a", 64, decode=True),
    Build("dec_sliding_d128", sliding_window, lambda: qkv(2, 4, 4, 1, 300, 128), "sm_90a", 128, decode=True),
    Build("dec_softcap_d256", softcap_causal, lambda: qkv(2, 4, 4, 1, 300, 256), "sm_90a", 256, decode=True),
    Build("dec_paged_d128", paged_slots_first, lambda: paged(2, 8, 2, 1, 200, 128, 16), "sm_90a", 128,
          decode=True, paged=True),
    Build("dec_paged_d192_v128", paged_slots_first, lambda: paged(2, 8, 2, 1, 200, 192, 16, 128), "sm_90a", 192,
          value_dim=128, decode=True, paged=True),
    Build("dec_segmented_d128", cached_concat, lambda: pieces(2, 8, 2, 40, 128), "sm_90a", 128, decode=True,
          segmented=True),
]


def lowered(b: Build):
    import torch_cubridge as tc
    from torch_cubridge.lower import lower
    prog = tc.transfer(b.spec, *b.args())
    return lower(prog, b.arch, "bfloat16", b.head_dim, decode=b.decode, value_dim=b.value_dim, paged=b.paged,
                 segmented=b.segmented)


def cuobjdump() -> str:
    found = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump")
    cuda = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "cuobjdump"
    if not found and cuda.exists():
        found = str(cuda)
    if not found:
        import triton
        found = str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")
    return found


def nvcc_cmd(arch: str) -> list[str]:
    from torch_cubridge.build.nvcc import _nvcc, arch_flags
    return [str(_nvcc()), "-cubin", *arch_flags(arch), "-O3", "-std=c++17", f"-I{CSRC}", "-Xptxas", "-v"]


_PTXAS_FN = re.compile(r"Compiling entry function '(\w+)'")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_INSTR = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+\S")


def ptxas_report(text: str) -> dict[str, tuple[int, int, int, int]]:
    """kernel -> (registers, stack frame, spill stores, spill loads) from -Xptxas -v output."""
    out, fn, frame = {}, None, (0, 0, 0)
    for line in text.splitlines():
        if m := _PTXAS_FN.search(line):
            fn = m.group(1)
        elif (m := _PTXAS_SPILL.search(line)) and fn:
            frame = tuple(map(int, m.groups()))
        elif (m := _PTXAS_REGS.search(line)) and fn:
            out[fn] = (int(m.group(1)),) + frame
            fn, frame = None, (0, 0, 0)
    return out


def sass_functions(sass: str) -> dict[str, list[str]]:
    """kernel -> its SASS lines (cuobjdump's header lines, which name the file, left out)."""
    out: dict[str, list[str]] = {}
    cur = None
    for line in sass.splitlines():
        if m := re.match(r"\s*Function : (\w+)", line):
            cur = m.group(1)
            out[cur] = []
        elif cur is not None and line.strip():
            out[cur].append(line.rstrip())
    return out


def fingerprint(b: Build, keep: Path | None, sources: Path | None = None) -> str:
    low = lowered(b)
    text = (sources / f"{b.name}.cu").read_text() if sources is not None else low.source
    with tempfile.TemporaryDirectory(prefix="cubridge-sass-") as tmp:
        src, cub = Path(tmp) / "kernel.cu", Path(tmp) / "kernel.cubin"
        src.write_text(text)
        t0 = time.time()
        res = subprocess.run(nvcc_cmd(b.arch) + ["-o", str(cub), str(src)], capture_output=True, text=True)
        secs = time.time() - t0
        if res.returncode != 0:
            sys.stderr.write(res.stderr + res.stdout)
            return f"{b.name:26s} {b.arch:7s} BUILD FAILED"
        sass = subprocess.run([cuobjdump(), "-sass", str(cub)], capture_output=True, text=True, check=True).stdout
        if keep is not None:
            keep.mkdir(parents=True, exist_ok=True)
            for ext, data in ((".cu", text), (".sass", sass), (".ptxas", res.stderr + res.stdout)):
                (keep / f"{b.name}{ext}").write_text(data)
            shutil.copy(cub, keep / f"{b.name}.cubin")
    regs = ptxas_report(res.stderr + res.stdout)
    fns = sass_functions(sass)
    main = low.kernel
    code = fns.get(main, [])
    digest = hashlib.sha256("\n".join(f"{k}\n" + "\n".join(v) for k, v in sorted(fns.items())).encode()).hexdigest()
    n_instr = sum(1 for line in code if _INSTR.match(line))
    r, frame, st, ld = regs.get(main, (0, 0, 0, 0))
    return (f"{b.name:26s} {b.arch:7s} {digest[:16]}  instr {n_instr:6d}  regs {r:3d}  spill {st}/{ld}  "
            f"stack {frame}  ({low.tile.kernel} {low.tile.block_m}x{low.tile.block_n} st{low.tile.stages}"
            f"{' own_o' if low.tile.own_o else ''}{' persist' if low.tile.persistent else ''}; {secs:.0f} s)")


def compare(lines: list[str], before: Path) -> int:
    """Prints each build whose hash moved, with both lines; returns how many."""
    old = {ln.split()[0]: ln for ln in before.read_text().splitlines() if ln.strip()}
    moved = 0
    for ln in lines:
        name, h = ln.split()[0], ln.split()[2]
        prev = old.get(name)
        if prev is None or prev.split()[2] != h:
            moved += 1
            print(f"DIFFERS {name}\n  before: {prev}\n  after:  {ln}")
    print(f"{len(lines) - moved} of {len(lines)} builds byte-identical")
    return moved


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, help="also write the lines to this file")
    ap.add_argument("--only", help="comma-separated build names")
    ap.add_argument("--keep", type=Path, help="keep each build's .cu, .cubin, .sass and ptxas report here")
    ap.add_argument("--compare", type=Path, help="an earlier --out file: report the builds that differ")
    ap.add_argument("--sources", type=Path, help="compile the .cu files an earlier --keep left here, not today's "
                    "lowering: the headers' effect alone, while torch_cubridge/lower changes beside them")
    ap.add_argument("--list", action="store_true", help="print the build names and exit")
    args = ap.parse_args()
    if args.list:
        print("\n".join(b.name for b in BUILDS))
        return 0
    names = set(args.only.split(",")) if args.only else None
    lines = []
    for b in BUILDS:
        if names is None or b.name in names:
            lines.append(fingerprint(b, args.keep, args.sources))
            print(lines[-1], flush=True)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    return 1 if args.compare and compare(lines, args.compare) else 0


if __name__ == "__main__":
    sys.exit(main())
