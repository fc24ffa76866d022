"""The kernel cache cannot be turned into code execution: unsafe dirs, forged rows, junk."""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import stat
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import pytest

from torch_cubridge import cache as cache_mod
from torch_cubridge import config
from torch_cubridge.cache import ArtifactCache, UnsafeCacheDirError
from torch_cubridge.cache.index import Index
from racing import race

REPO = Path(__file__).resolve().parents[2]
CUBIN = b"\x7fELF the real cubin"
EVIL = b"\x7fELF planted by someone else"
NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown / setuid")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for var in ("CUBRIDGE_READONLY", "CUBRIDGE_CACHE_DIR", "CUBRIDGE_COMPILER"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("CUBRIDGE_CACHE_DIR", str(tmp_path / "root"))


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def _build_real() -> tuple[bytes, dict]:
    return CUBIN, {"arch": "sm_90"}


def _subprocess_env(**extra: str) -> dict:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path, **extra)


# ---- who may write the cache directory ---------------------------------------


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702])
def test_writable_by_others_root_is_refused(tmp_path: Path, mode: int) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (root / "kernels").mkdir(mode=0o700)  # not empty: something may have been planted
    os.chmod(root, mode)
    with pytest.raises(UnsafeCacheDirError) as err:
        cache_mod.get_or_build("k", _build_real)
    msg = str(err.value)
    assert "CUBRIDGE_CACHE_DIR" in msg and f"chmod go-w {root}" in msg
    assert _mode(root) == mode  # refused, not silently changed


def test_writable_kernels_dir_is_refused(tmp_path: Path) -> None:
    kernels = tmp_path / "root" / "kernels"
    kernels.mkdir(parents=True, mode=0o700)
    (kernels / "k.json").write_text("{}")
    os.chmod(kernels, 0o777)
    with pytest.raises(UnsafeCacheDirError, match="CUBRIDGE_CACHE_DIR"):
        config.kernels_dir()
    with pytest.raises(UnsafeCacheDirError, match="chmod go-w"):
        ArtifactCache(kernels)


def test_dir_loosened_after_open_is_refused_on_next_read(tmp_path: Path) -> None:
    c = ArtifactCache(tmp_path / "k")
    c.put("k", CUBIN)
    os.chmod(tmp_path / "k", 0o777)
    with pytest.raises(UnsafeCacheDirError):
        ArtifactCache(tmp_path / "k", readonly=True).get("k")
    c.clear_memo()
    with pytest.raises(UnsafeCacheDirError):
        c.get("k")


@as_root
def test_dir_of_another_user_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir(mode=0o755)
    os.chown(root, NOBODY, NOBODY)
    with pytest.raises(UnsafeCacheDirError) as err:
        config.cache_root()
    msg = str(err.value)
    assert "CUBRIDGE_CACHE_DIR" in msg and f"uid {NOBODY}" in msg and "chown" in msg


@as_root
def test_dir_of_another_user_is_refused_readonly(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    d = tmp_path / "root" / "kernels"
    ArtifactCache(d).put("k", CUBIN)
    os.chown(d, NOBODY, NOBODY)
    monkeypatch.setenv("CUBRIDGE_READONLY", "1")
    with pytest.raises(UnsafeCacheDirError, match="CUBRIDGE_CACHE_DIR"):
        cache_mod.get("k")


def test_parent_writable_by_others_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Whoever can write the parent can rename our 0700 dir away and put theirs there.
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    monkeypatch.setenv("CUBRIDGE_CACHE_DIR", str(shared / "cache"))
    with pytest.raises(UnsafeCacheDirError, match=f"its parent {shared} is writable"):
        config.cache_root()
    assert not (shared / "cache").exists()  # refused before creating anything
    (shared / "cache").mkdir(mode=0o700)  # an existing private dir does not make it safe
    with pytest.raises(UnsafeCacheDirError, match=f"its parent {shared} is writable"):
        config.cache_root()


def test_sticky_parent_is_fine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Like /tmp: others may add entries but cannot rename ours.
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    monkeypatch.setenv("CUBRIDGE_CACHE_DIR", str(shared / "cache"))
    assert cache_mod.get_or_build("k", _build_real).cubin == CUBIN
    assert _mode(shared / "cache") == 0o700


def test_symlinked_root_to_unsafe_dir_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    target = tmp_path / "open"
    target.mkdir()
    (target / "kernels").mkdir()
    os.chmod(target, 0o777)
    (tmp_path / "link").symlink_to(target)
    monkeypatch.setenv("CUBRIDGE_CACHE_DIR", str(tmp_path / "link"))
    with pytest.raises(UnsafeCacheDirError, match=str(target)):
        config.cache_root()


def test_symlinked_root_to_safe_dir_uses_the_real_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    target = tmp_path / "mine"
    target.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(target)
    monkeypatch.setenv("CUBRIDGE_CACHE_DIR", str(tmp_path / "link"))
    assert config.cache_root() == target
    cache_mod.get_or_build("k", _build_real)
    assert (target / "kernels" / "k.cubin").read_bytes() == CUBIN


def test_symlinked_kernels_dir_to_unsafe_dir_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "k.json").write_text("{}")
    os.chmod(elsewhere, 0o777)
    (root / "kernels").symlink_to(elsewhere)
    with pytest.raises(UnsafeCacheDirError):
        config.kernels_dir()


def test_empty_dir_of_ours_is_tightened(tmp_path: Path) -> None:
    # Nothing in it, so nothing can have been planted: as good as creating it.
    (tmp_path / "root").mkdir()
    os.chmod(tmp_path / "root", 0o777)
    assert _mode(config.cache_root()) == 0o700


# ---- the checkout's tracked cache/ and read-only deployments -----------------


def test_checkout_cache_dir_is_used_as_git_left_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUBRIDGE_CACHE_DIR")
    monkeypatch.setattr(config, "is_source_checkout", lambda: True)
    before = _mode(REPO / "cache")
    assert config.cache_root() == REPO / "cache"
    assert _mode(REPO / "cache") == before


def _fake_checkout(tmp_path: Path, mode: int) -> Path:
    repo = tmp_path / "repo"
    (repo / "cache").mkdir(parents=True)
    (repo / "setup.py").write_text("")
    (repo / "cache" / "README.md").write_text("tracked")
    os.chmod(repo / "cache", mode)
    return repo


def test_checkout_cache_0755_works(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    repo = _fake_checkout(tmp_path, 0o755)
    monkeypatch.delenv("CUBRIDGE_CACHE_DIR")
    monkeypatch.setattr(config, "_REPO_DIR", repo)
    assert cache_mod.get_or_build("k", _build_real).cubin == CUBIN
    assert _mode(repo / "cache") == 0o755 and _mode(repo / "cache" / "kernels") == 0o700


def test_checkout_cache_writable_by_group_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    repo = _fake_checkout(tmp_path, 0o775)  # a clone made under umask 002
    monkeypatch.delenv("CUBRIDGE_CACHE_DIR")
    monkeypatch.setattr(config, "_REPO_DIR", repo)
    with pytest.raises(UnsafeCacheDirError) as err:
        config.cache_root()
    assert f"chmod go-w {repo / 'cache'}" in str(err.value) and "CUBRIDGE_CACHE_DIR" in str(err.value)


def _as_user_in_child(uid: int, fn) -> int:
    """Run fn() in a forked child that dropped to `uid`; its exit status (0: fn returned True)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        code = 3
        try:
            os.setgid(uid)
            os.setuid(uid)
            code = 0 if fn() else 1
        except UnsafeCacheDirError:
            code = 2
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


@as_root
def test_readonly_root_owned_cache_serves_other_users() -> None:
    # The deployment case: root prebuilt the cache; an unprivileged service reads it.
    base = Path(tempfile.mkdtemp(prefix="cubridge-ro-"))  # /tmp: reachable by nobody
    try:
        os.chmod(base, 0o755)
        kernels = base / "kernels"
        ArtifactCache(kernels).put("k", CUBIN)
        os.chmod(kernels, 0o755)
        os.chmod(kernels / "k.cubin", 0o644)
        os.chmod(kernels / "k.json", 0o644)

        def read() -> bool:
            art = ArtifactCache(kernels, readonly=True).get("k")
            return art is not None and art.cubin == CUBIN

        assert _as_user_in_child(NOBODY, read) == 0
        os.chown(kernels, 1234, 1234)  # another ordinary user's cache: refused, even read-only
        assert _as_user_in_child(NOBODY, read) == 2
    finally:
        subprocess.run(["rm", "-rf", str(base)], check=True)


# ---- forged metadata never gets a planted cubin loaded --------------------------


def test_planted_cubin_with_forged_json_is_never_loaded(tmp_path: Path) -> None:
    d = tmp_path / "k"
    ArtifactCache(d).put("k", CUBIN)
    meta = json.loads((d / "k.json").read_text())
    (d / "k.cubin").write_bytes(EVIL)
    (d / "k.json").write_text(json.dumps(dict(meta, size=len(EVIL))))  # sha256 still the old one
    c = ArtifactCache(d)
    assert c.get("k") is None
    assert c.get_or_build("k", _build_real).cubin == CUBIN


def test_entry_copied_under_another_key_is_never_loaded(tmp_path: Path) -> None:
    # sha256 matches its bytes, but the metadata vouches for key "a", not "b".
    d = tmp_path / "k"
    ArtifactCache(d).put("a", EVIL)
    (d / "b.cubin").write_bytes((d / "a.cubin").read_bytes())
    (d / "b.json").write_text((d / "a.json").read_text())
    c = ArtifactCache(d)
    assert c.get("b") is None
    assert c.get_or_build("b", _build_real).cubin == CUBIN
    assert c.get("a").cubin == EVIL  # "a" itself is intact


def _set_row(db: Path, key: str, meta: dict, **columns) -> None:
    """Rewrite the index row of `key` as someone with write access to the db could."""
    blob = zlib.compress(json.dumps(meta).encode(), 1)
    key_blob = zlib.compress(json.dumps(key).encode(), 1)  # JSONDisk's level: same bytes
    sets = ", ".join(f"{c} = ?" for c in ("value", *columns))
    with sqlite3.connect(db) as con:
        n = con.execute(f"UPDATE Cache SET {sets} WHERE key = ?", (blob, *columns.values(), key_blob)).rowcount
    assert n == 1


@pytest.mark.parametrize("forged", ["other key", "wrong sha"])
def test_planted_cubin_with_forged_index_row_is_never_loaded(tmp_path: Path, forged: str) -> None:
    d = tmp_path / "k"
    ArtifactCache(d).put("k", CUBIN)
    meta = json.loads((d / "k.json").read_text())
    (d / "k.cubin").write_bytes(EVIL)
    row = dict(meta, key="other", sha256=_sha(EVIL)) if forged == "other key" else meta
    _set_row(d / "index" / "cache.db", "k", row)
    assert ArtifactCache(d).get("k") is None


@pytest.mark.parametrize("where", ["absolute", "relative"])
def test_index_row_naming_a_path_is_never_read_or_deleted(tmp_path: Path, where: str) -> None:
    d = tmp_path / "k"
    ArtifactCache(d).put("k", CUBIN)
    meta = json.loads((d / "k.json").read_text())
    # diskcache's file mode: the value lives in the file the row names. Point it
    # outside, at metadata that would vouch for a planted cubin if it were read.
    victim = tmp_path / "some" / "outside" / "path"
    victim.parent.mkdir(parents=True)
    victim_bytes = zlib.compress(json.dumps(dict(meta, sha256=_sha(EVIL))).encode())
    victim.write_bytes(victim_bytes)
    (d / "k.cubin").write_bytes(EVIL)
    name = str(victim) if where == "absolute" else os.path.relpath(victim, d / "index")
    db = d / "index" / "cache.db"

    _set_row(db, "k", meta, mode=2, filename=name)  # 2: MODE_BINARY, value in that file
    c = ArtifactCache(d)
    assert c.get("k") is None  # row dropped unread; k.json does not vouch for the planted bytes
    assert victim.read_bytes() == victim_bytes
    # diskcache also deletes the file of a row it overwrites or deletes.
    idx = c.index()
    idx.set("k", meta)
    _set_row(db, "k", meta, mode=2, filename=name)
    idx.set("k", meta)
    _set_row(db, "k", meta, mode=2, filename=name)
    idx.delete("k")
    assert victim.read_bytes() == victim_bytes


# ---- a broken sqlite index is rebuilt, not fatal ---------------------------------


def _populate(d: Path, n: int = 3) -> list[str]:
    c = ArtifactCache(d)
    keys = [f"key{i}" for i in range(n)]
    for k in keys:
        c.put(k, CUBIN + k.encode(), {"arch": "sm_90"})
    c.close()
    return keys


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_index_is_rebuilt_from_json(tmp_path: Path, damage: str) -> None:
    d = tmp_path / "k"
    keys = _populate(d, 40)
    db = d / "index" / "cache.db"
    data = db.read_bytes()
    db.write_bytes(os.urandom(8192) if damage == "garbage" else data[: len(data) // 2])
    c = ArtifactCache(d)
    for k in keys:
        assert c.get(k).cubin == CUBIN + k.encode()
    assert sorted(c.index().keys()) == sorted(keys)  # refilled from the .json files
    with sqlite3.connect(db) as con:
        assert con.execute("PRAGMA quick_check").fetchone() == ("ok",)
    assert not [p for p in d.iterdir() if "corrupt" in p.name]  # the broken copy is gone
    assert c.get_or_build("new", _build_real).cubin == CUBIN


def _open_and_read(directory: str, keys: list[str], barrier, out) -> None:
    barrier.wait()
    c = ArtifactCache(Path(directory))
    out.put(sorted(k for k in keys if c.get(k) is not None))


def test_processes_racing_to_rebuild_the_index(tmp_path: Path) -> None:
    d = tmp_path / "k"
    keys = _populate(d, 10)
    (d / "index" / "cache.db").write_bytes(b"not a database" * 100)
    results = race(_open_and_read, (str(d), keys), 3, timeout=120)
    assert results == [sorted(keys)] * 3


def test_an_index_moved_aside_while_opening_is_opened_again(tmp_path: Path, monkeypatch) -> None:
    """Another process renames the index aside to rebuild it between this one's directory check and its
    connect, so sqlite cannot open the file: the index waits on the rebuild lock and opens it again, with no
    error (the race above met it once in CI: "unable to open database file")."""
    d = tmp_path / "k"
    keys = _populate(d, 3)
    real, calls = Index._open, []

    def moved_once(self):
        calls.append(1)
        if len(calls) == 1:
            e = sqlite3.OperationalError("unable to open database file")
            e.sqlite_errorcode = 14  # SQLITE_CANTOPEN
            raise e
        return real(self)
    monkeypatch.setattr(Index, "_open", moved_once)
    c = ArtifactCache(d)
    assert all(c.get(k) is not None for k in keys) and len(calls) == 2


def test_tampered_row_that_is_not_json_is_dropped(tmp_path: Path) -> None:
    d = tmp_path / "k"
    ArtifactCache(d).put("k", CUBIN)
    with sqlite3.connect(d / "index" / "cache.db") as con:
        con.execute("UPDATE Cache SET value = ?", (b"\x00 not zlib",))
    c = ArtifactCache(d)
    assert c.get("k").cubin == CUBIN  # served from k.json, row rewritten
    assert Index(d / "index").get("k")["sha256"] == _sha(CUBIN)


# ---- temp files of killed writers ---------------------------------------------------


def _tmp(d: Path, name: str, age_s: float) -> Path:
    p = d / name
    p.write_bytes(b"half a cubin")
    t = time.time() - age_s
    os.utime(p, (t, t))
    return p


_HOLD_LOCK = """
import sys, time, filelock
with filelock.FileLock(sys.argv[1]):
    print("locked", flush=True)
    time.sleep(60)
"""


def test_stale_tmp_files_are_removed(tmp_path: Path) -> None:
    d = tmp_path / "k"
    ArtifactCache(d)
    stale = _tmp(d, ".dead.cubin.ab12cd34.tmp", 3600)
    stale_json = _tmp(d, ".dead.json.zz_99xyz.tmp", 3600)
    fresh = _tmp(d, ".busy.cubin.ab12cd34.tmp", 5)  # a writer may be mid-write
    held = _tmp(d, ".slow.cubin.qq12cd34.tmp", 3600)  # old, but its writer still holds the key
    not_ours = [_tmp(d, name, 3600) for name in ("notes.tmp", ".index.tmp.db", ".x.tmp")]
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_LOCK, str(d / "slow.lock")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        ArtifactCache(d).put("other", CUBIN)  # the first write sweeps
    finally:
        holder.kill()
        holder.wait()
    assert not stale.exists() and not stale_json.exists()
    assert fresh.exists() and held.exists()
    assert all(p.exists() for p in not_ours)


# ---- several processes ------------------------------------------------------------------


_BUILD = """
import sys
from torch_cubridge import cache
art = cache.get_or_build("shared", lambda: (b"\\x7fELF built in process one", {"arch": "sm_90"}))
print(art.meta["sha256"])
"""

_READ = """
from torch_cubridge import cache
def fail():
    raise SystemExit("process two had to build")
art = cache.get_or_build("shared", fail)
print(art.meta["sha256"], art.cubin.decode(errors="replace"))
"""


def test_second_process_reads_what_the_first_built(tmp_path: Path) -> None:
    env = _subprocess_env(CUBRIDGE_CACHE_DIR=str(tmp_path / "shared-root"))
    first = subprocess.run([sys.executable, "-c", _BUILD], env=env, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    sha = first.stdout.strip()
    assert sha == _sha(b"\x7fELF built in process one")
    for readonly in ("0", "1"):
        env["CUBRIDGE_READONLY"] = readonly
        second = subprocess.run([sys.executable, "-c", _READ], env=env, capture_output=True, text=True)
        assert second.returncode == 0, second.stderr
        assert second.stdout.split(maxsplit=1) == [sha, "\x7fELF built in process one\n"]


def test_a_directory_moved_aside_meanwhile_is_made_again(tmp_path: Path, monkeypatch) -> None:
    """Another process may move a corrupt index aside between our check that it exists and our look at
    it (seen in CI: FileNotFoundError out of ArtifactCache.get); the directory is made again."""
    from torch_cubridge.cache import safedir
    d = tmp_path / "index"
    safedir.make_private_dir(d)
    real = safedir._tighten_if_empty
    moved = []

    def vanish_once(p):
        if not moved:
            moved.append(p)
            os.rename(p, tmp_path / ".index.corrupt-1")  # what Index._rebuild does
        return real(p)
    monkeypatch.setattr(safedir, "_tighten_if_empty", vanish_once)
    assert safedir.make_private_dir(d) == safedir.resolve(d) and d.is_dir() and moved
