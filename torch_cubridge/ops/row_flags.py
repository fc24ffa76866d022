"""Two facts about a forward's rows that the backward's gate reads (backward_runner.BackwardRunner._rows): does
any row's LSE say a finite fill fills it whole, does any row keep no key.

Read in the backward, they cost a host wait for the GPU once per backward call: the queue drained and refilled
every layer (a training step of an 8-layer llama at 4k spent about 4 ms of 110 idle so). They are made on the
GPU when the forward returns its LSE, and copied to pinned host memory behind it: by the backward the copy has
long landed, and reading it waits on nothing. A backward whose LSE has no such note (the forward ran under
graph capture, or on the CPU) reads the flags itself, as before.
"""
from __future__ import annotations

from collections import OrderedDict

import torch
from torch.multiprocessing.reductions import StorageWeakRef

# A row whose LSE is below this is one a finite fill fills whole (finfo.min, -1e9 over every key): float32
# holds log(count) below the fill's rounding there (ulp(2^14) is 2^-9), so the kernel's P = exp(S - LSE) is
# not normalised on it (the kernel is handed dO divided by P's row sum there:
# backward_reference.dout_for_lse_rounding); real scores never reach it (|s| of 16384 is a one-hot softmax)
FILL_ROW_LSE = -16384.0

# LSEs noted and not yet read (a forward whose backward never runs leaves its note): the newest kept
_KEEP = 4096
_NOTES: OrderedDict[tuple, tuple[torch.cuda.Event, torch.Tensor, StorageWeakRef]] = OrderedDict()


def fill_rows(lse: torch.Tensor) -> torch.Tensor:
    """The rows a finite fill fills whole."""
    return torch.isfinite(lse) & (lse < FILL_ROW_LSE)


def _flags(lse: torch.Tensor) -> torch.Tensor:
    return torch.stack([fill_rows(lse).any(), torch.isneginf(lse).any()])


def _key(lse: torch.Tensor) -> tuple:
    # the LSE is a saved tensor until its backward has run: its storage is not another's before then, and a
    # later forward's LSE at the same address replaces the note. One no forward noted (made under graph
    # capture, a backward check's own forward) may take a dead LSE's place: the note names its storage too
    return lse.device.index, lse.data_ptr(), tuple(lse.shape), tuple(lse.stride())


def note(lse: torch.Tensor) -> None:
    """Start the flags of a forward's LSE on their way to the host (a CUDA LSE, outside graph capture)."""
    if not lse.is_cuda or torch.cuda.is_current_stream_capturing():
        return
    host = torch.empty(2, dtype=torch.bool, pin_memory=True)
    with torch.cuda.device(lse.device):
        host.copy_(_flags(lse), non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(lse.device))
    key = _key(lse)
    _NOTES.pop(key, None)
    _NOTES[key] = (done, host, StorageWeakRef(lse.untyped_storage()))
    while len(_NOTES) > _KEEP:
        _NOTES.popitem(last=False)


def read(lse: torch.Tensor) -> tuple[bool, bool]:
    """(any row a finite fill fills whole, any row with no key) of this LSE: from its note where its forward
    left one, else computed here (one host wait)."""
    got = _NOTES.pop(_key(lse), None) if lse.is_cuda else None
    # a note of another storage at this place is a dead forward's (its weak reference keeps that storage's
    # identity from being reused while the note lives)
    if got is None or got[2].expired() or got[2] != StorageWeakRef(lse.untyped_storage()):
        any_fill, any_empty = _flags(lse).tolist()
        return any_fill, any_empty
    done, host, _ = got
    done.synchronize()
    any_fill, any_empty = host.tolist()
    return any_fill, any_empty
