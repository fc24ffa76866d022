"""Signals from the kernel path back to the compiled function (importable without CUDA)."""


class SpecServes(Exception):
    """This call must be computed by the spec itself; the message says why."""


class NeedsAutograd(SpecServes):
    """A call whose result needs gradients (there is no backward kernel yet)."""
