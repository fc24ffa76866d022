"""The key -> metadata index, in diskcache/sqlite, with no pickle anywhere.

diskcache's default Disk pickles keys and values, and even JSONDisk unpickles
any row whose mode/raw columns say "pickle" (CVE-2025-69872: whoever can write
the cache dir could run code). SafeJSONDisk stores JSON inline in sqlite and
refuses every other row kind on the way out.
"""

from __future__ import annotations

from pathlib import Path

import diskcache
from diskcache.core import MODE_RAW

from .errors import CacheError

# Keep every value inline in sqlite: no side files whose names come from the db.
_INLINE_LIMIT = 1 << 30


class SafeJSONDisk(diskcache.JSONDisk):
    """JSONDisk that can only ever decode zlib-compressed JSON stored inline."""

    def __init__(self, directory: str, **kwargs) -> None:
        kwargs["min_file_size"] = _INLINE_LIMIT
        super().__init__(directory, **kwargs)

    def get(self, key, raw):
        if not raw:
            raise CacheError("index row has a pickled key; refusing to load it")
        return super().get(key, raw)

    def fetch(self, mode, filename, value, read):
        if mode != MODE_RAW or read:
            raise CacheError(f"index row has storage mode {mode}; only inline JSON is allowed")
        return super().fetch(mode, filename, value, read)


class Index:
    """Thin wrapper: str key -> JSON metadata dict."""

    def __init__(self, directory: Path) -> None:
        self._db = diskcache.Cache(str(directory), disk=SafeJSONDisk, disk_min_file_size=_INLINE_LIMIT)

    def get(self, key: str) -> dict | None:
        try:
            meta = self._db.get(key, default=None)
        except CacheError:
            self._db.delete(key)  # a tampered row is dropped, never decoded
            return None
        return meta if isinstance(meta, dict) else None

    def set(self, key: str, meta: dict) -> None:
        self._db.set(key, meta)

    def delete(self, key: str) -> None:
        self._db.delete(key)

    def keys(self) -> list[str]:
        return [k for k in self._db.iterkeys() if isinstance(k, str)]

    def close(self) -> None:
        self._db.close()
