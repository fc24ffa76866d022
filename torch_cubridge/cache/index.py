"""The key -> metadata index, in diskcache/sqlite: JSON data only, rebuilt when corrupt.

diskcache's default Disk pickles keys and values, and even JSONDisk unpickles
any row whose mode/raw columns say "pickle" (CVE-2025-69872: whoever can write
the cache dir could run code). Rows can also name files (diskcache's "file"
mode) that diskcache reads, and deletes when the row is dropped, evicted or
overwritten. SafeJSONDisk stores JSON inline in sqlite, refuses every other
row kind on the way out and never touches a file a row names.

The index only speeds up lookups: <key>.json beside each cubin is the record.
So a database that sqlite calls corrupt is moved aside and rebuilt from those.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import threading
import time
import zlib
from pathlib import Path
from typing import Any, Callable, Iterable

import diskcache
import filelock
from diskcache.core import DBNAME, MODE_RAW, UNKNOWN

from .errors import CacheError
from .safedir import make_private_dir

# Keep every value inline in sqlite: no side files whose names come from the db.
_INLINE_LIMIT = 1 << 30
# Ours override whatever a (tampered) Settings table says: never evict or cull,
# since culling is one more path by which diskcache acts on rows.
_SETTINGS = {"eviction_policy": "none", "cull_limit": 0, "disk_min_file_size": _INLINE_LIMIT}
_SQLITE_CORRUPT, _SQLITE_NOTADB, _SQLITE_CANTOPEN = 11, 26, 14

Entries = Callable[[], Iterable["tuple[str, dict]"]]


def _decoded(fn: Callable[..., Any], *args: Any) -> Any:
    try:
        return fn(*args)
    except (zlib.error, ValueError, TypeError) as e:  # ValueError covers bad JSON and UTF-8
        raise CacheError(f"index row does not hold zlib-compressed JSON: {e}") from None


class SafeJSONDisk(diskcache.JSONDisk):
    """JSONDisk that can only ever decode zlib-compressed JSON stored inline."""

    def __init__(self, directory: str, **kwargs) -> None:
        kwargs["min_file_size"] = _INLINE_LIMIT
        super().__init__(directory, **kwargs)

    def get(self, key, raw):
        if not raw:
            raise CacheError("index row has a pickled key; refusing to load it")
        return _decoded(super().get, key, raw)

    def fetch(self, mode, filename, value, read):
        if mode != MODE_RAW or read:
            raise CacheError(f"index row has storage mode {mode}; only inline JSON is allowed")
        return _decoded(super().fetch, mode, None, value, False)  # the row's filename is never used

    def filename(self, key=UNKNOWN, value=UNKNOWN):
        raise CacheError("the index never stores values in files")

    def remove(self, file_path) -> None:
        # diskcache calls this with the filename column of a row it drops; ours
        # never name files, so a name found there is tampering: touch nothing.
        return None


def _is_corrupt(e: sqlite3.DatabaseError) -> bool:
    code = getattr(e, "sqlite_errorcode", None)  # Python >= 3.11
    if code is not None:
        return code & 0xFF in (_SQLITE_CORRUPT, _SQLITE_NOTADB)
    # 3.10: "locked", "busy", "readonly" are OperationalError; corruption is not.
    return not isinstance(e, sqlite3.OperationalError)


def _cannot_open(e: sqlite3.DatabaseError) -> bool:
    """The database file could not be opened: another process moved the index aside to rebuild it
    between this one's directory check and its connect (a race CI met once)."""
    code = getattr(e, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF == _SQLITE_CANTOPEN
    return "unable to open database file" in str(e)


def _healthy(db_file: Path) -> bool:
    con = sqlite3.connect(db_file)
    try:
        return con.execute("PRAGMA quick_check").fetchone() == ("ok",)
    except sqlite3.DatabaseError as e:
        if _is_corrupt(e):
            return False
        raise
    finally:
        con.close()


class Index:
    """Thin wrapper: str key -> JSON metadata dict.

    `entries` lists (key, metadata) from the <key>.json files; it refills the
    index after a corrupt database was moved aside.
    """

    def __init__(self, directory: Path, entries: Entries | None = None) -> None:
        self._dir = Path(directory)
        self._entries = entries or (lambda: ())
        self._db: diskcache.Cache | None = None
        self._lock = threading.RLock()
        self._run(lambda db: None)  # open now: a corrupt file is rebuilt here, not mid-build

    def _open(self) -> diskcache.Cache:
        return diskcache.Cache(str(self._dir), disk=SafeJSONDisk, **_SETTINGS)

    def _run(self, op: Callable[[diskcache.Cache], Any]) -> Any:
        with self._lock:
            rebuilt = 0
            for attempt in range(4):
                try:
                    if self._db is None:
                        self._db = self._open()
                    return op(self._db)
                except sqlite3.DatabaseError as e:
                    if attempt == 3:
                        raise
                    if _cannot_open(e):  # a rebuild elsewhere moved the index: wait for it, then reopen
                        self._await_rebuild()
                        continue
                    if not _is_corrupt(e):
                        raise
                    # First time, another process may have rebuilt it already;
                    # if the "healthy" file still fails us, rebuild regardless.
                    self._rebuild(keep_healthy=rebuilt == 0)
                    rebuilt += 1

    def _rebuild_lock(self) -> filelock.FileLock:
        # A name no key's lock can have (keys never start with a dot).
        return filelock.FileLock(str(self._dir.parent / f".{self._dir.name}.lock"))

    def _await_rebuild(self) -> None:
        self._drop_connection()
        with self._rebuild_lock():  # held by the process rebuilding, if one is
            make_private_dir(self._dir)

    def _rebuild(self, keep_healthy: bool) -> None:
        self._drop_connection()
        # One process rebuilds; the others wait, then find a healthy database.
        with self._rebuild_lock():
            db_file = self._dir / DBNAME
            if keep_healthy and db_file.is_file() and _healthy(db_file):
                return
            aside = self._dir.with_name(f".{self._dir.name}.corrupt-{os.getpid()}-{time.time_ns()}")
            try:
                os.rename(self._dir, aside)  # atomically out of everyone's way, then gone
            except FileNotFoundError:
                pass
            else:
                shutil.rmtree(aside, ignore_errors=True)
            make_private_dir(self._dir)
            db = self._open()
            with db.transact():
                for key, meta in self._entries():
                    db.set(key, meta)
            self._db = db

    def _drop_connection(self) -> None:
        db, self._db = self._db, None
        if db is not None:
            try:
                db.close()
            except sqlite3.Error:
                pass

    def get(self, key: str) -> dict | None:
        try:
            meta = self._run(lambda db: db.get(key, default=None))
        except CacheError:
            self.delete(key)  # a tampered row is dropped, never decoded
            return None
        return meta if isinstance(meta, dict) else None

    def set(self, key: str, meta: dict) -> None:
        self._run(lambda db: db.set(key, meta))

    def delete(self, key: str) -> None:
        self._run(lambda db: db.delete(key))

    def keys(self) -> list[str]:
        return self._run(lambda db: [k for k in db.iterkeys() if isinstance(k, str)])

    def close(self) -> None:
        with self._lock:
            self._drop_connection()
