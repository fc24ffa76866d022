"""The on-disk artifact cache and the config paths it lives under."""

from __future__ import annotations

import json
import os
import pickle
import sqlite3
import stat
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest

from torch_cubridge import cache as cache_mod
from torch_cubridge import config
from torch_cubridge.cache import ArtifactCache, CacheError, CacheReadOnlyError
from racing import race

REPO = Path(__file__).resolve().parents[2]
CUBIN = b"\x7fELF fake cubin bytes"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for var in ("CUBRIDGE_READONLY", "CUBRIDGE_CACHE_DIR", "CUBRIDGE_COMPILER"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("CUBRIDGE_CACHE_DIR", str(tmp_path / "root"))


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def _counting_build(counter: Path, delay: float = 0.0):
    def build() -> tuple[bytes, dict]:
        with open(counter, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(delay)
        return CUBIN, {"arch": "sm_90"}

    return build


def _builds(counter: Path) -> int:
    return len(counter.read_text().splitlines()) if counter.exists() else 0


# ---- config ----------------------------------------------------------------


def test_cache_root_from_env_is_private(tmp_path: Path) -> None:
    root = config.cache_root()
    assert root == tmp_path / "root"
    assert _mode(root) == 0o700
    assert _mode(config.kernels_dir()) == 0o700


def test_cache_root_tightens_existing_dir(tmp_path: Path) -> None:
    (tmp_path / "root").mkdir(mode=0o777)
    os.chmod(tmp_path / "root", 0o777)
    assert _mode(config.cache_root()) == 0o700


def test_user_cache_dir_honours_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("CUBRIDGE_CACHE_DIR")
    monkeypatch.setattr(config, "is_source_checkout", lambda: False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert config.cache_root() == tmp_path / "xdg" / "torch_cubridge"
    assert _mode(tmp_path / "xdg" / "torch_cubridge") == 0o700


def test_checkout_uses_repo_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUBRIDGE_CACHE_DIR")
    monkeypatch.setattr(config, "is_source_checkout", lambda: True)
    assert config.cache_root() == REPO / "cache"


def test_csrc_dir_in_checkout() -> None:
    assert (config.csrc_dir() / "cubridge" / "variant.cuh").is_file()


def test_readonly_creates_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CUBRIDGE_READONLY", "1")
    config.kernels_dir()
    assert not (tmp_path / "root").exists()


# ---- round trip, memo, layout ---------------------------------------------


def test_put_get_round_trip(tmp_path: Path) -> None:
    c = ArtifactCache(tmp_path / "k")
    c.put("abc123", CUBIN, {"arch": "sm_90", "threads": 128})
    fresh = ArtifactCache(tmp_path / "k")  # no memo: reads disk
    art = fresh.get("abc123")
    assert art is not None and art.cubin == CUBIN
    assert art.meta["arch"] == "sm_90" and art.meta["threads"] == 128
    meta = json.loads((tmp_path / "k" / "abc123.json").read_text())
    assert meta["sha256"] == art.meta["sha256"] and meta["size"] == len(CUBIN)
    assert (tmp_path / "k" / "abc123.cubin").read_bytes() == CUBIN
    assert fresh.get("abc123") is art  # second get is the memo
    assert fresh.get("missing") is None


def test_module_level_default_cache(tmp_path: Path) -> None:
    counter = tmp_path / "count"
    a = cache_mod.get_or_build("k1", _counting_build(counter))
    b = cache_mod.get_or_build("k1", _counting_build(counter))
    assert a is b and _builds(counter) == 1
    assert (config.kernels_dir() / "k1.cubin").exists()
    assert cache_mod.get("k1") is a


@pytest.mark.parametrize("key", ["", "../x", "a/b", ".hidden", "x" * 201, "a b"])
def test_bad_keys_rejected(tmp_path: Path, key: str) -> None:
    with pytest.raises(CacheError):
        ArtifactCache(tmp_path / "k").get(key)


def test_metadata_must_be_json(tmp_path: Path) -> None:
    with pytest.raises(CacheError):
        ArtifactCache(tmp_path / "k").put("k", CUBIN, {"bad": object()})
    assert not (tmp_path / "k" / "k.json").exists()


def test_dirs_are_0700(tmp_path: Path) -> None:
    c = ArtifactCache(tmp_path / "k")
    c.put("k", CUBIN)
    assert _mode(tmp_path / "k") == 0o700
    assert _mode(tmp_path / "k" / "index") == 0o700


def test_no_temp_files_left(tmp_path: Path) -> None:
    ArtifactCache(tmp_path / "k").put("k", CUBIN)
    assert not [p for p in (tmp_path / "k").iterdir() if p.name.endswith(".tmp")]


# ---- corruption ------------------------------------------------------------


def test_corrupt_cubin_is_a_miss_and_rebuilt(tmp_path: Path) -> None:
    counter = tmp_path / "count"
    ArtifactCache(tmp_path / "k").put("k", CUBIN)
    (tmp_path / "k" / "k.cubin").write_bytes(b"\x7fELF flipped bits!!!!")
    c = ArtifactCache(tmp_path / "k")
    assert c.get("k") is None
    assert not (tmp_path / "k" / "k.json").exists()  # entry deleted
    art = c.get_or_build("k", _counting_build(counter))
    assert art.cubin == CUBIN and _builds(counter) == 1


def test_missing_cubin_is_a_miss(tmp_path: Path) -> None:
    ArtifactCache(tmp_path / "k").put("k", CUBIN)
    (tmp_path / "k" / "k.cubin").unlink()
    assert ArtifactCache(tmp_path / "k").get("k") is None


def test_cubin_without_metadata_is_a_miss(tmp_path: Path) -> None:
    # A crash between the two writes leaves a cubin with no json.
    d = tmp_path / "k"
    ArtifactCache(d).put("k", CUBIN)
    (d / "k.json").unlink()
    ArtifactCache(d).index().delete("k")
    assert ArtifactCache(d).get("k") is None


def test_json_without_index_is_found(tmp_path: Path) -> None:
    d = tmp_path / "k"
    ArtifactCache(d).put("k", CUBIN)
    ArtifactCache(d).index().delete("k")
    c = ArtifactCache(d)
    assert c.get("k") is not None
    assert c.index().get("k") is not None  # re-indexed


# ---- no pickle in the index -------------------------------------------------


def _rows(db: Path) -> list[tuple]:
    with sqlite3.connect(db) as con:
        return con.execute("SELECT key, raw, mode, value, filename FROM Cache").fetchall()


def test_index_holds_json_not_pickle(tmp_path: Path) -> None:
    d = tmp_path / "k"
    ArtifactCache(d).put("k", CUBIN, {"arch": "sm_90"})
    rows = _rows(d / "index" / "cache.db")
    assert len(rows) == 1
    key, raw, mode, value, filename = rows[0]
    assert raw == 1 and mode == 1 and filename is None  # raw key, inline raw value
    key_json = json.loads(zlib.decompress(key))
    assert key_json == "k"
    meta = json.loads(zlib.decompress(value))
    assert meta["arch"] == "sm_90"
    for blob in (key, value):
        assert not zlib.decompress(blob).startswith(b"\x80")  # pickle protocol marker


class _Boom:
    def __reduce__(self):
        return (open, (str(_Boom.marker), "w"))


def test_tampered_pickle_row_is_never_loaded(tmp_path: Path) -> None:
    d = tmp_path / "k"
    ArtifactCache(d).put("k", CUBIN)
    _Boom.marker = tmp_path / "pwned"
    with sqlite3.connect(d / "index" / "cache.db") as con:
        con.execute("UPDATE Cache SET mode = 4, value = ?", (pickle.dumps(_Boom()),))
    art = ArtifactCache(d).get("k")  # falls back to k.json
    assert art is not None and art.cubin == CUBIN
    assert not _Boom.marker.exists()


# ---- readonly --------------------------------------------------------------


def test_readonly_reads_but_never_builds(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    d = tmp_path / "k"
    ArtifactCache(d).put("have", CUBIN)
    monkeypatch.setenv("CUBRIDGE_READONLY", "1")
    ro = ArtifactCache(d)
    assert ro.readonly
    assert ro.get("have").cubin == CUBIN
    counter = tmp_path / "count"
    with pytest.raises(CacheReadOnlyError, match="CUBRIDGE_READONLY"):
        ro.get_or_build("missing", _counting_build(counter))
    with pytest.raises(CacheReadOnlyError):
        ro.put("missing", CUBIN)
    assert _builds(counter) == 0
    assert not (d / "missing.lock").exists()


def test_readonly_keeps_corrupt_files(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    d = tmp_path / "k"
    ArtifactCache(d).put("k", CUBIN)
    (d / "k.cubin").write_bytes(b"garbage")
    monkeypatch.setenv("CUBRIDGE_READONLY", "1")
    assert ArtifactCache(d).get("k") is None
    assert (d / "k.json").exists()  # read-only: reported as a miss, not deleted


# ---- several processes -----------------------------------------------------


def _race_worker(directory: str, counter: str, barrier, out) -> None:
    barrier.wait()
    art = ArtifactCache(Path(directory)).get_or_build("shared", _counting_build(Path(counter), 0.5))
    out.put(art.meta["sha256"])


def test_two_processes_build_once(tmp_path: Path) -> None:
    counter = tmp_path / "count"
    shas = race(_race_worker, (str(tmp_path / "k"), str(counter)), 2, timeout=120)
    assert _builds(counter) == 1
    assert shas[0] == shas[1]


def test_survives_a_new_process(tmp_path: Path) -> None:
    d = tmp_path / "k"
    art = ArtifactCache(d).put("persist", CUBIN, {"arch": "sm_80"})
    code = (
        "import sys; from pathlib import Path;"
        "from torch_cubridge.cache import ArtifactCache;"
        "a = ArtifactCache(Path(sys.argv[1])).get('persist');"
        "print(a.meta['sha256'], a.meta['arch'], len(a.cubin))"
    )
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path)
    res = subprocess.run(
        [sys.executable, "-c", code, str(d)], capture_output=True, text=True, env=env, check=True
    )
    assert res.stdout.split() == [art.meta["sha256"], "sm_80", str(len(CUBIN))]
