"""Which directories may hold machine code that we load, and making new ones private.

The rule, the same for reading (CUBRIDGE_READONLY=1) and for writing:

* The path is resolved (symlinks followed once) and from then on only the real
  path is used; it and every parent up to / must be real directories, so a
  symlink planted later is refused rather than followed.
* Each of them is owned by us or by root. Root can replace anything anyway;
  any other owner could rename our directory and put their own in its place.
* The cache directory itself is not writable by group or others: whoever can
  write it can plant a cubin together with a .json holding its sha256.
* A parent may be writable by others only if it is sticky (like /tmp), since
  then nobody but us can rename or delete what we put in it.

Hence a root-owned prebuilt cache (0755) is fine to read, and a checkout's
tracked cache/ (git creates it 0755) is used as it is. We never change the mode
of a directory we did not create, except an empty one of ours that is too
open: with nothing in it nothing can have been planted, so making it 0700 is
as good as creating it.
"""

from __future__ import annotations

import os
import pwd
import stat
import time
from pathlib import Path

from .errors import UnsafeCacheDirError

_PRIVATE = 0o700
_GROUP_OTHER_WRITE = stat.S_IWGRP | stat.S_IWOTH


def _me() -> str:
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return str(os.geteuid())


def _problem(path: Path, st: os.stat_result, *, leaf: bool) -> tuple[str, str] | None:
    """(what is wrong with `path`, how to fix it), or None when it is safe."""
    if stat.S_ISLNK(st.st_mode):
        return "is a symlink", "use the directory it points to"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory", f"remove {path} or pick another directory"
    if st.st_uid not in (os.geteuid(), 0):
        return (
            f"is owned by uid {st.st_uid}, not by you ({_me()}, uid {os.geteuid()}) or root",
            f"`chown {_me()} {path}` (or chown it to root for a read-only deployment) "
            "if you trust what is in it",
        )
    mode = st.st_mode
    if mode & _GROUP_OTHER_WRITE and (leaf or not mode & stat.S_ISVTX):
        return (
            f"is writable by group or others (mode {stat.S_IMODE(mode):04o})",
            f"`chmod go-w {path}` (empty it first if anyone else may have written to it)",
        )
    return None


def _unsafe(target: Path, culprit: Path, problem: str, fix: str) -> UnsafeCacheDirError:
    what = f"{culprit} {problem}" if culprit == target else f"its parent {culprit} {problem}"
    return UnsafeCacheDirError(
        f"refusing to use {target} as the torch_cubridge kernel cache: {what}. "
        "Cached kernels are machine code loaded into this process, so nobody but you "
        f"or root may be able to write or rename the cache. Fix: {fix}; or set "
        "CUBRIDGE_CACHE_DIR to a directory that only you can write."
    )


def _validate(real: Path, start: Path | None = None) -> None:
    """Raise UnsafeCacheDirError unless `real` and each parent up to / follow the rule.

    `start`: begin at this existing parent of a `real` not created yet.
    """
    first = real if start is None else start
    for p in (first, *first.parents):
        bad = _problem(p, os.lstat(p), leaf=p == real)
        if bad is not None:
            raise _unsafe(real, p, *bad)


def resolve(path: Path) -> Path:
    """The real path: symlinks followed once, here, and never again."""
    return Path(os.path.realpath(Path(path).expanduser()))


def _chmod_private(path: Path) -> None:
    # Through an O_NOFOLLOW descriptor: never chmod whatever a swapped-in symlink names.
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        os.fchmod(fd, _PRIVATE)
    finally:
        os.close(fd)


def _is_empty(path: Path) -> bool:
    with os.scandir(path) as it:
        return next(it, None) is None


def _tighten_if_empty(real: Path) -> None:
    st = os.lstat(real)
    if not (stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()):
        return
    if not st.st_mode & _GROUP_OTHER_WRITE or not _is_empty(real):
        return  # safe already, or has content we cannot vouch for: _validate decides
    _chmod_private(real)
    if not _is_empty(real):  # someone slipped a file in before the chmod
        raise _unsafe(real, real, "was writable by others and something was written into it",
                      f"check and empty {real}")


def make_private_dir(path: Path) -> Path:
    """Create `path` (and missing parents) 0700, or check an existing one; return its real path.
    A directory that vanishes meanwhile (another process moving a corrupt index aside to rebuild it)
    is made again."""
    for attempt in range(4):
        try:
            return _make_private_dir(path)
        except FileNotFoundError:
            time.sleep(0.01 * (attempt + 1))
    return _make_private_dir(path)


def _make_private_dir(path: Path) -> Path:
    real = resolve(path)
    missing = []
    p = real
    while not os.path.lexists(p):
        missing.append(p)
        p = p.parent
    if missing:
        _validate(real, start=p)  # refuse before creating anything in an unsafe place
    for d in reversed(missing):
        try:
            os.mkdir(d, _PRIVATE)
        except FileExistsError:
            continue  # a concurrent process made it; validated below like any existing dir
        _chmod_private(d)  # the umask may have taken bits away
    if not missing:
        _tighten_if_empty(real)
    _validate(real)
    return real


def check_dir(real: Path) -> bool:
    """True if the resolved path `real` is a directory that follows the rule, False if it
    does not exist; UnsafeCacheDirError otherwise. Creates and changes nothing."""
    if not os.path.lexists(real):
        return False
    _validate(real)
    return True


def safe_existing_dir(path: Path) -> Path | None:
    """The real path of `path` if it exists and follows the rule; None if it does not exist.

    Creates and changes nothing (CUBRIDGE_READONLY=1).
    """
    real = resolve(path)
    return real if check_dir(real) else None
