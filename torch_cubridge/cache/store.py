"""The on-disk artifact cache: key -> (cubin bytes, metadata dict).

Layout of a cache directory (config.kernels_dir() by default):
  <key>.cubin   the machine code
  <key>.json    metadata incl. sha256 of the cubin; written last, so its
                presence marks a complete entry
  <key>.lock    filelock so concurrent processes build a key once
  index/        diskcache (sqlite, JSON only) mapping key -> metadata

Whoever can write here can run code in every process that loads from here,
so the directory is checked on every disk read (cache/safedir.py). Nothing
read from disk is trusted as a path: every path is the checked directory plus
a validated key, and an entry is served only if its metadata names that key
and the sha256 of the bytes read.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import filelock

from .. import config
from ..version import __version__
from .atomic import write_atomic
from .errors import CacheError, CacheReadOnlyError
from .index import Index
from .safedir import check_dir, make_private_dir, resolve
from .sweep import sweep_stale_tmp

# Keys become file names: no separators, no leading dot, bounded length.
_KEY_RE = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,199}$")
_LOCK_TIMEOUT_S = 900.0  # longer than any sane compile; then fail loudly

BuildFn = Callable[[], "tuple[bytes, dict[str, Any]]"]


@dataclass(frozen=True)
class Artifact:
    key: str
    cubin: bytes
    meta: dict[str, Any] = field(hash=False, compare=False)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _matches(meta: Any, key: str, sha256: str) -> bool:
    """Metadata vouches for these bytes under this key (not a copy of another entry's)."""
    return isinstance(meta, dict) and meta.get("key") == key and meta.get("sha256") == sha256


def sha256_hex(data: bytes) -> str:
    """The digest the store records for an entry's bytes (bundle manifests use it too)."""
    return _sha256(data)


def file_name(key: str, ext: str) -> str:
    """The name of an entry's file: <key>.cubin or <key>.json (in a cache dir or a bundle)."""
    return f"{key}.{ext}"


def entry_problem(key: str, cubin: bytes | None, meta: Any) -> str | None:
    """Why (cubin, meta) would not be served under `key`; None when it would."""
    if not isinstance(meta, dict):
        return "metadata missing or not a JSON object"
    if cubin is None:
        return "cubin missing"
    if meta.get("key") != key:
        return f"metadata names key {meta.get('key')!r}"
    if meta.get("sha256") != _sha256(cubin):
        return "cubin sha256 does not match its metadata"
    return None


def check_key(key: str) -> str:
    if not isinstance(key, str) or not _KEY_RE.match(key):
        raise CacheError(f"bad cache key {key!r}: use [A-Za-z0-9._-], at most 200 chars")
    return key


class ArtifactCache:
    def __init__(self, directory: Path, *, readonly: bool | None = None) -> None:
        self.readonly = config.is_readonly() if readonly is None else readonly
        # The real path from here on, checked now rather than at the first miss.
        if self.readonly:
            self.dir = resolve(directory)
            check_dir(self.dir)  # creates nothing: a missing dir is an empty cache
        else:
            self.dir = make_private_dir(directory)
        self._memo: dict[str, Artifact] = {}
        self._index: Index | None = None
        self._index_lock = threading.Lock()
        self._swept = False

    # ---- paths -----------------------------------------------------------
    def _path(self, key: str, ext: str) -> Path:
        return self.dir / file_name(key, ext)

    def _lock(self, key: str) -> filelock.FileLock:
        return filelock.FileLock(str(self._path(key, "lock")), timeout=_LOCK_TIMEOUT_S)

    def turn_lock(self, key: str) -> filelock.FileLock:
        """The file lock of `key`, entry or not: processes that should do one piece of work once take turns on it."""
        check_key(key)
        self._before_write()
        return self._lock(key)

    def _lock_for_file(self, name: str) -> filelock.FileLock | None:
        """The lock writers of file `name` hold, if it is one of ours (<key>.cubin / <key>.json)."""
        key, _, ext = name.rpartition(".")
        if ext not in ("cubin", "json") or not _KEY_RE.match(key):
            return None
        return self._lock(key)

    def index(self) -> Index | None:
        """The sqlite index, or None in readonly mode (sqlite would write)."""
        if self.readonly:
            return None
        with self._index_lock:
            if self._index is None:
                self._index = Index(make_private_dir(self.dir / "index"), self._json_entries)
            return self._index

    # ---- reading ---------------------------------------------------------
    def _read_json(self, key: str) -> dict | None:
        try:
            meta = json.loads(self._path(key, "json").read_bytes())
        except (OSError, ValueError):
            return None
        return meta if isinstance(meta, dict) else None

    def _json_entries(self) -> list[tuple[str, dict]]:
        """(key, metadata) of every entry's .json, to refill a rebuilt index."""
        out = []
        for name in os.listdir(self.dir):
            key = name[: -len(".json")]
            if name.endswith(".json") and _KEY_RE.match(key):
                meta = self._read_json(key)
                if meta is not None and meta.get("key") == key:
                    out.append((key, meta))
        return out

    def _load_verified(self, key: str) -> Artifact | None:
        if not check_dir(self.dir):  # re-checked: it may have been loosened, or appeared
            return None
        try:
            cubin = self._path(key, "cubin").read_bytes()
        except FileNotFoundError:
            return None
        sha = _sha256(cubin)
        idx = self.index()
        meta = idx.get(key) if idx is not None else None
        if not _matches(meta, key, sha):
            # The .json is the record; the index row may be missing or stale.
            meta = self._read_json(key)
            if not _matches(meta, key, sha):
                return None
            if idx is not None:
                idx.set(key, meta)  # e.g. a cache dir copied without its index
        return Artifact(key, cubin, meta)

    def get(self, key: str) -> Artifact | None:
        """The artifact for `key`, or None. A corrupt or partial entry is deleted and is a miss."""
        art = self._memo.get(key)
        if art is not None:
            return art
        check_key(key)
        art = self._load_verified(key)
        if art is None:
            if not self.readonly and self._path(key, "json").exists():
                self._evict_if_still_bad(key)
            return None
        self._memo[key] = art
        return art

    def _evict_if_still_bad(self, key: str) -> None:
        # Under the lock, so we never delete what a concurrent builder just wrote.
        with self._lock(key):
            if self._load_verified(key) is None:
                self._delete(key)

    def _delete(self, key: str) -> None:
        # Only paths made from the checked key: nothing read from disk names a file to delete.
        self._memo.pop(key, None)
        idx = self.index()
        if idx is not None:
            idx.delete(key)
        for ext in ("json", "cubin"):  # json first: it marks completeness
            try:
                self._path(key, ext).unlink()
            except FileNotFoundError:
                pass

    # ---- writing ---------------------------------------------------------
    def _write(self, key: str, cubin: bytes, meta: dict[str, Any]) -> Artifact:
        if self.readonly:
            raise CacheReadOnlyError(f"CUBRIDGE_READONLY=1: cannot write cache entry {key!r}")
        if not isinstance(cubin, (bytes, bytearray)) or not cubin:
            raise CacheError(f"build for {key!r} returned no cubin bytes")
        full = dict(meta)
        full.update(
            key=key,
            sha256=_sha256(cubin),
            size=len(cubin),
            created=time.time(),
            cubridge_version=__version__,
        )
        try:
            meta_bytes = json.dumps(full, sort_keys=True).encode()
        except TypeError as e:
            raise CacheError(f"metadata for {key!r} is not JSON-serialisable: {e}") from e
        write_atomic(self._path(key, "cubin"), bytes(cubin))
        write_atomic(self._path(key, "json"), meta_bytes)  # last: marks completion
        idx = self.index()
        if idx is not None:
            idx.set(key, full)
        art = Artifact(key, bytes(cubin), full)
        self._memo[key] = art
        return art

    def _before_write(self) -> None:
        make_private_dir(self.dir)  # re-checked, and re-made if someone deleted it
        if not self._swept:  # once per cache object: killed writers' temp files
            self._swept = True
            sweep_stale_tmp(self.dir, self._lock_for_file)

    def put(self, key: str, cubin: bytes, meta: dict[str, Any] | None = None) -> Artifact:
        check_key(key)
        if self.readonly:
            raise CacheReadOnlyError(f"CUBRIDGE_READONLY=1: cannot write cache entry {key!r}")
        self._before_write()
        with self._lock(key):
            return self._write(key, cubin, meta or {})

    def get_or_build(self, key: str, build_fn: BuildFn) -> Artifact:
        """get(key), else build once across processes (lock, re-check, build, write)."""
        art = self.get(key)
        if art is not None:
            return art
        if self.readonly:
            raise CacheReadOnlyError(
                f"kernel {key!r} is not in the cache at {self.dir} and CUBRIDGE_READONLY=1 "
                "forbids building it; warm the cache with the same torch_cubridge version "
                "for this arch, or unset CUBRIDGE_READONLY"
            )
        self._before_write()
        with self._lock(key):
            art = self._load_verified(key)  # someone may have built it while we waited
            if art is None:
                cubin, meta = build_fn()
                art = self._write(key, cubin, meta)
            self._memo[key] = art
            return art

    # ---- housekeeping ----------------------------------------------------
    def keys(self) -> list[str]:
        return sorted(p.stem for p in self.dir.glob("*.json") if _KEY_RE.match(p.stem))

    def read_files(self, key: str) -> tuple[bytes | None, bytes | None]:
        """The raw bytes of <key>.cubin and <key>.json as on disk (None: missing); unchecked."""
        check_key(key)
        check_dir(self.dir)
        return self._read_or_none(key, "cubin"), self._read_or_none(key, "json")

    def _read_or_none(self, key: str, ext: str) -> bytes | None:
        try:
            return self._path(key, ext).read_bytes()
        except FileNotFoundError:
            return None

    def meta(self, key: str) -> dict | None:
        """The metadata <key>.json holds (unchecked: for listing), or None."""
        check_key(key)
        return self._read_json(key)

    def problem(self, key: str) -> str | None:
        """Why the entry on disk would not be served (None: it is sound). Judged on the .json,
        the record, whatever the index says."""
        cubin, raw = self.read_files(key)
        try:
            meta = json.loads(raw) if raw is not None else None
        except ValueError:
            meta = None
        return entry_problem(key, cubin, meta)

    def evict_if_bad(self, key: str) -> str | None:
        """Delete the entry if it is unsound; returns the problem found (None: kept)."""
        if self.readonly:
            raise CacheReadOnlyError(f"CUBRIDGE_READONLY=1: cannot evict cache entry {key!r}")
        with self._lock(key):  # never delete what a concurrent builder just wrote
            problem = self.problem(key)
            if problem is not None:
                self._delete(key)
            return problem

    def remove(self, key: str) -> None:
        """Delete the entry (cubin, json, index row) under its lock."""
        check_key(key)
        if self.readonly:
            raise CacheReadOnlyError(f"CUBRIDGE_READONLY=1: cannot remove cache entry {key!r}")
        with self._lock(key):
            self._delete(key)

    def clear_memo(self) -> None:
        self._memo.clear()

    def close(self) -> None:
        if self._index is not None:
            self._index.close()
            self._index = None
