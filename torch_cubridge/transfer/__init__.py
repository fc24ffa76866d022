"""Transfer: a captured spec becomes a CuIR program (symbolic analysis by default)."""
from .symbolic_backend import symbolic_transfer

__all__ = ["symbolic_transfer"]
