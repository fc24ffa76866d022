"""Target architecture strings ("sm_80", "sm_90", "sm_90a"): parsed, and chosen for a device."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..config import hopper_kernel_enabled
from ..errors import UnsupportedSpec
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


def arch_for(device: torch.device) -> str:
    """The arch this kernel is built for on `device`: sm_80 class, or sm_90a (Hopper: wgmma, TMA)."""
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        raise UnsupportedSpec(f"the kernel needs sm_80 or newer; this GPU is sm_{major}{minor}", op="kernel")
    if major == 9:
        return "sm_90a" if minor == 0 and hopper_kernel_enabled() else "sm_90"
    return f"sm_{major}{minor}" if major == 8 else "sm_80"


def backward_arch(device: torch.device) -> str:
    """The backward kernel's target on `device`: on Hopper the forward's own (sm_90a, its wgmma backward
    kernel, unless the Hopper kernels are switched off), else the device's sm_XY."""
    major, minor = torch.cuda.get_device_capability(device)
    return arch_for(device) if major == 9 else f"sm_{major}{minor}"
