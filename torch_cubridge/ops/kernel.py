"""Build (or load from the disk cache) the cubin for a lowered program."""
from __future__ import annotations

import hashlib
import time
from functools import lru_cache
from pathlib import Path

from .. import cache, config
from ..build import compile_cubin, toolchain_id
from ..lower import Lowered, LoweredBackward
from ..version import __version__
from .block_table import prepass_kernels
from .launch import CubinKernel


@lru_cache(maxsize=1)
def headers_digest() -> str:
    """The expert kernel's own source is part of every key."""
    h = hashlib.sha256()
    root = Path(config.csrc_dir())
    for f in sorted(root.rglob("*.cuh")):
        h.update(f.relative_to(root).as_posix().encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def kernel_key(low: Lowered, arch: str) -> str:
    """What a cubin is built from: the source, the arch, this package and the expert kernel's headers.
    Not the compiler: a warm or read-only process must find its kernels without loading one (asking
    NVRTC its version cost ~105 ms of a new process's first call on the H100), and a cache built with
    nvcc serves where only NVRTC exists. The compiler that built a cubin is in its metadata, and a GPU
    verdict holds for the cubin's own sha256 (`info["sha256"]`), so a rebuild by another compiler is
    verified again."""
    return source_key("fwd", low.source, arch)


def backward_key(low: LoweredBackward, arch: str) -> str:
    """What a backward kernel's cubin is cached under: the one rule the
    backward and its early build (build/early.py) both key by."""
    return source_key("bwd", low.source, arch)


def source_key(kind: str, source: str, arch: str) -> str:
    """The cache key of a cubin built from `source` for `arch` (kernel_key's rule, for any kernel of csrc/)."""
    h = hashlib.sha256()
    for part in (source, arch, __version__, headers_digest()):
        h.update(part.encode())
        h.update(b"\0")
    return f"{kind}-" + h.hexdigest()[:40]


def cached_cubin(key: str, source: str, arch: str, kernel: str) -> tuple[bytes, dict]:
    """The cubin of `source` under `key`: from the disk cache, else built once across processes (the cache's
    file lock: ranks of one job and racing processes wait for one build). Returns it and what happened
    (key, built, seconds, sha256)."""
    info = {"key": key, "built": False}
    t0 = time.perf_counter()

    def build():
        info["built"] = True
        cubin = compile_cubin(source, arch, include_dirs=[config.csrc_dir()])
        return cubin, {"arch": arch, "toolchain": toolchain_id(), "kernel": kernel}

    art = cache.get_or_build(key, build)
    info["seconds"] = time.perf_counter() - t0
    info["sha256"] = art.meta.get("sha256", "")
    return art.cubin, info


def load_kernel(low: Lowered, arch: str) -> tuple[CubinKernel, dict, dict[str, CubinKernel]]:
    """Returns the loaded kernel, what happened (built or cached, seconds) and its helper kernels
    from the same cubin by role: "prepass" and "scan" (data masks)."""
    key = kernel_key(low, arch)
    cubin, info = cached_cubin(key, low.source, arch, low.kernel)
    src_dir = config.cache_root() / "sources"
    if not config.is_readonly():
        config.ensure_private_dir(src_dir)
        (src_dir / f"{key}.cu").write_text(low.source)  # for explain and debugging
    info["source_path"] = str(src_dir / f"{key}.cu")
    kern = CubinKernel(cubin, low.kernel, threads=low.tile.threads, smem_bytes=low.tile.smem_bytes)
    aux = {}
    if low.prepass is not None:
        aux["prepass"], aux["scan"] = prepass_kernels(cubin)
    return kern, info, aux
