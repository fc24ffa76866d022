"""torch_cubridge: attention written in PyTorch, compiled to a fused, verified CUDA kernel."""
from .errors import UnsupportedSpec, VerificationError
from .ir.program import Program
from .version import __version__

__all__ = ["UnsupportedSpec", "VerificationError", "Program", "__version__"]
