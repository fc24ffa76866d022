"""Verdicts that outlive the process: a verified program under its spec hash, and "this kernel
passed GPU verification for this program on this GPU model".

Both are small records in the kernel store (sha256-checked on every read, atomic writes, file
locks), so a warm process skips transfer, CPU verification and GPU verification. The keys carry
everything the verdict depends on: the spec hash already covers the captured graph, constants,
argument shapes and dtypes and this package's source; the GPU verdict adds the kernel key
(source, arch), the cubin's sha256 and the device. Any problem reading one is a miss, never an error.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
from typing import Any, Iterator

import filelock

from .. import config
from . import default_cache

_PROGRAM, _GPU, _WARM, _TRACE, _TURN = "prog-", "gpuok-", "warm-", "trace-", "turn-"
TURN_WAIT_S = 60.0  # a turn held longer than this (a hung process) is not waited for
_WRITTEN: set[str] = set()  # the records this process wrote: a verdict read back from one is its own


def _digest(*parts: str) -> str:
    h = hashlib.sha256()
    h.update(_code_version().encode())
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()[:40]


def _code_version() -> str:
    from ..capture.hashing import package_digest
    return package_digest()


def _recall(kind: str, *parts: str) -> dict[str, Any] | None:
    """The record stored under (kind, parts), or None."""
    try:
        art = default_cache().get(kind + _digest(*parts))
        return None if art is None else json.loads(art.cubin.decode())
    except Exception:  # a missing, corrupt or unreadable record is a miss
        return None


def _remember(kind: str, record: dict[str, Any], *parts: str) -> None:
    """Store a record; read-only caches and write failures are silent (the call already succeeded)."""
    if config.is_readonly():
        return
    try:
        name = kind + _digest(*parts)
        default_cache().put(name, json.dumps(record, sort_keys=True).encode(), {"kind": kind.rstrip("-")})
        _WRITTEN.add(name)
    except Exception:
        pass


def _origin(name: str) -> str:
    """Who made the record `name`, for a report: this process, a bundle `cubridge cache import` brought,
    or an earlier process on this machine."""
    if name in _WRITTEN:
        return "earlier in this process"
    try:
        meta = default_cache().meta(name) or {}
    except Exception:
        meta = {}
    return "in an imported bundle" if meta.get("bundle") else "by an earlier process"


def program_origin(spec_key: str) -> str:
    """Where the program recorded under `spec_key` was verified ("earlier in this process", ...)."""
    return _origin(_PROGRAM + _digest(spec_key))


def gpu_origin(kernel_key: str, spec_key: str, device: str) -> str:
    """Where the GPU verdict for this kernel, program and device was reached."""
    return _origin(_GPU + _digest(kernel_key, spec_key, device))


def recall_program(spec_key: str) -> dict[str, Any] | None:
    return _recall(_PROGRAM, spec_key)


def remember_program(spec_key: str, program_json: str, generic: bool, backend: str) -> None:
    _remember(_PROGRAM, {"program": program_json, "generic": generic, "backend": backend}, spec_key)


def recall_warm(code_key: str, signature: str) -> str | None:
    """The spec hash whose program an earlier process verified for this code key and signature."""
    rec = _recall(_WARM, code_key, signature)
    return str(rec["spec_key"]) if rec and "spec_key" in rec else None


def remember_warm(code_key: str, signature: str, spec_key: str) -> None:
    _remember(_WARM, {"spec_key": spec_key}, code_key, signature)


def recall_trace(trace_key: str, program_json: str) -> str | None:
    """The spec hash under which this exact program (guards included) was verified for a module whose
    trace was this graph (pipeline.transfer_stage)."""
    rec = _recall(_TRACE, trace_key, program_json)
    return str(rec["spec_key"]) if rec and "spec_key" in rec else None


def remember_trace(trace_key: str, program_json: str, spec_key: str) -> None:
    _remember(_TRACE, {"spec_key": spec_key}, trace_key, program_json)


def gpu_verdict(kernel_key: str, spec_key: str, device: str) -> bool | None:
    """True: passed GPU verification here before; False: failed it; None: never verified."""
    rec = _recall(_GPU, kernel_key, spec_key, device)
    return None if not rec or "ok" not in rec else bool(rec["ok"])


def remember_gpu_verdict(kernel_key: str, spec_key: str, device: str, ok: bool, worst: float) -> None:
    _remember(_GPU, {"ok": ok, "worst_rel_err": worst}, kernel_key, spec_key, device)


@contextlib.contextmanager
def transfer_turn(spec_key: str) -> Iterator[bool]:
    """Processes that meet the same new spec take turns: the first transfers and verifies it holding the turn
    (its record written before the turn ends), and the others wait for the turn, not doing the same work on the
    same cores, then look for its record. Yields whether this process waited: it then looks for the record, and
    where there is none (a refusal, a failure) it works on without the turn, beside the others. Read-only
    caches and lock problems take no turn."""
    lock = None
    if not config.is_readonly():
        try:
            lock = default_cache().turn_lock(_TURN + _digest(spec_key))
            lock.acquire(timeout=0)
        except filelock.Timeout:
            try:
                lock.acquire(timeout=TURN_WAIT_S)
                lock.release()
            except Exception:
                pass
            yield True
            return
        except Exception:
            lock = None
    try:
        yield False
    finally:
        if lock is not None:
            lock.release()
