"""Every path and environment variable torch_cubridge reads lives here.

Environment variables:
  CUBRIDGE_CACHE_DIR   cache root (default: <checkout>/cache or the user cache dir)
  CUBRIDGE_READONLY    "1": read the cache, never write it, never compile
  CUBRIDGE_COMPILER    "auto" (default), "nvrtc" or "nvcc"
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


def compiler_preference() -> str:
    choice = os.environ.get("CUBRIDGE_COMPILER", "auto").strip().lower() or "auto"
    if choice not in COMPILERS:
        raise ValueError(f"CUBRIDGE_COMPILER={choice!r}; expected one of {COMPILERS}")
    return choice


def ensure_private_dir(path: Path) -> Path:
    """Create `path` (and parents) with mode 0700 and tighten it if we own it.

    The cache holds machine code that gets loaded into the process, so nobody
    else may be able to write there.
    """
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid == os.getuid() and (st.st_mode & 0o777) != 0o700:
        os.chmod(path, 0o700)
    return path


def _user_cache_dir() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "torch_cubridge"


def cache_root() -> Path:
    """Root of the on-disk cache; created 0700 unless in readonly mode."""
    env = os.environ.get("CUBRIDGE_CACHE_DIR")
    if env:
        root = Path(env).expanduser()
    elif is_source_checkout():
        root = _REPO_DIR / "cache"
    else:
        root = _user_cache_dir()
    if not is_readonly():
        # A checkout's cache/ is tracked (README.md) and keeps git's mode;
        # only what we create below it must be private.
        if root.is_dir() and root == _REPO_DIR / "cache":
            return root
        ensure_private_dir(root)
    return root


def cache_settings_token() -> tuple:
    """Everything cache_root() depends on, cheap to compare (for memoising)."""
    env = os.environ
    return (env.get("CUBRIDGE_CACHE_DIR"), env.get("XDG_CACHE_HOME"), is_readonly())


def kernels_dir() -> Path:
    """Where compiled kernels (cubin + json + index) are stored."""
    path = cache_root() / "kernels"
    if not is_readonly():
        ensure_private_dir(path)
    return path


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
