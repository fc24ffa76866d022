"""Parsing of target architecture strings ("sm_80", "sm_90", "sm_90a")."""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import BuildError

_ARCH_RE = re.compile(r"^sm_(\d{2,3})([af]?)$")


@dataclass(frozen=True)
class Arch:
    number: str  # "90"
    suffix: str  # "" or "a" (arch-specific features such as wgmma)

    @property
    def sm(self) -> str:
        return f"sm_{self.number}{self.suffix}"

    @property
    def compute(self) -> str:
        return f"compute_{self.number}{self.suffix}"


def parse_arch(arch: str) -> Arch:
    m = _ARCH_RE.match(arch.strip())
    if not m:
        raise BuildError(f"bad arch {arch!r}; expected e.g. 'sm_80', 'sm_90' or 'sm_90a'")
    return Arch(m.group(1), m.group(2))
