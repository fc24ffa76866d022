"""The host fast path's C module as ops needs it: build/host.py's loader, given the header ops generates.

The C Decoder (csrc/host/decoder.h) packs the kernel argument structs and applies the launch rules that
the Python runner uses; ops/host_header.py renders both to one header, and every caller that asks for the
module (ops/hotpath.py, `cubridge cache export --host-module` and `cache import`) goes through here, so
each gets a module built with that header and named by its text.
"""
from __future__ import annotations

from pathlib import Path
from types import ModuleType

from ..build import host
from . import host_header


def headers() -> dict[str, str]:
    """The generated headers the module is built with: {file name: text}."""
    return {host_header.NAME: host_header.text()}


def module_path() -> Path:
    """Where the module for today's sources and header lives."""
    return host.module_path(headers())


def load_module() -> ModuleType:
    """The module: loaded from the cache, built first where it is not there (never in read-only mode)."""
    return host.load_module(headers())


def install_module(name: str, data: bytes) -> bool:
    """Put a bundle's module where load_module finds it, if its name is this Python's, sources' and header's."""
    return host.install_module(name, data, headers())
