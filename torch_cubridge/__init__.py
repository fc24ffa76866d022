"""torch_cubridge: attention written in PyTorch, compiled to a fused, verified CUDA kernel."""
from .api import explain, transfer
from .compile import compile
from .errors import UnsupportedSpec, VerificationError
from .ir.program import Program
from .version import __version__

__all__ = ["compile", "transfer", "explain", "UnsupportedSpec", "VerificationError", "Program", "__version__"]
