"""Signals from the kernel path back to the compiled function (importable without CUDA)."""


class NeedsAutograd(Exception):
    """A call whose result needs gradients: the spec serves it (there is no backward kernel yet)."""
