"""cubridge: explain a spec, and manage the kernel cache for deployment.

  cubridge explain path/to/file.py:function   graph, CuIR program, verification
  cubridge build path/to/file.py:function --arch sm_90a --shape B,H,S,D [--kv-heads N] [--queries Q]
                                              verify and build its kernels ahead of time (no GPU needed)
  cubridge build --model CONFIG_DIR --arch sm_90a --shape B,S [--queries Q]
                                              the same for every attention variant of a transformers model
  cubridge build --model CONFIG_DIR --flash-api --arch sm_90a --shape B,S
                                              the flash API's kernels for it (flash path, continuous batching)
  cubridge bench path/to/file.py:function --shape B,H,S,D [--out DIR]
                                              time the spec, its kernel, SDPA and FlexAttention
  cubridge cache list | verify | clear --yes | export DIR | import DIR
  cubridge --version                          (also: python -m torch_cubridge ...)

The cache is the one torch_cubridge uses: CUBRIDGE_CACHE_DIR, read-only under
CUBRIDGE_READONLY=1 (then clear and import refuse).

A command that fails says why on one line of stderr and exits 2 (`cache verify`: 1
when it found bad entries). CUBRIDGE_DEBUG=1 shows the Python traceback instead.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .cli_checks import UsageError, arch, error_line, example, load, model_source, raised, shape
from .version import __version__

# Exit codes: 0 fine, 1 the cache had bad entries (verify), 2 refused or failed.
EXIT_BAD_ENTRIES, EXIT_ERROR = 1, 2


# ---- explain -------------------------------------------------------------------


def _explain(args: argparse.Namespace) -> int:
    from .api import explain_call
    from .capture.checks import check_call
    from .capture.trace import bind_example
    from .compile import CompiledAttention
    from .errors import UnsupportedSpec
    mod, fn, name = load(args.target)
    a, kw = example(mod, name, args.shape)
    inputs = f"{name}_example()" if hasattr(mod, f"{name}_example") else f"--shape {args.shape}"
    try:  # the call itself: arguments the spec cannot bind, an empty tensor
        check_call(bind_example(fn.fn if isinstance(fn, CompiledAttention) else fn, a, kw))
    except (TypeError, ValueError) as e:
        raise UsageError(f"the example call ({inputs}) is not one {name} takes: {e}") from e
    ex = explain_call(fn, a, kw)
    if ex.raised is not None:
        raise UsageError(f"the spec raised {raised(ex.raised, mod.__file__)} on its example inputs ({inputs}); "
                         "fix the spec or the inputs")
    if not args.json:
        print(ex.text)
    elif ex.result is None:
        why = str(ex.refusal).splitlines()[0]
        raise UnsupportedSpec(f"{why}; so there is no program to print (the spec itself serves its calls)")
    else:
        print(ex.result.program.to_json())
    return 0


# ---- build ahead of time -------------------------------------------------------------


def _build(args: argparse.Namespace) -> int:
    import torch
    from .pipeline import build_ahead
    _refuse_if_readonly("build")
    if args.model:
        return _build_model(args)
    if not args.target:
        raise UsageError("build needs path/to/file.py:function, or --model CONFIG_DIR")
    arch(args.arch)
    mod, fn, name = load(args.target)
    B, H, S, D = shape(args.shape, "B,H,S,D", "1,16,4096,128")
    dtype = getattr(torch, args.dtype)
    q = torch.randn(B, H, args.queries or S, D, dtype=dtype)
    k, v = (torch.randn(B, args.kv_heads or H, S, D, dtype=dtype) for _ in range(2))
    built = build_ahead(fn, (q, k, v), {}, args.arch, status)
    for b in built:
        how = f"built in {b['seconds']:.2f} s" if b["built"] else "already in the cache"
        print(f"{b['key']}  {b['kernel']}  {args.arch}  {how}  (program {b['program']})")
    return 0


def _build_model(args: argparse.Namespace) -> int:
    import torch
    from .integrations.transformers import build_model_ahead
    B, S = shape(args.shape, "B,S", "1,512")  # with --model: batch and prompt length
    arch(args.arch)
    args.model = model_source(args.model)
    if args.flash_api:
        from .integrations.flash_api import build_model_ahead as build_flash_ahead
        res = build_flash_ahead(args.model, args.arch, B, S, getattr(torch, args.dtype), status)
    else:
        res = build_model_ahead(args.model, args.arch, B, S, args.queries, getattr(torch, args.dtype), status)
    for b in res["built"]:
        how = f"built in {b['seconds']:.2f} s" if b["built"] else "already in the cache"
        where = f"{b['function']}" if args.flash_api else f"layer {b['layer']}"
        print(f"{b['key']}  {b['kernel']}  {args.arch}  {where}  queries {b['queries']}  {how}")
    for r in res["refused"]:
        print(f"cubridge: refused (the spec serves there): {r}", file=sys.stderr)
    return 0 if res["built"] else EXIT_ERROR


def _bench(args: argparse.Namespace) -> int:
    import json
    import torch
    from .benchmark import bench_spec, svg_bars
    mod, fn, name = load(args.target)
    B, H, S, D = shape(args.shape, "B,H,S,D", "4,16,4096,128")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    q = torch.randn(B, H, args.queries or S, D, dtype=dtype, device=dev)
    k, v = (torch.randn(B, args.kv_heads or H, S, D, dtype=dtype, device=dev) for _ in range(2))
    status(f"timing {name} at q {tuple(q.shape)}, k/v {tuple(k.shape)} on {dev}")
    res = bench_spec(fn, q, k, v)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(res, indent=2))
    title = f"{name}: q {tuple(q.shape)} {args.dtype} on {res['device']} (ms per call)"
    (out / "bench.svg").write_text(svg_bars(title, res["ms"]))
    for k_, ms in res["ms"].items():
        print(f"{k_:32s} {ms:10.3f} ms")
    status(f"wrote {out / 'bench.json'} and {out / 'bench.svg'}")
    return 0


# ---- cache ---------------------------------------------------------------------


def status(msg: str) -> None:
    """A plain progress line on stderr (stdout stays the command's output)."""
    print(f"cubridge: {msg}", file=sys.stderr, flush=True)


def _cache():
    from .cache import default_cache
    return default_cache()


def _refuse_if_readonly(command: str) -> None:
    from . import config
    from .cache import CacheReadOnlyError
    if config.is_readonly():
        raise CacheReadOnlyError(f"CUBRIDGE_READONLY=1: `cubridge {command}` writes the cache; "
                                 "unset CUBRIDGE_READONLY to run it")


def _when(meta: dict) -> str:
    created = meta.get("created")
    if not isinstance(created, (int, float)):
        return "-"
    when = time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(created))
    took = meta.get("build_seconds")  # recorded by builds that time themselves
    return f"{when} ({took:.1f} s)" if isinstance(took, (int, float)) else when


def _list_line(key: str, meta: dict | None) -> str:
    if meta is None:
        return f"{key}  (metadata unreadable: run `cubridge cache verify`)"
    arch = meta.get("arch") or "-"
    # Kernels name their entry point; the other records (verdicts, programs) their kind.
    what = meta.get("kernel") or f"[{meta.get('kind', 'record')}]"
    size = meta.get("size", "?")
    return f"{key:<44}  {arch:<8} {size:>9}  {what}  {_when(meta)}"


def _cache_list(args: argparse.Namespace) -> int:
    cache = _cache()
    keys = cache.keys()
    for key in keys:
        print(_list_line(key, cache.meta(key)))
    status(f"{len(keys)} entries in {cache.dir}")
    return 0


def _cache_verify(args: argparse.Namespace) -> int:
    cache = _cache()
    keys = cache.keys()
    status(f"verifying {len(keys)} entries in {cache.dir}")
    bad = 0
    for key in keys:
        # Read-only: report only. Otherwise re-checked and evicted under the key's lock.
        problem = cache.problem(key) if cache.readonly else cache.evict_if_bad(key)
        if problem is not None:
            bad += 1
            fate = "kept (read-only)" if cache.readonly else "evicted"
            print(f"BAD {key}: {problem}; {fate}")
    print(f"{len(keys) - bad} ok, {bad} bad")
    return EXIT_BAD_ENTRIES if bad else 0


def _cache_clear(args: argparse.Namespace) -> int:
    _refuse_if_readonly("cache clear")
    cache = _cache()
    keys = cache.keys()
    if not args.yes:
        status(f"would remove {len(keys)} entries from {cache.dir}; pass --yes to do it")
        return EXIT_ERROR
    for key in keys:
        cache.remove(key)
    print(f"removed {len(keys)} entries from {cache.dir}")
    return 0


def _cache_export(args: argparse.Namespace) -> int:
    from .cache.bundle import export_bundle, manifest_sha256
    host = ()
    if args.host_module:  # this interpreter's module, built here first where it is not built yet
        from .ops.host_module import load_module, module_path
        load_module()
        host = (module_path(),)
    keys = export_bundle(_cache(), Path(args.dir), progress=status, host_modules=host)
    print(f"exported {len(keys)} entries to {args.dir}" + (f" and the host module {host[0].name}" if host else ""))
    print(f"manifest sha256: {manifest_sha256(Path(args.dir))}")
    return 0


def _cache_import(args: argparse.Namespace) -> int:
    _refuse_if_readonly("cache import")
    from .ops.host_module import install_module
    from .cache.bundle import import_bundle
    cache = _cache()
    written, present = import_bundle(cache, Path(args.dir), args.manifest_sha256, progress=status,
                                     install_host=install_module)
    print(f"imported {len(written)} entries into {cache.dir} ({len(present)} already present)")
    return 0


# ---- parser --------------------------------------------------------------------


def _cache_parser(sub) -> None:
    cache = sub.add_parser("cache", help="list, verify, clear, export or import the kernel cache")
    cache.set_defaults(help_for=cache)
    csub = cache.add_subparsers(dest="cache_cmd")
    csub.add_parser("list", help="one line per entry: key, arch, size, kernel, build time"
                    ).set_defaults(run=_cache_list)
    csub.add_parser("verify", help="re-hash every entry, evict bad ones; exit 1 if any was bad"
                    ).set_defaults(run=_cache_verify)
    clear = csub.add_parser("clear", help="remove every entry")
    clear.add_argument("--yes", action="store_true", help="really remove them")
    clear.set_defaults(run=_cache_clear)
    exp = csub.add_parser("export", help="copy every entry into a new DIR with a sha256 manifest")
    exp.add_argument("dir", metavar="DIR")
    exp.add_argument("--host-module", action="store_true",
                     help="also carry the host fast path's C module built for this Python (built first if "
                          "needed), so that a read-only server of the same Python without a compiler uses it")
    exp.set_defaults(run=_cache_export)
    imp = csub.add_parser("import", help="check a bundle DIR against its manifest, then add its entries")
    imp.add_argument("dir", metavar="DIR")
    imp.add_argument("--manifest-sha256", metavar="HEX",
                     help="refuse unless manifest.json has this sha256 (as export printed it)")
    imp.set_defaults(run=_cache_import)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="cubridge", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action="version", version=f"cubridge (torch_cubridge) {__version__}")
    ap.set_defaults(help_for=ap)
    sub = ap.add_subparsers(dest="cmd")
    ex = sub.add_parser("explain", help="print the captured graph, the CuIR program and the verification")
    ex.add_argument("target", help="path/to/file.py:function (examples from <function>_example() if defined)")
    ex.add_argument("--shape", default="2,4,128,64", help="B,H,S,D for q/k/v when no example is defined")
    ex.add_argument("--json", action="store_true", help="print the program as JSON instead")
    ex.set_defaults(run=_explain)
    bd = sub.add_parser("build", help="verify a spec and build its kernels into the cache ahead of time")
    bd.add_argument("target", nargs="?", help="path/to/file.py:function taking (q, k, v)")
    bd.add_argument("--model", help="a transformers model's config (a directory with config.json, or the file): "
                                    "every attention variant its forward calls")
    bd.add_argument("--arch", required=True, help="the serving GPU's arch: sm_90a (H100/H200), sm_80, ...")
    bd.add_argument("--shape", required=True, help="B,H,S,D of the example call (S: the key length); "
                                                   "with --model, B,S")
    bd.add_argument("--flash-api", action="store_true",
                    help="with --model: the kernels of the flash API (integrations/flash_api.py) that serve the "
                         "model under transformers' flash path and continuous batching, and the block-table append")
    bd.add_argument("--kv-heads", type=int, default=0, help="KV heads (GQA/MQA); default H")
    bd.add_argument("--queries", type=int, default=0, help="query length (<= 16: the decode kernel); default S")
    bd.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    bd.set_defaults(run=_build)
    bn = sub.add_parser("bench", help="time a spec, its compiled kernel, SDPA and FlexAttention; JSON and an SVG chart")
    bn.add_argument("target", help="path/to/file.py:function taking (q, k, v)")
    bn.add_argument("--shape", default="4,16,4096,128", help="B,H,S,D (S: the key length)")
    bn.add_argument("--kv-heads", type=int, default=0, help="KV heads (GQA/MQA); default H")
    bn.add_argument("--queries", type=int, default=0, help="query length; default S")
    bn.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    bn.add_argument("--out", default=".", help="folder for bench.json and bench.svg")
    bn.set_defaults(run=_bench)
    _cache_parser(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "run", None) is None:  # `cubridge` or `cubridge cache` alone: what it can do
        (args.help_for or parser).print_help(sys.stderr)
        return EXIT_ERROR
    try:
        return args.run(args)
    except KeyboardInterrupt:
        print("cubridge: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # every failure is one line; CUBRIDGE_DEBUG=1 shows the traceback
        from . import config
        if config.debug():
            raise
        print(f"cubridge: {error_line(e)}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    raise SystemExit(main())
