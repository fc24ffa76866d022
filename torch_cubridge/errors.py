"""Errors raised across the pipeline."""
from __future__ import annotations


class UnsupportedSpec(Exception):
    """The spec cannot be compiled. Names the op (graph node) and the reason."""

    def __init__(self, reason: str, op: str | None = None) -> None:
        self.op = op
        self.reason = reason
        self.node: str | None = None   # the captured graph's node it refused, where known
        super().__init__(f"{op}: {reason}" if op else reason)


class HeldTensorRefused(UnsupportedSpec):
    """A side of q.k is a tensor the function holds outside its arguments (a bound method's parameter):
    the cause a refusal reports ahead of the first walk's reason."""


class OutputLayoutRefused(UnsupportedSpec):
    """The spec's views of the attention output give a layout no output names (the query axis split into
    image rows and columns): the walk may run again with those views left to the epilogue."""


class SplitLayoutRefused(UnsupportedSpec):
    """An operand's argument packs dims the spec splits apart (heads and head dim as one [.., H*D] dim):
    the walk may run again with the argument's split view made by the prologue (`input` names it)."""

    def __init__(self, reason: str, op: str | None = None, input: str = "") -> None:
        super().__init__(reason, op)
        self.input = input
