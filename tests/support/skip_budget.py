"""The skip account of a test session: skips of tests marked `gpu` on a machine without CUDA are expected;
any other skip (a missing nvcc, a transformers version that did not install, a family that did not build)
is counted by reason. With CUBRIDGE_SKIP_BUDGET=N the session fails when those skips exceed N, so a
runner that lost a tool cannot stay green."""
from __future__ import annotations

import collections
import os

import pytest

_skips: collections.Counter = collections.Counter()
_gpu_skips = 0


def record(report: pytest.TestReport) -> None:
    global _gpu_skips
    if not report.skipped or getattr(report, "wasxfail", None) is not None:
        return
    if "gpu" in report.keywords:
        _gpu_skips += 1
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    _skips[reason.removeprefix("Skipped: ")] += 1


def budget() -> int | None:
    value = os.environ.get("CUBRIDGE_SKIP_BUDGET")
    return int(value) if value else None


def over_budget() -> bool:
    b = budget()
    return b is not None and sum(_skips.values()) > b


def summary(write_line) -> None:
    b = budget()
    write_line(f"skips: {_gpu_skips} GPU tests, {sum(_skips.values())} others"
               + (f" (budget {b})" if b is not None else ""))
    for reason, n in _skips.most_common():
        write_line(f"  {n:4d}  {reason[:160]}")
    if over_budget():
        write_line(f"skips over budget: a stage lost its tools, or CUBRIDGE_SKIP_BUDGET ({b}) is stale")
