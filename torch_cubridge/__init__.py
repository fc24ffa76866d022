"""torch_cubridge: attention written in PyTorch, compiled to a fused, verified CUDA kernel."""
from .api import cubin, cuda_source, explain, transfer
from .compile import compile
from .errors import UnsupportedSpec
from .ir.program import Program
from .version import __version__

__all__ = ["compile", "transfer", "explain", "cuda_source", "cubin", "UnsupportedSpec", "Program", "__version__"]
