"""`cubridge explain path/to/file.py:function`: graph, CuIR program, verification."""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path


def _load(target: str):
    path, _, name = target.rpartition(":")
    if not path or not name:
        raise SystemExit("expected path/to/file.py:function")
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot import {path}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    fn = getattr(mod, name, None)
    if fn is None:
        raise SystemExit(f"{path} has no function {name}")
    return mod, fn, name


def _example(mod, name: str, shape: str):
    import torch
    maker = getattr(mod, f"{name}_example", None)
    if maker is not None:
        ex = maker()
        return (ex, {}) if isinstance(ex, tuple) else (ex.get("args", ()), ex.get("kwargs", {}))
    B, H, S, D = (int(x) for x in shape.split(","))
    return tuple(torch.randn(B, H, S, D) for _ in range(3)), {}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="cubridge", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("explain", help="print the captured graph, the CuIR program and the verification")
    ex.add_argument("target", help="path/to/file.py:function (examples from <function>_example() if defined)")
    ex.add_argument("--shape", default="2,4,128,64", help="B,H,S,D for q/k/v when no example is defined")
    ex.add_argument("--json", action="store_true", help="print the program as JSON instead")
    args = ap.parse_args(argv)
    import torch_cubridge as tc
    mod, fn, name = _load(args.target)
    a, kw = _example(mod, name, args.shape)
    if args.json:
        print(tc.transfer(fn, *a, **kw).to_json())
    else:
        print(tc.explain(fn, *a, **kw))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
