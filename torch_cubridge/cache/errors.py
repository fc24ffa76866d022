"""Errors raised by the artifact cache."""

from __future__ import annotations


class CacheError(RuntimeError):
    """The cache is unusable (bad key, unsafe directory, bad metadata)."""


class CacheReadOnlyError(CacheError):
    """A write or build was needed but CUBRIDGE_READONLY=1 forbids it."""


class UnsafeCacheDirError(CacheError):
    """Someone other than us (or root) could write the cache directory or swap it out."""
