"""Where the tests live, for the test session and for the child processes tests start: the test folders
import each other's helpers by module name, so each folder is on the search path."""
from __future__ import annotations

import os
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
# tests/ itself (for the corpus package), then support/, then each package's folder
SEARCH = [TESTS, TESTS / "support"] + sorted(p for p in TESTS.iterdir()
                                             if p.is_dir() and p.name not in {"support", "corpus", "__pycache__"})


def child_pythonpath() -> str:
    """PYTHONPATH for a child process that imports the package and the tests' modules."""
    return os.pathsep.join([str(ROOT), *map(str, SEARCH), os.environ.get("PYTHONPATH", "")])
