"""Crash-safe file writes: readers see the old file or the whole new one, never a torn one."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

# write_atomic's temp files are ".<target name>.<random>.tmp" beside the target.
_TMP_PREFIX, _TMP_SUFFIX = ".", ".tmp"
_TMP_RE = re.compile(r"^\.(?P<target>.+)\.[A-Za-z0-9_]+\.tmp$")


def _fsync_dir(path: Path) -> None:
    # Makes the rename itself durable; not every filesystem allows it.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Write to a temp file in the same directory, fsync, then os.replace over `path`."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f"{_TMP_PREFIX}{path.name}.", suffix=_TMP_SUFFIX)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(path.parent)


def tmp_target(name: str) -> str | None:
    """The file name that write_atomic's temp file `name` was to become, or None if not one."""
    m = _TMP_RE.match(name)
    return m.group("target") if m else None
