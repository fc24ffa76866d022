"""`cubridge cache ...` and `--version`, in real processes where the process boundary matters.

Entries are made with the store's own put and fake cubin bytes (as tests/cache/test_cache.py does).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from torch_cubridge import __version__, cli
from torch_cubridge.cache import ArtifactCache
from torch_cubridge.cache.bundle import MANIFEST

REPO = Path(__file__).resolve().parents[2]
ENTRIES = {
    "fwd-" + "a" * 40: (b"\x7fELF fake cubin one", {"arch": "sm_90", "kernel": "attn_fwd_a", "toolchain": "t"}),
    "fwd-" + "b" * 40: (b"\x7fELF fake cubin two", {"arch": "sm_80", "kernel": "attn_fwd_b", "toolchain": "t"}),
    "prog-" + "c" * 40: (b'{"program": "{}"}', {"kind": "prog"}),
}
# Put by the store itself; an import re-stamps them, so they are not part of an entry's identity.
STAMPED = ("created", "cubridge_version")


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("CUBRIDGE_READONLY", raising=False)
    monkeypatch.setenv("CUBRIDGE_CACHE_DIR", str(tmp_path / "root"))


def _kernels(root: Path) -> Path:
    return root / "kernels"


def _fill(root: Path) -> ArtifactCache:
    cache = ArtifactCache(_kernels(root), readonly=False)
    for key, (cubin, meta) in ENTRIES.items():
        cache.put(key, cubin, meta)
    return cache


def _run(*args: str, root: Path, readonly: bool = False) -> subprocess.CompletedProcess:
    env = dict(os.environ, CUBRIDGE_CACHE_DIR=str(root))
    env.pop("CUBRIDGE_READONLY", None)
    if readonly:
        env["CUBRIDGE_READONLY"] = "1"
    return subprocess.run([sys.executable, "-m", "torch_cubridge", *args], capture_output=True,
                          text=True, cwd=REPO, env=env, timeout=120)


def _main(*args: str) -> int:
    return cli.main(list(args))


def _snapshot(root: Path) -> dict[str, tuple[bytes, dict]]:
    """key -> (cubin, metadata without the store's stamps), as a fresh store serves them."""
    cache = ArtifactCache(_kernels(root), readonly=True)
    out = {}
    for key in cache.keys():
        art = cache.get(key)
        assert art is not None, key
        out[key] = (art.cubin, {k: v for k, v in art.meta.items() if k not in STAMPED})
    return out


def _files(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


# ---- version and entry points -------------------------------------------------


def test_version_from_python_m() -> None:
    r = _run("--version", root=Path("/nonexistent-unused"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"cubridge (torch_cubridge) {__version__}"


def test_version_from_console_script() -> None:
    exe = shutil.which("cubridge") or str(Path(sys.executable).parent / "cubridge")
    if not Path(exe).exists():
        pytest.skip("the cubridge console script is not installed")
    r = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and __version__ in r.stdout


# ---- list and verify ------------------------------------------------------------


def test_list_shows_every_entry(tmp_path: Path) -> None:
    _fill(tmp_path / "root")
    r = _run("cache", "list", root=tmp_path / "root")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert [ln.split()[0] for ln in lines] == sorted(ENTRIES)
    a = lines[0].split()
    assert a[1:4] == ["sm_90", str(len(ENTRIES["fwd-" + "a" * 40][0])), "attn_fwd_a"]
    assert "Z" in lines[0]  # the build time, UTC
    assert "[prog]" in lines[2]  # a record that is not a kernel shows its kind
    assert "3 entries" in r.stderr


def test_verify_detects_flipped_byte_and_evicts(tmp_path: Path) -> None:
    root = tmp_path / "root"
    _fill(root)
    assert _run("cache", "verify", root=root).returncode == 0
    bad = "fwd-" + "a" * 40
    cubin = _kernels(root) / f"{bad}.cubin"
    data = bytearray(cubin.read_bytes())
    data[5] ^= 0x01
    cubin.write_bytes(bytes(data))
    r = _run("cache", "verify", root=root)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"BAD {bad}: cubin sha256" in r.stdout and "2 ok, 1 bad" in r.stdout
    assert sorted(_snapshot(root)) == sorted(k for k in ENTRIES if k != bad)
    assert not cubin.exists()
    assert _run("cache", "verify", root=root).returncode == 0  # evicted: clean again


def test_verify_read_only_reports_but_keeps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "root"
    _fill(root)
    bad = "fwd-" + "b" * 40
    (_kernels(root) / f"{bad}.json").write_text("{not json")
    monkeypatch.setenv("CUBRIDGE_READONLY", "1")
    assert _main("cache", "verify") == 1
    assert (_kernels(root) / f"{bad}.json").exists()


# ---- export and import ------------------------------------------------------------


def test_export_then_import_reproduces_entries(tmp_path: Path) -> None:
    _fill(tmp_path / "root")
    bundle = tmp_path / "bundle"
    r = _run("cache", "export", str(bundle), root=tmp_path / "root")
    assert r.returncode == 0, r.stderr
    assert "exporting 1/3" in r.stderr  # the progress line
    manifest = json.loads((bundle / MANIFEST).read_text())
    assert sorted(manifest["files"]) == sorted(f"{k}.{e}" for k in ENTRIES for e in ("cubin", "json"))
    sha = r.stdout.split("manifest sha256: ")[1].split()[0]

    r = _run("cache", "import", str(bundle), "--manifest-sha256", sha, root=tmp_path / "fresh")
    assert r.returncode == 0, r.stderr
    assert "imported 3 entries" in r.stdout
    imported = _snapshot(tmp_path / "fresh")
    for _, meta in imported.values():  # each entry names the bundle it came in (a verdict says so)
        assert meta.pop("bundle") == sha
    assert imported == _snapshot(tmp_path / "root")
    # Through the store's put: the index knows every entry.
    fresh = ArtifactCache(_kernels(tmp_path / "fresh"), readonly=False)
    assert sorted(fresh.index().keys()) == sorted(ENTRIES)
    # And a read-only process serves them (the deployment mode).
    r = _run("cache", "verify", root=tmp_path / "fresh", readonly=True)
    assert r.returncode == 0 and "3 ok, 0 bad" in r.stdout, r.stdout + r.stderr
    # A second import finds them all present and rewrites none.
    r = _run("cache", "import", str(bundle), root=tmp_path / "fresh")
    assert r.returncode == 0 and "imported 0 entries" in r.stdout and "3 already present" in r.stdout


def test_export_refuses_a_bad_entry_and_writes_nothing(tmp_path: Path) -> None:
    root = tmp_path / "root"
    _fill(root)
    cubin = _kernels(root) / ("fwd-" + "a" * 40 + ".cubin")
    cubin.write_bytes(cubin.read_bytes() + b"!")
    assert _main("cache", "export", str(tmp_path / "bundle")) == 2
    assert not (tmp_path / "bundle").exists()


def test_export_refuses_a_non_empty_dir(tmp_path: Path) -> None:
    _fill(tmp_path / "root")
    (tmp_path / "bundle").mkdir()
    (tmp_path / "bundle" / "other").write_text("x")
    assert _main("cache", "export", str(tmp_path / "bundle")) == 2
    assert _files(tmp_path / "bundle") == ["other"]


def _exported(tmp_path: Path) -> Path:
    _fill(tmp_path / "src")
    bundle = tmp_path / "bundle"
    from torch_cubridge.cache.bundle import export_bundle
    export_bundle(ArtifactCache(_kernels(tmp_path / "src"), readonly=True), bundle)
    return bundle


def _flip_cubin(b: Path) -> None:
    p = b / ("fwd-" + "b" * 40 + ".cubin")
    data = bytearray(p.read_bytes())
    data[3] ^= 0x40
    p.write_bytes(bytes(data))


def _flip_json(b: Path) -> None:
    p = b / ("fwd-" + "b" * 40 + ".json")
    p.write_text(p.read_text().replace("sm_80", "sm_90"))


def _extra_file(b: Path) -> None:
    (b / "notes.txt").write_text("hello")


def _extra_entry(b: Path) -> None:  # a whole planted entry, sound in itself, but unlisted
    for ext in ("cubin", "json"):
        shutil.copy(b / f"fwd-{'a' * 40}.{ext}", b / f"fwd-{'d' * 40}.{ext}")


def _missing_file(b: Path) -> None:
    (b / ("prog-" + "c" * 40 + ".json")).unlink()


def _symlink(b: Path) -> None:
    p = b / ("fwd-" + "a" * 40 + ".cubin")
    target = b.parent / "elsewhere"
    shutil.move(p, target)
    p.symlink_to(target)


def _rehashed_cubin(b: Path) -> None:
    """The cubin changed and the manifest updated to match: the entry's own sha256 still catches it."""
    name = "fwd-" + "b" * 40 + ".cubin"
    (b / name).write_bytes(b"\x7fELF planted")
    m = json.loads((b / MANIFEST).read_text())
    from torch_cubridge.cache.store import sha256_hex
    m["files"][name] = sha256_hex(b"\x7fELF planted")
    (b / MANIFEST).write_text(json.dumps(m))


def _escaping_name(b: Path) -> None:
    m = json.loads((b / MANIFEST).read_text())
    m["files"]["../evil.cubin"] = m["files"].pop("fwd-" + "a" * 40 + ".cubin")
    (b / MANIFEST).write_text(json.dumps(m))


TAMPER = {
    "changed cubin byte": (_flip_cubin, "sha256 does not match the manifest"),
    "changed metadata byte": (_flip_json, "sha256 does not match the manifest"),
    "extra file": (_extra_file, "not listed in the manifest"),
    "extra entry": (_extra_entry, "not listed in the manifest"),
    "missing file": (_missing_file, "lacks 1 file"),
    "symlink": (_symlink, "not a regular file"),
    "cubin and manifest rewritten": (_rehashed_cubin, "cubin sha256 does not match its metadata"),
    "name outside the bundle": (_escaping_name, "not a cache entry file"),
}


@pytest.mark.parametrize("how", sorted(TAMPER))
def test_import_refuses_tampered_bundle_and_writes_nothing(
        how: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    bundle = _exported(tmp_path)
    tamper, message = TAMPER[how]
    tamper(bundle)
    assert _main("cache", "import", str(bundle)) == 2
    err = capsys.readouterr().err
    assert "cubridge: error:" in err and message in err, err
    assert _files(_kernels(tmp_path / "root")) == []


def test_import_refuses_tampered_bundle_in_a_real_process(tmp_path: Path) -> None:
    bundle = _exported(tmp_path)
    _flip_cubin(bundle)
    r = _run("cache", "import", str(bundle), root=tmp_path / "fresh")
    assert r.returncode == 2 and "sha256 does not match the manifest" in r.stderr
    assert "Traceback" not in r.stderr
    assert _files(_kernels(tmp_path / "fresh")) == []


def test_import_warns_about_another_version(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    bundle = _exported(tmp_path)
    m = json.loads((bundle / MANIFEST).read_text())
    m["cubridge_version"] = "0.0.1"
    (bundle / MANIFEST).write_text(json.dumps(m))
    assert _main("cache", "import", str(bundle)) == 0
    assert "warning: bundle made by torch_cubridge 0.0.1" in capsys.readouterr().err


def test_import_refuses_wrong_manifest_sha256(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    bundle = _exported(tmp_path)
    assert _main("cache", "import", str(bundle), "--manifest-sha256", "0" * 64) == 2
    assert "expected " + "0" * 64 in capsys.readouterr().err
    assert _files(_kernels(tmp_path / "root")) == []


# ---- clear and read-only ------------------------------------------------------------


def test_clear_needs_yes(tmp_path: Path) -> None:
    root = tmp_path / "root"
    _fill(root)
    r = _run("cache", "clear", root=root)
    assert r.returncode == 2 and "--yes" in r.stderr
    assert sorted(_snapshot(root)) == sorted(ENTRIES)
    r = _run("cache", "clear", "--yes", root=root)
    assert r.returncode == 0 and "removed 3 entries" in r.stdout
    assert _snapshot(root) == {}
    assert not [n for n in _files(_kernels(root)) if n.endswith((".cubin", ".json"))]


@pytest.mark.parametrize("cmd", ["clear", "import"])
def test_read_only_refuses_clear_and_import(cmd: str, tmp_path: Path) -> None:
    root = tmp_path / "root"
    _fill(root)
    before = {n: (_kernels(root) / n).read_bytes() for n in _files(_kernels(root)) if "." in n}
    args = ["--yes"] if cmd == "clear" else [str(_exported(tmp_path))]
    r = _run("cache", cmd, *args, root=root, readonly=True)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "CUBRIDGE_READONLY=1" in r.stderr and f"cache {cmd}" in r.stderr
    after = {n: (_kernels(root) / n).read_bytes() for n in _files(_kernels(root)) if "." in n}
    assert after == before


def test_read_only_still_lists_and_exports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fill(tmp_path / "root")
    monkeypatch.setenv("CUBRIDGE_READONLY", "1")
    assert _main("cache", "list") == 0
    assert _main("cache", "export", str(tmp_path / "bundle")) == 0
    assert len(_files(tmp_path / "bundle")) == 2 * len(ENTRIES) + 1


needs_cc = pytest.mark.skipif(not any(shutil.which(c) for c in ("cc", "gcc", "clang")), reason="no C compiler")


@needs_cc
def test_bundle_carries_the_host_module_to_a_read_only_server(tmp_path: Path) -> None:
    """`export --host-module` carries the host fast path's C module; `import` installs it where this Python's
    is looked for, and a read-only process (which never compiles) loads it from there. A module whose bytes
    do not match the manifest is refused with the rest of the bundle."""
    _fill(tmp_path / "root")
    bundle = tmp_path / "bundle"
    r = _run("cache", "export", str(bundle), "--host-module", root=tmp_path / "root")
    assert r.returncode == 0, r.stderr
    manifest = json.loads((bundle / MANIFEST).read_text())
    (name,) = manifest["host_modules"]
    assert (bundle / name).is_file() and "and the host module" in r.stdout

    probe = ("from torch_cubridge.ops import hotpath; from torch_cubridge.ops.host_module import module_path; "
             "m = hotpath.wait(120); print('loaded' if m is not None else 'none', module_path().is_file(), hotpath.failure)")
    fresh = tmp_path / "fresh"
    env = dict(os.environ, CUBRIDGE_CACHE_DIR=str(fresh), CUBRIDGE_READONLY="1", CC="/nonexistent/cc")
    before = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert before.stdout.startswith("none False"), before.stdout + before.stderr  # read-only: never built there

    r = _run("cache", "import", str(bundle), root=fresh)
    assert r.returncode == 0 and f"host module {name}: installed" in r.stderr, r.stderr
    after = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert after.stdout.startswith("loaded True"), after.stdout + after.stderr

    data = bytearray((bundle / name).read_bytes())
    data[len(data) // 2] ^= 1
    (bundle / name).write_bytes(bytes(data))
    r = _run("cache", "import", str(bundle), root=tmp_path / "third")
    assert r.returncode == 2 and "sha256 does not match the manifest" in r.stderr
    assert not (tmp_path / "third" / "host").exists() or not any((tmp_path / "third" / "host").iterdir())


def test_a_host_module_of_another_python_is_left(tmp_path: Path) -> None:
    """A bundle's host module named for another interpreter or source is checked, then not installed."""
    _fill(tmp_path / "root")
    other = tmp_path / "_hotpath-cpython-39-0000000000000000.so"
    other.write_bytes(b"\x7fELF not this python's")
    from torch_cubridge.cache.bundle import export_bundle
    export_bundle(ArtifactCache(_kernels(tmp_path / "root"), readonly=False), tmp_path / "bundle", host_modules=(other,))
    r = _run("cache", "import", str(tmp_path / "bundle"), root=tmp_path / "fresh")
    assert r.returncode == 0 and "not used here" in r.stderr, r.stderr
    assert not (tmp_path / "fresh" / "host" / other.name).exists()
