"""A verified program recalled from the disk cache, where an earlier process made it, instead of made again.

Two keys reach a record: the spec hash of a capture (the same spec, captured again), and the warm key of
a call (its code key and call signature), which needs no capture at all.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..cache import verdicts
from ..ir.guards import bound_failing
from ..ir.program import Program
from ..verify.cpu import VerifyReport
from .codekey import code_key
from .trace import Captured


@dataclass
class Transferred:
    """A verified program and how it was obtained."""
    program: Program
    captured: Captured | None  # None when a warm record stood in for capture
    generic: bool          # valid at other batch sizes and lengths (within its guards)
    report: VerifyReport
    key: str               # the spec hash
    backend: str           # "symbolic" or "llm"


def warm_key(fn: Callable, call_key: tuple) -> tuple[str, str] | None:
    """(code key, call signature) as text, where both are stable across processes; else None."""
    text = repr(call_key)
    if " at 0x" in text:  # an object keyed by identity: nothing another process could match
        return None
    ck = code_key(fn)
    return (ck, text) if ck is not None else None


def warm_transfer(where: tuple[str, str] | None, bound: dict[str, Any], backend: str = "symbolic"
                  ) -> Transferred | None:
    """The program an earlier process verified for this code key and call signature (`where`,
    from warm_key), without capture, where its guards hold for this call; else None."""
    spec_key = verdicts.recall_warm(*where) if where else None
    res = remembered(None, spec_key, backend, "no capture: same code key") if spec_key else None
    if res is None:
        return None
    try:
        return res if bound_failing(res.program.guards, bound) is None else None
    except Exception:  # guards this version cannot check are a miss
        return None


def remembered(cap: Captured | None, key: str, backend: str, how: str) -> Transferred | None:
    """The program recorded under spec hash `key`, where `backend` may use it; else None."""
    rec = verdicts.recall_program(key)
    if rec is None or not _allowed(rec, backend):
        return None
    try:
        prog = Program.from_json(rec["program"])
    except Exception:  # a record this version cannot read is a miss
        return None
    report = VerifyReport(ok=True, reason=f"(verified {verdicts.program_origin(key)}; {how})")
    return Transferred(prog, cap, bool(rec["generic"]), report, key, str(rec["backend"]))


def _allowed(rec: dict, backend: str) -> bool:
    """A record serves only a request its backend could have made it for ("auto" takes either)."""
    return backend == "auto" or rec.get("backend") == backend
