"""Verified kernels of this process by id, for the custom op (custom_op.py). A module of its own so
that serving a kernel eagerly never pays for the op's registration with torch.library (~75 ms in a
new process on the H100, most of it torch finding the registering function's source)."""
from __future__ import annotations

from .determinism import split

_REGISTRY: dict[str, object] = {}


def register(kernel_id: str, runner: object) -> str:
    _REGISTRY[kernel_id] = runner
    return kernel_id


def runner_for(kernel_id: str) -> object:
    """The runner registered as `kernel_id` (an op call's name may carry ops/determinism.py's suffix)."""
    try:
        return _REGISTRY[split(kernel_id)[0]]
    except KeyError:
        raise RuntimeError(f"cubridge kernel {kernel_id} is not loaded in this process; call the compiled "
                           "function once eagerly (it builds and verifies the kernel) before tracing") from None
