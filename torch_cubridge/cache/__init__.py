"""On-disk cache of compiled kernels, shared by processes, safe to crash in.

Module-level get/get_or_build/put use the default cache at
config.kernels_dir(); build an ArtifactCache yourself for another directory.
A directory someone other than us or root could write is refused with
UnsafeCacheDirError (rules in safedir.py).
"""

from __future__ import annotations

import threading
from typing import Any

from .. import config
from .errors import CacheError, CacheReadOnlyError, UnsafeCacheDirError
from .store import Artifact, ArtifactCache, BuildFn, check_key

__all__ = [
    "Artifact",
    "ArtifactCache",
    "CacheError",
    "CacheReadOnlyError",
    "check_key",
    "default_cache",
    "get",
    "get_or_build",
    "put",
    "UnsafeCacheDirError",
]

_defaults: dict[tuple, ArtifactCache] = {}
_defaults_lock = threading.Lock()


def default_cache() -> ArtifactCache:
    """The cache for the current CUBRIDGE_CACHE_DIR / CUBRIDGE_READONLY settings."""
    # Keyed on the raw settings so a hit costs no filesystem calls.
    token = config.cache_settings_token()
    cache = _defaults.get(token)
    if cache is None:
        with _defaults_lock:
            cache = _defaults.get(token)
            if cache is None:
                readonly = config.is_readonly()
                cache = ArtifactCache(config.kernels_dir(), readonly=readonly)
                _defaults[token] = cache
    return cache


def get(key: str) -> Artifact | None:
    return default_cache().get(key)


def get_or_build(key: str, build_fn: BuildFn) -> Artifact:
    return default_cache().get_or_build(key, build_fn)


def put(key: str, cubin: bytes, meta: dict[str, Any] | None = None) -> Artifact:
    return default_cache().put(key, cubin, meta)
