"""Command-line pieces shared by the nvrtc and nvcc backends."""

from __future__ import annotations

from typing import Any

from .. import config


def define_flag(name: str, value: Any) -> str:
    """-DNAME for None, -DNAME=1/0 for bools, else -DNAME=VALUE."""
    if value is None:
        return f"-D{name}"
    if isinstance(value, bool):
        value = int(value)
    return f"-D{name}={value}"


def line_info_flags() -> list[str]:
    """-lineinfo under CUBRIDGE_LINEINFO=1 (ncu's per-line stalls; the same machine code), else nothing."""
    return ["-lineinfo"] if config.line_info() else []
