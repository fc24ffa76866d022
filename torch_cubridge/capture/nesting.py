"""Whether this thread is inside a pipeline stage: capture, verification, or a kernel's GPU verification.

A compiled function called while this thread captures or verifies a spec (inside that spec: a model's
attention module routed as a whole whose forward calls the attention interface, inkling2) runs its own spec
(CompiledAttention reads `stage.depth`): the outer capture traces its ops, and the outer reference is the
spec's own answer, never a kernel's.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

import torch


class _Stage(threading.local):
    depth = 0  # pipeline stages this thread is inside


stage = _Stage()


@contextmanager
def staged() -> Iterator[None]:
    """Count this thread as inside a stage for the block's length, with gradients off: a stage's own maths
    (the trace, the float64 reference, the trials) is no part of the caller's autograd graph. A first call
    made with gradients on, inside an activation-checkpointed region, recorded them all as the region's
    saved tensors, and the recomputation (which finds the program made) saved fewer: a CheckpointError."""
    stage.depth += 1
    try:
        with torch.no_grad():
            yield
    finally:
        stage.depth -= 1
