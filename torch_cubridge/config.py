"""Every path and environment variable torch_cubridge reads lives here.

Environment variables:
  CUBRIDGE_CACHE_DIR   cache root (default: <checkout>/cache or the user cache dir)
  CUBRIDGE_READONLY    "1": read the cache, never write it, never compile
  CUBRIDGE_COMPILER    "auto" (default), "nvrtc" or "nvcc"
  CUBRIDGE_DEBUG       "1": the cubridge command shows a failure's Python traceback, not one line
  CUBRIDGE_LINEINFO    "1": kernels built with source line info, for ncu's per-line stalls (the binary's code
                       is the same; use a fresh CUBRIDGE_CACHE_DIR, or the cache hands back a build without it)
  CUDA_HOME, CUDA_PATH where to look for nvcc and CUDA headers first
  XDG_CACHE_HOME       honoured for the user cache dir
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

_PKG_DIR = Path(__file__).resolve().parent
_REPO_DIR = _PKG_DIR.parent

_TRUE = {"1", "true", "yes", "on"}
COMPILERS = ("auto", "nvrtc", "nvcc")


def package_dir() -> Path:
    return _PKG_DIR


def is_source_checkout() -> bool:
    """True when running from the repository rather than an installed wheel."""
    return (_REPO_DIR / "setup.py").is_file() and (_REPO_DIR / "cache").is_dir()


def is_readonly() -> bool:
    """Deployment mode: the cache may be read but never written; nothing is compiled."""
    return os.environ.get("CUBRIDGE_READONLY", "").strip().lower() in _TRUE


def debug() -> bool:
    """The cubridge command lets a failure's traceback through (cli.main)."""
    return os.environ.get("CUBRIDGE_DEBUG", "").strip().lower() in _TRUE


def line_info() -> bool:
    """CUBRIDGE_LINEINFO=1: kernels carry their source lines (profiling)."""
    return os.environ.get("CUBRIDGE_LINEINFO", "").strip().lower() in _TRUE


def hopper_kernel_enabled() -> bool:
    """CUBRIDGE_KERNEL=sm80 keeps Hopper GPUs on the FA2-class kernel (comparisons, fallback)."""
    return os.environ.get("CUBRIDGE_KERNEL", "").strip().lower() != "sm80"


def compiler_preference() -> str:
    choice = os.environ.get("CUBRIDGE_COMPILER", "auto").strip().lower() or "auto"
    if choice not in COMPILERS:
        raise ValueError(f"CUBRIDGE_COMPILER={choice!r}; expected one of {COMPILERS}")
    return choice


def ensure_private_dir(path: Path) -> Path:
    """Create `path` (and parents) with mode 0700, or check that an existing one is safe.

    The cache holds machine code that gets loaded into the process, so nobody
    but us (or root) may be able to write there or swap the directory out; an
    unsafe one raises cache.UnsafeCacheDirError (rules: cache/safedir.py).
    Returns the real path (symlinks resolved), which callers should use.
    """
    from .cache.safedir import make_private_dir  # lazy: the cache package imports config

    return make_private_dir(path)


def _checked_existing_dir(path: Path) -> Path:
    """Readonly mode: check `path` by the same rules but create nothing; a missing dir is empty."""
    from .cache.safedir import safe_existing_dir

    return safe_existing_dir(path) or path


def _user_cache_dir() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "torch_cubridge"


def cache_root() -> Path:
    """Root of the on-disk cache (real path); created 0700 unless in readonly mode.

    A checkout's tracked cache/ is used as git left it (0755 is safe: only we
    can write it); one that group or others can write is refused, as is any
    root that someone other than us or root owns (cache/safedir.py).
    """
    env = os.environ.get("CUBRIDGE_CACHE_DIR")
    if env:
        root = Path(env).expanduser()
    elif is_source_checkout():
        root = _REPO_DIR / "cache"
    else:
        root = _user_cache_dir()
    if is_readonly():
        return _checked_existing_dir(root)
    return ensure_private_dir(root)


def cache_settings_token() -> tuple:
    """Everything cache_root() depends on, cheap to compare (for memoising)."""
    env = os.environ
    return (env.get("CUBRIDGE_CACHE_DIR"), env.get("XDG_CACHE_HOME"), is_readonly())


def kernels_dir() -> Path:
    """Where compiled kernels (cubin + json + index) are stored."""
    path = cache_root() / "kernels"
    if is_readonly():
        return _checked_existing_dir(path)
    return ensure_private_dir(path)


def csrc_dir() -> Path:
    """The CUDA headers the generated kernels include (`-I` this)."""
    for cand in (_REPO_DIR / "csrc", _PKG_DIR / "_csrc"):
        if cand.is_dir():
            return cand
    raise FileNotFoundError(
        f"no CUDA sources: neither {_REPO_DIR / 'csrc'} nor {_PKG_DIR / '_csrc'} exists"
    )


def cuda_home() -> Path | None:
    """The CUDA toolkit root, if one is installed."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        val = os.environ.get(var)
        if val and Path(val).is_dir():
            return Path(val)
    # nvcc on PATH may be a wrapper script: accept its root only if it
    # looks like a toolkit.
    nvcc = shutil.which("nvcc")
    if nvcc:
        root = Path(nvcc).resolve().parent.parent
        if (root / "include" / "cuda.h").is_file():
            return root
    default = Path("/usr/local/cuda")
    return default if default.is_dir() else None


def nvcc_path() -> Path | None:
    home = cuda_home()
    if home is not None and (home / "bin" / "nvcc").is_file():
        return home / "bin" / "nvcc"
    found = shutil.which("nvcc")
    return Path(found) if found else None
