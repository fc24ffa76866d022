"""Finding CUDA pieces on disk: libnvrtc and the directory holding cuda_bf16.h.

They come either from a CUDA toolkit (CUDA_HOME, /usr/local/cuda) or from the
NVIDIA pip wheels that CUDA builds of torch depend on
(site-packages/nvidia/cu13/..., or nvidia/cuda_nvrtc/... for CUDA 12).
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

from .. import config

# Wheel layouts: CUDA 13 puts everything under nvidia/cu13; CUDA 12 has one
# package per component.
_WHEEL_SUBDIRS = ("cu13", "cu12", "cuda_nvrtc", "cuda_runtime")
_NVRTC_NAMES = ("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so")


def _nvidia_wheel_roots() -> list[Path]:
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return []
    roots = []
    for loc in spec.submodule_search_locations:
        for sub in _WHEEL_SUBDIRS:
            if (Path(loc) / sub).is_dir():
                roots.append(Path(loc) / sub)
    return roots


def _torch_lib_dir() -> Path | None:
    # find_spec does not import torch, which keeps this module light.
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    lib = Path(next(iter(spec.submodule_search_locations))) / "lib"
    return lib if lib.is_dir() else None


def _toolkit_dirs(kind: str) -> list[Path]:
    home = config.cuda_home()
    if home is None:
        return []
    if kind == "lib":
        subs = ("lib64", "lib", "targets/x86_64-linux/lib", "targets/sbsa-linux/lib")
    else:
        subs = ("include", "targets/x86_64-linux/include", "targets/sbsa-linux/include")
    return [home / s for s in subs if (home / s).is_dir()]


@functools.lru_cache(maxsize=1)
def nvrtc_library_candidates() -> tuple[str, ...]:
    """Absolute paths first (wheels, torch/lib, toolkit), then bare sonames for dlopen."""
    dirs = [r / "lib" for r in _nvidia_wheel_roots()]
    torch_lib = _torch_lib_dir()
    if torch_lib is not None:
        dirs.append(torch_lib)
    dirs += _toolkit_dirs("lib")
    found: list[str] = []
    for d in dirs:
        for name in _NVRTC_NAMES:
            if (d / name).is_file():
                found.append(str(d / name))
        # Some torch builds bundle a hash-suffixed copy (libnvrtc-1a2b3c4d.so.12).
        for p in sorted(d.glob("libnvrtc-*.so*")):
            if "builtins" not in p.name:
                found.append(str(p))
    found += list(_NVRTC_NAMES)
    return tuple(dict.fromkeys(found))


@functools.lru_cache(maxsize=1)
def cuda_include_dirs() -> tuple[Path, ...]:
    """Include dirs that provide cuda_bf16.h (plus CCCL's dir if split out), or ()."""
    cands = _toolkit_dirs("include") + [r / "include" for r in _nvidia_wheel_roots()]
    for inc in cands:
        if (inc / "cuda_bf16.h").is_file():
            dirs = [inc]
            if (inc / "cccl").is_dir():
                dirs.append(inc / "cccl")
            return tuple(dirs)
    return ()
