"""The host fast path's C module (csrc/host/hotpath.c), built with the system C compiler.

Built once per machine and Python against this interpreter's own headers, as Triton builds its launcher
stubs, into the private cache (`<cache>/host/`), named by the source's and the interpreter's digest so an
edit or another Python never loads a stale one. Read-only mode loads a module already there and never
compiles. Nothing here needs CUDA.

Beside the handwritten sources the build writes the generated headers its caller hands it ({file name:
text}; ops/host_module.py gives the kernel argument structs and the launch rules), and the module's name
covers their text too, so an edit of a struct or a rule rebuilds the module. What the headers say is the
caller's business: this module compiles whatever it is given.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType

import filelock

from .. import config
from .errors import BuildError, CompilerUnavailable

NAME = "_hotpath"
_TIMEOUT_S = 120


def source_path() -> Path:
    return Path(config.csrc_dir()) / "host" / "hotpath.c"


def _compiler() -> str | None:
    for cand in (os.environ.get("CC"), sysconfig.get_config_var("CC"), "cc", "gcc", "clang"):
        exe = cand.split()[0] if cand else None
        if exe and shutil.which(exe):
            return exe
    return None


def module_path(headers: Mapping[str, str]) -> Path:
    """Where the module built from today's sources and the generated `headers` ({file name: text}) lives."""
    src = b"".join(f.read_bytes() for f in sorted(source_path().parent.iterdir()) if f.suffix in (".c", ".h"))
    src += b"".join(name.encode() + b"\0" + text.encode() for name, text in sorted(headers.items()))
    tag = hashlib.sha256(src + sys.version.encode() + sysconfig.get_paths()["include"].encode()).hexdigest()[:16]
    ext = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    return config.cache_root() / "host" / f"{NAME}-{sys.implementation.cache_tag}-{tag}{ext}"


def build_module(path: Path, headers: Mapping[str, str]) -> None:
    """Compile the module to `path` (atomically: a reader sees no half-written library), with the generated
    `headers` written beside the build."""
    cc = _compiler()
    include = sysconfig.get_paths()["include"]
    if cc is None:
        raise CompilerUnavailable("no C compiler (cc, gcc or clang) for the host fast path", compiler="cc")
    if not (Path(include) / "Python.h").is_file():
        raise CompilerUnavailable(f"no Python headers at {include} for the host fast path", compiler="cc")
    config.ensure_private_dir(path.parent)
    with tempfile.TemporaryDirectory(prefix="cubridge-host-", dir=path.parent) as tmp:
        out = Path(tmp) / path.name
        for name, text in headers.items():
            (Path(tmp) / name).write_text(text)
        cmd = [cc, "-O2", "-shared", "-fPIC", "-std=c11", "-D_GNU_SOURCE", f"-I{include}", f"-I{tmp}",
               str(source_path()), "-o", str(out), "-ldl"]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=_TIMEOUT_S, check=False)
        if res.returncode != 0:
            raise BuildError("the host fast path did not compile", res.stdout + res.stderr, compiler="cc")
        os.replace(out, path)


def install_module(name: str, data: bytes, headers: Mapping[str, str]) -> bool:
    """Put a module another machine built (a bundle's: cache/bundle.py) where load_module finds it, if it
    is this interpreter's and this source's and headers' (its name says so); returns whether it did."""
    path = module_path(headers)
    if name != path.name:
        return False
    config.ensure_private_dir(path.parent)
    fd, tmp = tempfile.mkstemp(prefix=".cubridge-host-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)  # atomic: a reader sees the old module or the whole new one
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return True


def load_module(headers: Mapping[str, str]) -> ModuleType:
    """The C module built with the generated `headers`: loaded from the cache, built first where it is not
    there (never in read-only mode)."""
    path = module_path(headers)
    if not path.is_file():
        if config.is_readonly():
            raise CompilerUnavailable("read-only mode and no host fast path module in the cache", compiler="cc")
        config.ensure_private_dir(path.parent)
        # once across processes: those starting together on a cold cache wait for one compiler, not run sixteen
        with filelock.FileLock(str(path) + ".lock", timeout=_TIMEOUT_S + 30):
            if not path.is_file():
                build_module(path, headers)
    spec = importlib.util.spec_from_file_location(f"torch_cubridge.{NAME}", path)
    if spec is None or spec.loader is None:
        raise BuildError(f"cannot load {path}", "", compiler="cc")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
