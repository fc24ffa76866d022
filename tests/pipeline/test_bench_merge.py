"""bench_train's parts joined into one result (`--merge`): rows of one commit by variant, S and D, a later
part's replacing an earlier's; parts of two commits refused with one line and a non-zero exit."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _part(path: Path, commit: str, rows: list[tuple[str, int, int, float]]) -> str:
    path.write_text(json.dumps({"benchmark": "bench_train", "commit": commit, "gpu": "G", "torch": "t", "date": "d",
                                "results": [{"variant": v, "S": s, "D": d, "ours_tflops": t} for v, s, d, t in rows]}))
    return str(path)


def _merge(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_train.py"), "--merge", *args],
                          capture_output=True, text=True, timeout=300)


def test_parts_of_one_commit_join_and_a_later_row_wins(tmp_path):
    a = _part(tmp_path / "a.json", "abc1234", [("causal", 4096, 128, 1.0), ("full", 4096, 128, 2.0)])
    b = _part(tmp_path / "b.json", "abc1234", [("full", 4096, 128, 3.0), ("causal", 16384, 128, 4.0)])
    r = _merge(a, b, "--out", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    got = json.loads((tmp_path / "out" / "bench_train.json").read_text())
    assert got["commit"] == "abc1234"
    assert [(x["variant"], x["S"], x["ours_tflops"]) for x in got["results"]] == [
        ("causal", 4096, 1.0), ("full", 4096, 3.0), ("causal", 16384, 4.0)]


def test_parts_of_two_commits_are_refused_in_one_line(tmp_path):
    a = _part(tmp_path / "a.json", "abc1234", [("causal", 4096, 128, 1.0)])
    b = _part(tmp_path / "b.json", "def5678", [("full", 4096, 128, 3.0)])
    r = _merge(a, b, "--out", str(tmp_path / "out"))
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0 and "abc1234" in r.stderr and "def5678" in r.stderr
    assert not (tmp_path / "out" / "bench_train.json").exists()
