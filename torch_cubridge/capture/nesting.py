"""Whether this thread is inside a pipeline stage: capture, verification, or a kernel's GPU verification.

While any thread is inside a stage, torch's CPU ops take one intra-op thread (the caller's count comes back
when the last stage ends). A stage's CPU work is small tensors: tracing, shape probes, float64 references on
redrawn cases. With torch's default of a thread per core, sixteen processes racing on a cold cache on a
16-core H200 host ran 256 spinning OpenMP threads: the slowest first call took 41.7 s, the median 37.1 s;
with one thread 3.0 s and 2.4 s. A lone process's cold first call went from 5.0 s to 2.6 s too.

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
    caller_grad = False  # the caller's grad mode as the outermost stage began


stage = _Stage()
_threads_lock = threading.Lock()
_inside = 0  # threads of this process inside a stage
_callers_threads = 0  # torch's intra-op thread count when the first of them entered


def _enter_threads() -> None:
    global _inside, _callers_threads
    with _threads_lock:
        if _inside == 0:
            _callers_threads = torch.get_num_threads()
            if _callers_threads != 1:
                torch.set_num_threads(1)
        _inside += 1


def _leave_threads() -> None:
    global _inside
    with _threads_lock:
        _inside -= 1
        if _inside == 0 and torch.get_num_threads() != _callers_threads:
            torch.set_num_threads(_callers_threads)


def caller_wants_grad() -> bool:
    """The grad mode of the call that this thread's stages serve (inside them gradients are off)."""
    return stage.caller_grad if stage.depth else torch.is_grad_enabled()


@contextmanager
def staged() -> Iterator[None]:
    """Count this thread as inside a stage for the block's length, with gradients off: a stage's own maths
    (the trace, the float64 reference, the trials) is no part of the caller's autograd graph. A first call
    made with gradients on, inside an activation-checkpointed region, recorded them all as the region's
    saved tensors, and the recomputation (which finds the program made) saved fewer: a CheckpointError."""
    stage.depth += 1
    if stage.depth == 1:
        stage.caller_grad = torch.is_grad_enabled()
        _enter_threads()
    try:
        with torch.no_grad():
            yield
    finally:
        if stage.depth == 1:
            _leave_threads()
        stage.depth -= 1
