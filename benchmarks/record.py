"""A benchmark's result file: `<name>.json` carrying what it measured and where (commit, GPU, torch, date).

Every benchmark writes through `save`, so each result names the code and the machine it came from. The
device run writes under $OUT; the copy kept in the tree is `benchmarks/results/<name>.json`, overwritten by
the next run of the same benchmark (git keeps the history).
"""
from __future__ import annotations

import datetime
import json
import os
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def commit() -> str:
    """The checkout's commit, with "+dirty" where tracked files differ from it; $CUBRIDGE_COMMIT where the
    tree came without its git directory."""
    env = os.environ.get("CUBRIDGE_COMMIT")
    if env:
        return env
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head + ("+dirty" if dirty else "")) if head else "unknown"


def environment() -> dict[str, Any]:
    import torch
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"commit": commit(), "gpu": gpu, "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")}


def save(out: str | os.PathLike, name: str, payload: dict[str, Any]) -> Path:
    """Write `<out>/<name>.json`: the environment first, then the benchmark's own fields."""
    path = Path(out) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"benchmark": name, **environment(), **payload}, indent=1))
    return path
