"""The README is the front page: small, no run diary, its example runs as written, its table is the latest results'."""
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
sys.path.insert(0, str(ROOT / "benchmarks"))
import readme_table  # noqa: E402


def test_the_readme_is_a_front_page():
    assert len(README.encode()) <= 15_000
    long = [n for n, line in enumerate(README.splitlines(), 1) if len(line) > 200]
    assert not long, f"lines over 200 characters: {long}"


def test_no_run_labels_in_the_tree():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    if not tracked:  # not a git checkout (an installed copy): nothing to scan
        return
    # session labels, notebook versions and numbered device runs: the history belongs in git and the issues
    label = re.compile(r"\bs1[0-9]{3}[a-z]{1,2}\b|NOTES v[0-9]+|\b(?:H100|H200|device|GPU) runs? [0-9]+")
    hits = []
    for name in tracked:
        path = ROOT / name
        if path.suffix in {".json", ".cubin", ".whl"} or not path.is_file():
            continue
        text = path.read_text(errors="ignore")
        hits += [f"{name}: {m.group(0)}" for m in label.finditer(text)]
    assert not hits, hits[:10]


def test_the_performance_table_is_the_latest_results():
    begin, end = README.index(readme_table.BEGIN), README.index(readme_table.END) + len(readme_table.END)
    assert README[begin:end] == readme_table.render(), "run: python benchmarks/readme_table.py --write"


def test_the_table_check_fails_on_a_stale_table():
    stale = README.replace("| full | 4096 | 128 |", "| full | 4096 | 128 | 1 |", 1)
    begin, end = stale.index(readme_table.BEGIN), stale.index(readme_table.END) + len(readme_table.END)
    assert stale[begin:end] != readme_table.render()


def test_the_two_commands_are_there():
    assert 'pip install -e ".[test]" && cubridge explain torch_cubridge/examples/specs.py:softcap_sliding_gqa' in README
    assert "python -m pytest tests -q -n auto" in README
    assert "python -m pytest tests -q -n auto" in (ROOT / ".ci" / "run").read_text()  # CI runs it as written


def test_the_example_runs_as_written(tmp_path):
    example = README.split("## Example", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    env = dict(os.environ, CUBRIDGE_CACHE_DIR=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-c", example], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    err = float(re.search(r"max error against float64: (\S+)", r.stdout).group(1))
    assert err < 1e-2
    assert "== CuIR program ==" in r.stdout and "verification: PASS" in r.stdout
