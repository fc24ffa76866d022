"""What the cubridge command reads, checked before any work: the target file and function, --shape,
--arch, --model and the example call; and any failure said on one line, its problem and its fix."""
from __future__ import annotations

import importlib.util
import inspect
import re
import sys
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any, Callable


class UsageError(Exception):
    """A mistake in the command or its inputs: main prints it as one line (the problem and the fix), exit 2."""


def load(target: str) -> tuple[ModuleType, Callable, str]:
    """(module, function, its name) of path/to/file.py:function."""
    path, _, name = target.rpartition(":")
    if not path or not name:
        raise UsageError(f"{target!r}: expected path/to/file.py:function, e.g. tests/support/zoo.py:full_matmul")
    if not Path(path).is_file():
        raise UsageError(f"{path}: no such file; the target is path/to/file.py:function")
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    if spec is None or spec.loader is None:
        raise UsageError(f"cannot import {path}: not a Python file; the target is path/to/file.py:function")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    try:
        spec.loader.exec_module(mod)
    except Exception as e:  # the user's file: its own error, where it happened
        raise UsageError(f"importing {path} raised {raised(e, path)}; fix the file") from e
    fn = getattr(mod, name, None)
    if fn is None:
        found = sorted(n for n, v in vars(mod).items() if inspect.isfunction(v) and v.__module__ == mod.__name__)
        raise UsageError(f"{path} has no function {name!r}" + (f"; it defines {', '.join(found)}" if found else ""))
    if not callable(fn):
        raise UsageError(f"{path}:{name} is {type(fn).__name__} {_short(repr(fn))}, not a function; "
                         "name the spec function")
    return mod, fn, name


def _short(text: str, n: int = 60) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= n else line[: n - 3] + "..."


def raised(e: BaseException, path: str = "") -> str:
    """`Type: message (file:line in function)`, at the innermost frame in `path` (else the innermost not in
    torch or this package): where the user's code raised it."""
    frames = traceback.extract_tb(e.__traceback__)
    mine = [f for f in frames if path and Path(f.filename).resolve() == Path(path).resolve()]
    ours = [f for f in frames if not _library_file(f.filename)]
    at = (mine or ours or frames or [None])[-1]
    where = f" ({Path(at.filename).name}:{at.lineno} in {at.name})" if at is not None else ""
    return f"{type(e).__name__}: {_short(str(e), 160)}{where}"


def _library_file(filename: str) -> bool:
    import torch
    roots = (Path(torch.__file__).parent, Path(__file__).parent)
    return any(Path(filename).is_relative_to(r) for r in roots) or filename.startswith("<")


def shape(text: str, names: str, sample: str) -> tuple[int, ...]:
    """--shape's sizes: as many positive whole numbers as `names` (e.g. "B,H,S,D") has."""
    want = names.split(",")
    parts = [x.strip() for x in text.split(",")]
    fix = f"expected {len(want)} sizes {names}, e.g. --shape {sample}"
    if len(parts) != len(want):
        raise UsageError(f"--shape {text}: {len(parts)} size(s) given; {fix}")
    for n, x in zip(want, parts):
        if not x.isdigit():
            raise UsageError(f"--shape {text}: {n}={x!r} is not a whole number; {fix}")
        if int(x) < 1:
            raise UsageError(f"--shape {text}: {n}={x}; every size must be at least 1")
    return tuple(int(x) for x in parts)


def arch(text: str) -> str:
    """--arch, checked for its form (whether the compiler knows it, the build finds out)."""
    from .build.arch import parse_arch
    from .build.errors import BuildError
    try:
        return parse_arch(text).sm
    except BuildError:
        raise UsageError(f"--arch {text}: expected the serving GPU's arch, e.g. sm_80, sm_90a") from None


def example(mod: ModuleType, name: str, text: str) -> tuple[tuple, dict[str, Any]]:
    """The spec's example call: <name>_example()'s, else q, k, v of --shape B,H,S,D."""
    import torch
    maker = getattr(mod, f"{name}_example", None)
    if maker is not None:
        try:
            ex = maker()
        except Exception as e:
            raise UsageError(f"{name}_example() raised {raised(e, mod.__file__)}; fix it") from e
        return (ex, {}) if isinstance(ex, tuple) else (ex.get("args", ()), ex.get("kwargs", {}))
    B, H, S, D = shape(text, "B,H,S,D", "2,4,128,64")
    return tuple(torch.randn(B, H, S, D) for _ in range(3)), {}


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def model_source(model: str) -> str:
    """--model as transformers will read it, checked before any download: a directory holding config.json,
    a config file, or a Hub id `owner/name`; anything else is a mistake named here (no network tried)."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UsageError(f"--model {model}: the directory has no config.json; pass the model's directory "
                             "(or its config.json, or a Hub id owner/name)")
        return str(path)
    if path.is_file():
        return str(path)
    if _HUB_ID.fullmatch(model) and not model.startswith((".", "~")):
        return model
    raise UsageError(f"--model {model}: no such directory or file; pass a directory with config.json, the file "
                     "itself, or a Hub id owner/name")


def error_line(e: Exception) -> str:
    """What went wrong and what to do, on one line."""
    from .build.errors import BuildError
    from .cache import CacheError
    from .errors import UnsupportedSpec
    if isinstance(e, UsageError):
        return f"error: {e}"
    if isinstance(e, UnsupportedSpec):
        return f"refused: {_short(str(e), 400)}"
    if isinstance(e, BuildError):
        log = [ln.strip() for ln in e.log.splitlines() if "fatal" in ln or "error" in ln]
        why = log[0] if log else _short(str(e), 200)
        return f"error: the kernel build failed: {why} (is --arch the serving GPU's: sm_80, sm_90a, ...?)"
    if isinstance(e, (CacheError, OSError)):  # a refusal, a bad bundle, a file: their messages say it
        return f"error: {e}"
    return (f"internal error: {type(e).__name__}: {_short(str(e), 200)} (CUBRIDGE_DEBUG=1 prints the "
            "traceback; please report it)")
