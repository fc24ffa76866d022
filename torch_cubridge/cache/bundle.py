"""Bundles: a cache's entries copied into a plain directory, with a sha256 manifest.

A bundle DIR holds <key>.cubin and <key>.json for every entry (the files exactly as the
cache has them) and manifest.json listing each file's sha256. Export builds one from a
cache; import checks all of it before writing anything, then puts each entry through the
store's put, so the target's index, locks and directory rules apply as for a build.

A bundle may also carry host modules (the host fast path's C module, built for one Python:
`cubridge cache export --host-module`), listed in the manifest's own table, so that a
read-only server without a compiler launches from C too. They are native code the
importing process loads: the same manifest check covers them.

The manifest catches damaged, swapped, missing and extra files. It does not say who made
the bundle: whoever can write the bundle can rewrite the manifest too. To carry trust,
compare the manifest's own sha256 (printed by export) when importing.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..version import __version__
from .errors import CacheError
from .store import ArtifactCache, check_key, entry_problem, file_name, sha256_hex

MANIFEST = "manifest.json"
HOST_TABLE = "host_modules"  # {file name: sha256} of host modules, apart from the entries' files
FORMAT = "torch_cubridge.bundle"
FORMAT_VERSION = 1
_EXTS = ("cubin", "json")

Progress = Callable[[str], None]


class BundleError(CacheError):
    """A bundle is incomplete, damaged or does not match its manifest; nothing was written."""


@dataclass(frozen=True)
class Entry:
    key: str
    cubin: bytes
    meta_bytes: bytes
    meta: dict[str, Any]


def _quiet(_: str) -> None:
    pass


def _parse_meta(raw: bytes | None) -> Any:
    try:
        return None if raw is None else json.loads(raw)
    except ValueError:
        return None


def _entry(key: str, cubin: bytes | None, raw: bytes | None) -> Entry:
    """The entry if it would be served under `key`, else BundleError naming the problem."""
    meta = _parse_meta(raw)
    problem = entry_problem(key, cubin, meta)
    if problem is not None:
        raise BundleError(f"entry {key}: {problem}")
    return Entry(key, cubin, raw, meta)  # type: ignore[arg-type]  # checked by entry_problem


def manifest_sha256(directory: Path) -> str:
    """The sha256 of a bundle's manifest.json: compare it out of band to trust a bundle."""
    return sha256_hex((Path(directory) / MANIFEST).read_bytes())


# ---- export ------------------------------------------------------------------


def _prepare_out_dir(out: Path) -> None:
    # An empty or new directory only: import refuses any file the manifest does not list.
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise BundleError(f"{out} exists and is not an empty directory; export into a new one")
    out.mkdir(parents=True, exist_ok=True)


def _write_new(path: Path, data: bytes) -> None:
    # O_EXCL: never write through a file or symlink that appeared in the directory meanwhile.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _host_name_ok(name: str) -> bool:
    """A host module's file name: a plain name in the bundle's directory, no entry's, not the manifest."""
    return (name == Path(name).name and not name.startswith(".") and name != MANIFEST
            and name.rpartition(".")[2] not in _EXTS)


def export_bundle(cache: ArtifactCache, out: Path, progress: Progress = _quiet,
                  host_modules: tuple[Path, ...] = ()) -> list[str]:
    """Copy every sound entry of `cache` (and the given host module files) into the new directory
    `out`; returns the keys.

    All or nothing: an unsound entry raises BundleError before a file is written
    (run `cubridge cache verify` to evict it).
    """
    out = Path(out)
    keys = cache.keys()
    if MANIFEST in {file_name(k, "json") for k in keys}:
        raise BundleError(f"an entry named {MANIFEST} would overwrite the bundle's manifest")
    host = {Path(h).name: Path(h).read_bytes() for h in host_modules}
    for name in host:
        if not _host_name_ok(name):
            raise BundleError(f"{name!r} cannot be a host module's name in a bundle")
    progress(f"checking {len(keys)} entries in {cache.dir}")
    entries = [_entry(k, *cache.read_files(k)) for k in keys]
    _prepare_out_dir(out)
    files: dict[str, str] = {}
    for i, e in enumerate(entries, 1):
        progress(f"exporting {i}/{len(entries)}: {e.key}")
        for ext, data in zip(_EXTS, (e.cubin, e.meta_bytes)):
            _write_new(out / file_name(e.key, ext), data)
            files[file_name(e.key, ext)] = sha256_hex(data)
    host_files = {}
    for name, data in host.items():
        progress(f"exporting host module {name}")
        _write_new(out / name, data)
        host_files[name] = sha256_hex(data)
    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION,
                "cubridge_version": __version__, "files": files}
    if host_files:
        manifest[HOST_TABLE] = host_files
    _write_new(out / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
    return keys


# ---- import ------------------------------------------------------------------


def _read_manifest(src: Path, expect_sha256: str | None, progress: Progress) -> tuple[dict[str, str], dict[str, str]]:
    """The manifest's {file name: sha256} of the entries and of the host modules, checked for shape
    (and against `expect_sha256`)."""
    try:
        raw = (src / MANIFEST).read_bytes()
    except FileNotFoundError:
        raise BundleError(f"{src} has no {MANIFEST}: not a bundle made by `cubridge cache export`") from None
    if expect_sha256 is not None and sha256_hex(raw) != expect_sha256.lower():
        raise BundleError(f"{src / MANIFEST} has sha256 {sha256_hex(raw)}, expected {expect_sha256}")
    manifest = _parse_meta(raw)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise BundleError(f"{src / MANIFEST} is not a {FORMAT} manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise BundleError(f"bundle format version {manifest.get('format_version')!r}; "
                          f"this torch_cubridge reads version {FORMAT_VERSION}")
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        raise BundleError(f"{src / MANIFEST} has no valid 'files' table")
    host = manifest.get(HOST_TABLE, {})
    if not isinstance(host, dict) or not all(isinstance(v, str) and _host_name_ok(k) for k, v in host.items()) \
            or set(host) & set(files):
        raise BundleError(f"{src / MANIFEST} has no valid '{HOST_TABLE}' table")
    made_by = manifest.get("cubridge_version")
    if made_by != __version__:  # kernel keys carry the version: such entries are never looked up
        progress(f"warning: bundle made by torch_cubridge {made_by}, this is {__version__}; "
                 "its kernels will not be used by this version")
    return files, host


def _keys_of(files: dict[str, str]) -> list[str]:
    """Entry keys the manifest names; each needs exactly its .cubin and .json, nothing else."""
    keys = set()
    for name in files:
        key, _, ext = name.rpartition(".")
        try:
            check_key(key)  # also refuses any path separator: names never leave the bundle dir
        except CacheError:
            raise BundleError(f"manifest lists {name!r}, not a cache entry file") from None
        if ext not in _EXTS or name == MANIFEST:
            raise BundleError(f"manifest lists {name!r}, not a cache entry file")
        keys.add(key)
    for key in keys:
        for ext in _EXTS:
            if file_name(key, ext) not in files:
                raise BundleError(f"manifest lists entry {key} without its {file_name(key, ext)}")
    return sorted(keys)


def _check_listing(src: Path, files: dict[str, str]) -> None:
    """Exactly the listed files, each a regular file: no extras, no links, nothing missing."""
    present = set()
    with os.scandir(src) as it:
        for d in it:
            if d.name == MANIFEST:
                continue
            if d.name not in files:
                raise BundleError(f"{src / d.name} is not listed in the manifest; refusing the bundle")
            if not stat.S_ISREG(d.stat(follow_symlinks=False).st_mode):
                raise BundleError(f"{src / d.name} is not a regular file; refusing the bundle")
            present.add(d.name)
    missing = sorted(set(files) - present)
    if missing:
        raise BundleError(f"{src} lacks {len(missing)} file(s) its manifest lists, e.g. {missing[0]}")


def _read_checked(src: Path, name: str, want: str) -> bytes:
    data = (src / name).read_bytes()
    if sha256_hex(data) != want:
        raise BundleError(f"{src / name}: sha256 does not match the manifest; refusing the bundle")
    return data


def read_bundle_all(src: Path, expect_sha256: str | None = None,
                    progress: Progress = _quiet) -> tuple[list[Entry], dict[str, bytes]]:
    """Every entry of the bundle at `src` and its host modules by file name, all checked; BundleError
    on any problem."""
    src = Path(src)
    if not src.is_dir():
        raise BundleError(f"{src} is not a directory")
    files, host = _read_manifest(src, expect_sha256, progress)
    keys = _keys_of(files)
    _check_listing(src, {**files, **host})
    progress(f"checking {len(keys)} entries in {src}")
    # The bytes checked here are the bytes imported: nothing is re-read after the check.
    entries = [_entry(k, *(_read_checked(src, file_name(k, ext), files[file_name(k, ext)])
                           for ext in _EXTS)) for k in keys]
    return entries, {name: _read_checked(src, name, want) for name, want in host.items()}


def read_bundle(src: Path, expect_sha256: str | None = None, progress: Progress = _quiet) -> list[Entry]:
    """Every entry of the bundle at `src`, all checked; BundleError on any problem."""
    return read_bundle_all(src, expect_sha256, progress)[0]


def import_bundle(cache: ArtifactCache, src: Path, expect_sha256: str | None = None,
                  progress: Progress = _quiet,
                  install_host: Callable[[str, bytes], bool] | None = None) -> tuple[list[str], list[str]]:
    """Check the whole bundle at `src`, then put each entry into `cache`, and hand each host module to
    `install_host(name, bytes)` (which returns whether it took it; without one they are left).

    Returns (keys written, keys already present with the same bytes). Nothing is
    written unless every file matches the manifest and every entry is sound.
    """
    entries, host = read_bundle_all(src, expect_sha256, progress)
    manifest = manifest_sha256(src)
    written, present = [], []
    for i, e in enumerate(entries, 1):
        progress(f"importing {i}/{len(entries)}: {e.key}")
        have = cache.get(e.key)
        if have is not None and have.meta.get("sha256") == e.meta["sha256"]:
            present.append(e.key)
            continue
        # the store re-stamps created/version, re-hashes; "bundle" lets a verdict say where it came from
        cache.put(e.key, e.cubin, dict(e.meta, bundle=manifest))
        written.append(e.key)
    for name, data in host.items():
        took = install_host is not None and install_host(name, data)
        progress(f"host module {name}: " + ("installed" if took else
                                            "not used here (built for another Python or torch_cubridge)"))
    return written, present
