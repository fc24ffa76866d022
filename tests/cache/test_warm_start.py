"""Warm start: a process that finds a spec's verified program in the disk cache skips transfer and
CPU verification; the record is keyed so that another spec, other code or a damaged record misses."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest


REPO = Path(__file__).resolve().parents[2]
SCRIPT = r"""
import json, sys, time, torch
from torch_cubridge.pipeline import transfer_stage
SCALE = float(sys.argv[1])
def attn(q, k, v):
    s = (q @ k.transpose(-2, -1)) * SCALE
    i = torch.arange(q.shape[-2])
    s = s.masked_fill(i[None, :] > i[:, None], float("-inf"))
    return torch.softmax(s, -1) @ v
torch.manual_seed(0)
q, k, v = (torch.randn(2, 3, 40, 16) for _ in range(3))
t0 = time.perf_counter()
res = transfer_stage(attn, {"q": q, "k": k, "v": v})
dt = time.perf_counter() - t0
out = res.program.run(q, k, v)
ref = attn(q.double(), k.double(), v.double())
print(json.dumps({"reason": res.report.reason, "trials": len(res.report.trials), "seconds": dt,
                  "err": float((out.double() - ref).abs().max()), "generic": res.generic}))
"""


def _run(tmp_path: Path, scale: float = 0.25, **env: str) -> dict:
    e = dict(os.environ, CUBRIDGE_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(REPO), **env)
    e.pop("CUBRIDGE_READONLY", None) if "CUBRIDGE_READONLY" not in env else None
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(scale)], env=e, capture_output=True, text=True,
                       timeout=300, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _records(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "cache").rglob("prog-*"))


@pytest.fixture(scope="module")
def cold_run(tmp_path_factory) -> tuple[Path, dict]:
    """A cache one cold process filled (SCRIPT at scale 0.25), and what it reported. Each test starts from a
    copy of it (_cold): the cold process is the same in every test, and each costs seconds of torch import."""
    d = tmp_path_factory.mktemp("cold")
    return d / "cache", _run(d)


def _cold(cold_run: tuple[Path, dict], tmp_path: Path) -> dict:
    """tmp_path's cache as the cold process left it; that process's report."""
    shutil.copytree(cold_run[0], tmp_path / "cache", symlinks=True)
    return cold_run[1]


def test_second_process_skips_transfer_and_verification(tmp_path, cold_run):
    cold = _cold(cold_run, tmp_path)
    assert cold["trials"] > 0 and "earlier process" not in cold["reason"]
    warm = _run(tmp_path)
    assert "earlier process" in warm["reason"] and warm["trials"] == 0
    assert warm["err"] < 1e-5 and warm["generic"] == cold["generic"]  # the same program, still right
    # no timing assertion: on a loaded 2-core runner the warm process's start-up (imports) outweighed the
    # work it skips (1.35 s against 1.33); trials == 0 above is what shows transfer and verification skipped


def test_another_spec_misses(tmp_path, cold_run):
    _cold(cold_run, tmp_path)  # scale 0.25
    other = _run(tmp_path, 0.5)  # one constant differs: another spec hash
    assert "earlier process" not in other["reason"] and other["trials"] > 0
    assert other["err"] < 1e-5


def test_damaged_record_is_a_miss(tmp_path, cold_run):
    _cold(cold_run, tmp_path)
    recs = [p for p in _records(tmp_path) if p.suffix == ".cubin"]
    assert recs, sorted(p.name for p in (tmp_path / "cache").rglob("*"))
    for p in recs:  # flip a byte of the stored program: the store's sha256 check must reject it
        b = bytearray(p.read_bytes())
        b[len(b) // 2] ^= 0x20
        p.write_bytes(bytes(b))
    again = _run(tmp_path)
    assert "earlier process" not in again["reason"] and again["trials"] > 0 and again["err"] < 1e-5


def test_read_only_cache_records_nothing(tmp_path):
    (tmp_path / "cache").mkdir(mode=0o700)
    _run(tmp_path, CUBRIDGE_READONLY="1")
    assert not _records(tmp_path)


COMPILED = r"""
import json, os, sys, time, torch
import torch_cubridge as tc
import torch_cubridge.pipeline as pl
if os.environ.get("FORBID_CAPTURE"):
    def no_capture(*a, **k):
        raise AssertionError("capture ran")
    pl.capture = no_capture
WINDOW = int(sys.argv[1])
def attn(q, k, v):
    i = torch.arange(q.shape[-2])
    s = (q @ k.transpose(-2, -1)) * 0.25
    s = s.masked_fill((i[:, None] - i[None, :]).abs() > WINDOW, float("-inf"))
    return torch.softmax(s, -1) @ v
f = tc.compile(attn, fallback="raise")
torch.manual_seed(0)
q, k, v = (torch.randn(2, 3, int(sys.argv[2]), 16) for _ in range(3))
t0 = time.perf_counter()
f(q, k, v)
dt = time.perf_counter() - t0
e = f.entries()[0]
out = e.result.program.run(q, k, v)
ref = attn(q.double(), k.double(), v.double())
print(json.dumps({"reason": e.result.report.reason, "seconds": dt, "err": float((out.double() - ref).abs().max())}))
"""


def _run_compiled(tmp_path: Path, window: int, S: int = 40, **env: str) -> dict:
    e = dict(os.environ, CUBRIDGE_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(REPO), **env)
    r = subprocess.run([sys.executable, "-c", COMPILED, str(window), str(S)], env=e, capture_output=True,
                       text=True, timeout=300, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def cold_compiled(tmp_path_factory) -> tuple[Path, dict]:
    """A cache one cold process filled through tc.compile (COMPILED, window 5, length 40), and its report."""
    d = tmp_path_factory.mktemp("cold_compiled")
    return d / "cache", _run_compiled(d, 5)


def test_second_process_skips_capture_where_the_code_key_matches(tmp_path, cold_compiled):
    cold = _cold(cold_compiled, tmp_path)
    assert "earlier process" not in cold["reason"]
    warm = _run_compiled(tmp_path, 5, FORBID_CAPTURE="1")  # capture would raise here
    assert "no capture" in warm["reason"] and warm["err"] < 1e-5
    assert warm["seconds"] < cold["seconds"]
    # another length inside the program's guards: still no capture, still right
    longer = _run_compiled(tmp_path, 5, S=57, FORBID_CAPTURE="1")
    assert "no capture" in longer["reason"] and longer["err"] < 1e-5


def test_a_changed_global_changes_the_code_key(tmp_path, cold_compiled):
    _cold(cold_compiled, tmp_path)  # window 5
    other = _run_compiled(tmp_path, 9)  # WINDOW differs: the old program must not serve
    assert "no capture" not in other["reason"] and other["err"] < 1e-5


def test_gpu_verdicts_remember_pass_and_failure(tmp_path, monkeypatch):
    """A kernel's GPU verdict is recalled both ways: a warm process neither re-verifies a kernel that
    passed nor one whose fast-tanh build failed (it goes straight to the exact build)."""
    monkeypatch.setenv("CUBRIDGE_CACHE_DIR", str(tmp_path / "cache"))
    from torch_cubridge.cache import verdicts
    assert verdicts.gpu_verdict("fwd-a:sha", "spec", "H100") is None
    verdicts.remember_gpu_verdict("fwd-a:sha", "spec", "H100", False, 0.3)
    verdicts.remember_gpu_verdict("fwd-b:sha", "spec", "H100", True, 1e-3)
    assert verdicts.gpu_verdict("fwd-a:sha", "spec", "H100") is False
    assert verdicts.gpu_verdict("fwd-b:sha", "spec", "H100") is True
    assert verdicts.gpu_verdict("fwd-b:other", "spec", "H100") is None  # another binary: verified again


def test_processes_racing_on_a_new_spec_transfer_and_verify_it_once(tmp_path):
    """Three processes meet the same new spec at once (each waits for a start file after its imports): one
    transfers and verifies it holding the spec's turn, the other two wait for the turn and take its record, so
    the work is not done three times over on the same cores."""
    e = dict(os.environ, CUBRIDGE_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(REPO))
    e.pop("CUBRIDGE_READONLY", None)
    go = tmp_path / "go"
    ready, gate = str(tmp_path / "ready"), str(go)
    gated = SCRIPT.replace("t0 = time.perf_counter()",  # each says it is ready, then waits for the start file
                           f"import os\nopen({ready!r} + str(os.getpid()), 'w').close()\n"
                           f"while not os.path.exists({gate!r}): time.sleep(0.01)\nt0 = time.perf_counter()")
    procs = [subprocess.Popen([sys.executable, "-c", gated, "0.25"], env=e, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=str(tmp_path)) for _ in range(3)]
    try:
        deadline = time.monotonic() + 300
        while len(list(tmp_path.glob("ready*"))) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        go.touch()
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    got = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    worked = [g for g in got if g["trials"] > 0]
    assert len(worked) == 1, got
    assert all("earlier process" in g["reason"] for g in got if g is not worked[0])
    assert all(g["err"] < 1e-5 for g in got)
