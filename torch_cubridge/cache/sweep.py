"""Delete the temp files of writers that were killed mid-write, never one a live writer owns."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

import filelock

from .atomic import tmp_target

# A write takes milliseconds; a temp file untouched this long is not being written.
STALE_AFTER_S = 600.0


def sweep_stale_tmp(
    directory: Path,
    lock_for: Callable[[str], "filelock.BaseFileLock | None"],
    stale_after_s: float = STALE_AFTER_S,
) -> list[str]:
    """Remove write_atomic temp files in `directory` that are old and whose target is unlocked.

    `lock_for(target name)` is the lock every writer of that target holds (None:
    not a file we write, leave it). Taking it without waiting proves no live
    writer owns the temp file; the age check covers filesystems where locks
    are no-ops. Returns the names removed.
    """
    removed = []
    now = time.time()
    with os.scandir(directory) as it:
        entries = list(it)
    for entry in entries:
        target = tmp_target(entry.name)
        if target is None:
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue  # renamed into place meanwhile
        if now - st.st_mtime < stale_after_s:
            continue
        lock = lock_for(target)
        if lock is None:
            continue
        try:
            with lock.acquire(timeout=0):
                os.unlink(entry.path)
        except filelock.Timeout:
            continue  # a writer holds it: its temp file may be live
        except FileNotFoundError:
            continue
        removed.append(entry.name)
    return removed
