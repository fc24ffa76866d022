"""The CuBridge pipeline: the one module that says which stage runs when.

    capture -> transfer -> generalise -> guard -> verify (CPU, fp64)
            -> lower -> build/load -> verify on GPU (the call's own inputs first) -> register

Data flows one way: each stage takes the previous stage's output. Everything
above this module (compile, api, integrations) asks for a program or a kernel
here; nothing below it imports it.
"""
from __future__ import annotations

import threading
import warnings
from contextlib import contextmanager
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator

import torch

from .cache import verdicts
from .capture.checks import check_call
from .capture.guards import pin_all, size_guards, value_guards
from .capture.hashing import spec_hash
from .capture.trace import Captured, capture
from .errors import UnsupportedSpec
from .ir.bind import call_device
from .ir.expr import Expr, call, const, dim
from .ir.program import Program
from .ir.prologue import FIXED, length_rule, operand_length, operand_shapes
from .transfer import symbolic_transfer
from .transfer.generalize import generalize
from .transfer.lengths import with_lengths
from .verify.cpu import VerifyReport, verify_program


@dataclass
class Transferred:
    """A verified program and how it was obtained."""
    program: Program
    captured: Captured | None  # None when a warm record stood in for capture
    generic: bool          # valid at other batch sizes and lengths (within its guards)
    report: VerifyReport
    key: str               # the spec hash
    backend: str           # "symbolic" or "llm"


class _Stage(threading.local):
    depth = 0  # pipeline stages this thread is inside


stage = _Stage()


@contextmanager
def _staged() -> Iterator[None]:
    """A compiled function called while this thread captures or verifies a spec (inside that spec: a model's
    attention module routed as a whole whose forward calls the attention interface, inkling2) runs its own
    spec (CompiledAttention reads `stage.depth`): the outer capture traces its ops, and the outer reference
    is the spec's own answer, never a kernel's."""
    stage.depth += 1
    try:
        yield
    finally:
        stage.depth -= 1


def warm_key(fn: Callable, call_key: tuple) -> tuple[str, str] | None:
    """(code key, call signature) as text, where both are stable across processes; else None."""
    from .capture.codekey import code_key
    text = repr(call_key)
    if " at 0x" in text:  # an object keyed by identity: nothing another process could match
        return None
    ck = code_key(fn)
    return (ck, text) if ck is not None else None


def warm_transfer(where: tuple[str, str] | None, bound: dict[str, Any], backend: str = "symbolic"
                  ) -> Transferred | None:
    """The program an earlier process verified for this code key and call signature (`where`,
    from warm_key), without capture, where its guards hold for this call; else None."""
    spec_key = verdicts.recall_warm(*where) if where else None
    res = _remembered(None, spec_key, backend, "no capture: same code key") if spec_key else None
    if res is None:
        return None
    from .ir.guards import bound_failing
    try:
        return res if bound_failing(res.program.guards, bound) is None else None
    except Exception:  # guards this version cannot check are a miss
        return None


def transfer_stage(fn: Callable, bound: dict[str, Any], backend: str = "symbolic",
                   llm_options: dict | None = None, where: tuple[str, str] | None = None) -> Transferred:
    """capture -> transfer -> generalise -> guard -> verify. Raises UnsupportedSpec on refusal.
    With `where` (warm_key of the call), the verified program is also recorded for warm_transfer."""
    check_call(bound)  # bad input raises TypeError/ValueError here, before any work
    _warm_compiler(bound)
    with _staged():
        return _transfer_stage(fn, bound, backend, llm_options, where)


def _transfer_stage(fn: Callable, bound: dict[str, Any], backend: str, llm_options: dict | None,
                    where: tuple[str, str] | None) -> Transferred:
    try:
        cap = capture(fn, bound)
        key = spec_hash(cap)
        warm = _remembered(cap, key, backend, "record in the disk cache")
        if warm is not None:  # verified by an earlier process for exactly this spec hash
            return warm
        candidates, used = _transfer(fn, bound, backend, llm_options, cap)
        # Modules that differ only in attributes the trace never read (a model's layers: layer_idx) give
        # one graph; where this module's own transfer gives a program (guards included) verified for
        # such a module, that verdict holds here: its guards came from this module's trace.
        tkey = spec_hash(cap, module_values=False) if any(isinstance(v, torch.nn.Module) for v in bound.values()) else None
        reports = []
        for prog, generic in candidates:
            shared = verdicts.recall_trace(tkey, prog.to_json()) if tkey else None
            if shared is not None:
                verdicts.remember_program(key, prog.to_json(), generic, used)
                report = VerifyReport(ok=True, reason="(verified for a module of the same trace and guards)")
                return Transferred(prog, cap, generic, report, shared, used)
            reports.append(verify_program(fn, prog, bound, generic))
            if reports[-1].ok:
                break
        # a refusal shows why the first (generic) one failed
        report = reports[-1] if reports[-1].ok else reports[0]
    except UnsupportedSpec:
        raise
    except Exception as e:  # an internal error is a refusal that names itself, never an escape
        raise UnsupportedSpec(f"internal error ({type(e).__name__}: {e}); please report it with the spec",
                              op="torch_cubridge") from e
    if not report.ok:
        raise UnsupportedSpec("the transferred program failed verification against the spec\n" + report.summary(),
                              op="verify")
    verdicts.remember_program(key, prog.to_json(), generic, used)
    if tkey:
        verdicts.remember_trace(tkey, prog.to_json(), key)
    if where:
        verdicts.remember_warm(*where, spec_key=key)
    return Transferred(prog, cap, generic, report, key, used)


def _allowed(rec: dict, backend: str) -> bool:
    """A record serves only a request its backend could have made it for ("auto" takes either)."""
    return backend == "auto" or rec.get("backend") == backend


def _remembered(cap: Captured | None, key: str, backend: str, how: str) -> Transferred | None:
    """The program recorded under spec hash `key`, where `backend` may use it; else None."""
    rec = verdicts.recall_program(key)
    if rec is None or not _allowed(rec, backend):
        return None
    try:
        prog = Program.from_json(rec["program"])
    except Exception:  # a record this version cannot read is a miss
        return None
    report = VerifyReport(ok=True, reason=f"(verified by an earlier process; {how})")
    return Transferred(prog, cap, bool(rec["generic"]), report, key, str(rec["backend"]))


def _transfer(fn: Callable, bound: dict[str, Any], backend: str, llm_options: dict | None, cap: Captured
              ) -> tuple[list[tuple[Program, bool]], str]:
    """The programs to verify, in order, as (program, generic), and the backend used: the generic
    program first, then the one held at the call's shape (a spec whose behaviour at other lengths no
    probe saw, say a branch on the length, may still hold at this one)."""
    try:
        prog = symbolic_transfer(cap)
        used = "symbolic"
    except UnsupportedSpec as e:
        if backend not in ("auto", "llm"):
            raise located(fn, bound, e, cap) from None
        from .transfer.llm import llm_transfer
        prog = llm_transfer(cap, reason=str(e), **(llm_options or {}))
        used = "llm"
    build_early(prog, bound)  # before the probes: the generic program lowers to the same source, as a rule
    out = []
    tied = with_lengths(prog, bound)  # a computed q/k/v whose length no argument dim gives: held at its shape
    if tied is not None:
        gen, generic = generalize(fn, bound, tied, symbolic_transfer if used == "symbolic" else (lambda c: tied))
        if generic:
            build_early(gen, bound)
            out.append((_held(fn, bound, gen, True), True))
    out.append((_held(fn, bound, prog, False), False))
    return out, used


def _held(fn: Callable, bound: dict[str, Any], prog: Program, generic: bool) -> Program:
    """The program with the sizes it requires and the guards it holds under."""
    prog = with_requirements(prog, bound, generic)
    return replace(prog, guards=guards_for(fn, bound, prog, generic))


def located(fn: Callable, bound: dict[str, Any], e: UnsupportedSpec, cap: Captured) -> UnsupportedSpec:
    """The refusal, naming the user's op and line instead of an aten op."""
    from .capture.locate import locate_op, occurrence, torch_name
    from .capture.trace import spec_over
    if not (e.op or "").startswith("aten."):
        return e
    where = locate_op(spec_over(fn, bound, []), e.op, occurrence(cap.graph, e.node) if e.node else 0)
    return UnsupportedSpec(e.reason, op=f"{torch_name(e.op)} at {where}") if where else e


def with_requirements(prog: Program, bound: dict[str, Any], generic: bool) -> Program:
    """Sizes of extent 1 were broadcasts at capture; a specialised program holds at its shape only."""
    from .verify.inputs import example_sizes
    sizes = example_sizes(prog, bound)
    keep = ("B", "H", "Hkv", "Sq", "Skv")
    # a generic prologue is fitted in the lengths (and the batch, where probes showed it: Program.batch)
    # only: the heads stay the call's
    held = (("H", "Hkv") if prog.batch else ("B", "H", "Hkv")) if prog.prologue or prog.epilogue else ()
    req = tuple((k, sizes[k]) for k in keep if sizes[k] == 1 or not generic or k in held)
    return replace(prog, requires=req)


def guards_for(fn: Callable, bound: dict[str, Any], prog: Program, generic: bool) -> tuple[Expr, ...]:
    """When the program holds: the spec's size decisions, pinned sizes, its Python arguments."""
    seq = [length_of(op) for op in (prog.q, prog.k, prog.v)]
    moving = tuple(s[:2] for s in seq if s is not None and s[0] != FIXED) + tuple(
        pd for op in (prog.q, prog.k, prog.v) if op.step and op.length for pd in length_rule(op)[3])
    unmoved = _unmoved(prog, bound) if generic and (prog.prologue or prog.epilogue) else ()
    pinned = frozenset((path, d) for path, d, _ in unmoved)
    traced = size_guards(fn, bound, moving, pinned) if generic and None not in seq else None
    unread: frozenset = frozenset()
    if traced is None:  # not generic, or code only a static trace survives: exactly the example's sizes
        sizes = pin_all(bound)
    else:
        sizes, unread = traced  # sizes the spec never reads (a page pool's page count) stay free
        if operand_length(prog.q, bound) == operand_length(prog.k, bound):
            # generalisation fitted scalars in Sq alone when the example was square
            sizes += (call("eq", _length_expr(seq[0]), _length_expr(seq[1])),)
    sizes += tuple(call("eq", dim(path, d), const(n)) for path, d, n in unmoved if (path, d) not in unread)
    if generic:
        sizes += _divisor_pins(prog, bound)
    return sizes + value_guards(fn, bound)


def _divisor_pins(prog: Program, bound: dict[str, Any]) -> tuple[Expr, ...]:
    """A constant that divides an index (b % 4 from Swin's view(B // nW, nW, ...)) may be a size that
    reached the program through a view's shape, which no guard records: every argument dim of that
    size is pinned (at worst a needless pin: another size captures again)."""
    from .ir.expr import walk
    vals = {s.name: s.value for s in prog.scalars if s.kind == "int" and s.expr is None and s.arg is None}
    used = {vals[n.args[1].attr] for e in (prog.score, prog.mask, prog.sink) if e is not None for n in walk(e)
            if n.op in ("floordiv", "mod") and n.args[1].op == "scalar" and n.args[1].attr in vals}
    return tuple(call("eq", dim(path, d), const(int(n))) for path, t in bound.items() if isinstance(t, torch.Tensor)
                 for d, n in enumerate(t.shape) if n in used and n > 1)


def _unmoved(prog: Program, bound: dict[str, Any]) -> tuple[tuple[str, int, int], ...]:
    """(path, dim, size) of every argument size that does not follow the lengths (or the batch, where the
    program is fitted to it), to be pinned: a generic prologue has only its fitted literals moving (a view's
    H or a table's size stays a literal)."""
    from .verify.inputs import example_sizes, length_steps, make_inputs
    ex, step = example_sizes(prog, bound), length_steps(prog)
    probe = dict(ex, Sq=ex["Sq"] + 3 * step["Sq"], Skv=ex["Skv"] + (3 if ex["Sq"] == ex["Skv"] else 5) * step["Skv"])
    if prog.batch:
        probe["B"] = ex["B"] + 1
    moved = make_inputs(prog, bound, probe, seed=0, values=False)
    return tuple((path, d, int(n)) for path, t in bound.items() if isinstance(t, torch.Tensor)
                 for d, n in enumerate(t.shape) if moved[path].shape[d] == n)


def length_of(op: Any) -> tuple[str, int, int, int] | None:
    """(path, dim, offset, scale): the argument dim an operand's length is, times scale, plus offset;
    None: held."""
    if op.step is None:
        return op.arg, op.dims.index("s"), 0, 1
    rule = length_rule(op)
    return None if rule is None else (rule[0], rule[1], rule[2], rule[4])


def _length_expr(seq: tuple[str, int, int, int]) -> Expr:
    path, d, off, scale = seq
    if path == FIXED:
        return const(off)
    n = dim(path, d) if scale == 1 else call("mul", dim(path, d), const(scale))
    return call("add", n, const(off)) if off else n


def kernel_stage(fn: Callable, res: Transferred, bound: dict[str, Any]) -> tuple[Any | None, str]:
    """lower -> build/load -> verify on GPU -> register. Returns (runner or None, why); never raises."""
    if not torch.cuda.is_available():
        return None, "CUDA is not available, so no kernel is used; the spec computes the result"
    if not on_cuda(bound):
        return None, "the inputs are not CUDA tensors, so no kernel is used; the spec computes the result"
    try:
        with _staged():
            return _build_and_verify(fn, res, bound)
    except UnsupportedSpec as e:
        return None, f"no kernel for this program: {e}"
    except Exception as e:  # a build or launch problem must never become a wrong answer
        return None, f"kernel build failed ({type(e).__name__}: {e}); the spec computes the result"


# -- the build, started before verification --------------------------------------------
# NVRTC takes 1.3-1.5 s for a new Hopper kernel, the size probes, the guards' symbolic trace and CPU verification
# ~0.8 s: the kernel of the transferred program is built meanwhile on a helper thread (NVRTC drops the GIL).
# Lowering reads neither guards, nor required sizes, nor scalar values, so the program before generalisation
# and _held lowers to the same source as a rule; where it does not, the second source builds on the other
# worker and the first is wasted. A program that then fails verification leaves a cubin in the cache that
# nothing serves. The compiler itself is loaded there too while the first capture runs (_warm_compiler).
_early: dict[str, Future] = {}
_early_lock = threading.Lock()
_builder: ThreadPoolExecutor | None = None


def build_early(prog: Program, bound: dict[str, Any]) -> None:
    """Start building the kernel _build_and_verify will ask for first; never raises."""
    try:
        from . import config
        if config.is_readonly() or not on_cuda(bound):
            return
        from .lower import lower
        from .ops.kernel import kernel_key, load_kernel
        from .ops.runner import arch_for
        arch = arch_for(call_device(bound))
        dtype, head_dim, value_dim, decode, reads = kernel_choice(prog, bound, arch)
        low = lower(prog, arch, dtype, head_dim, fast_tanh=True, decode=decode, value_dim=value_dim,
                    **_read_kind(reads))
        key = kernel_key(low, arch)
        with _early_lock:
            if key in _early:
                return
            for done in [k for k, f in _early.items() if f.done()]:  # never asked for: verification failed
                del _early[done]  # (its cubin stays in the disk cache)
            _early[key] = _helper().submit(load_kernel, low, arch)
    except Exception:  # the build is tried again, in order, by _build_and_verify
        return


def _helper() -> ThreadPoolExecutor:
    global _builder
    if _builder is None:
        _builder = ThreadPoolExecutor(max_workers=2, thread_name_prefix="cubridge-build")
    return _builder


_compiler_warm = threading.Event()


def _warm_compiler(bound: dict[str, Any]) -> None:
    """Once per process, where this call may build: load the compiler on the helper while capture runs."""
    if _compiler_warm.is_set() or not on_cuda(bound):
        return
    _compiler_warm.set()
    from . import config
    if not config.is_readonly():
        from .build import warm_up
        with _early_lock:
            _helper().submit(warm_up)


def _building(low: Any, arch: str) -> bool:
    """Whether an early build of this source is still running."""
    from .ops.kernel import kernel_key
    with _early_lock:
        fut = _early.get(kernel_key(low, arch))
    return fut is not None and not fut.done()


def _load(low: Any, arch: str) -> tuple[Any, dict, dict]:
    """load_kernel, or the early build of the same source when one was started."""
    from .ops.kernel import kernel_key, load_kernel
    with _early_lock:
        fut = _early.pop(kernel_key(low, arch), None)
    if fut is not None:
        try:
            return fut.result()
        except Exception:
            pass  # built again here, where its error is reported
    return load_kernel(low, arch)


def _build_and_verify(fn: Callable, res: Transferred, bound: dict[str, Any]) -> tuple[Any | None, str]:
    """lower -> build/load -> runner -> GPU verification (fast tanh first, then exact) -> register."""
    from .lower import lower
    from .ops.registry import register
    from .ops.runner import KernelRunner, arch_for
    from .verify.gpu import gpu_cases, verify_kernel
    p = res.program
    device = call_device(bound)
    arch = arch_for(device)
    dtype, head_dim, value_dim, decode, reads = kernel_choice(p, bound, arch)
    last = None
    for fast in (True, False):
        low = lower(p, arch, dtype, head_dim, fast_tanh=fast, decode=decode, value_dim=value_dim,
                    **_read_kind(reads))
        # while NVRTC still builds it (a new kernel, so no GPU verdict is on record): the references
        cases = gpu_cases(fn, p, bound, getattr(torch, dtype), device) if _building(low, arch) else None
        kern, info, aux = _load(low, arch)
        info["program"] = res.key
        runner = KernelRunner(p, low, kern, head_dim, info, aux, value_dim, **_readers(reads))
        gpu = _device_id(device)
        cubin = info["key"] + ":" + info["sha256"]  # the verdict holds for this binary
        known = verdicts.gpu_verdict(cubin, res.key, gpu)
        if known is not None:
            rep = VerifyReport(ok=known, reason=f"({'verified' if known else 'failed GPU verification'} on this "
                                                "GPU model in an earlier process)")
        else:
            rep = verify_kernel(runner.run_bound, fn, p, bound, getattr(torch, dtype), device, cases=cases)
            worst = max((t.rel_err for t in rep.trials), default=0.0)
            # A failure is remembered only for the fast-tanh build, whose fallback is the exact one: a
            # failure that was not the arithmetic's must never keep a kernel from serving for good.
            if rep.ok or (low.fast_tanh and any(not t.ok for t in rep.trials)):
                verdicts.remember_gpu_verdict(cubin, res.key, gpu, rep.ok, worst)
        info["verification"] = rep
        if rep.ok:
            register(runner.kernel_id, runner)
            how = "built" if info["built"] else "loaded from the disk cache"
            worst = max((t.rel_err for t in rep.trials), default=0.0)
            return runner, (f"fused kernel {info['key']} ({how} in {info['seconds']:.2f} s, source "
                            f"{info['source_path']}); GPU verification passed, worst rel L2 {worst:.1e}")
        last = rep
        if not low.fast_tanh:
            break
    return None, "the compiled kernel failed GPU verification and is not used:\n" + (last.summary() if last else "")


def kernel_choice(p: Program, bound: dict[str, Any], arch: str) -> tuple[str, int, int, bool, Any]:
    """(the dtype the kernel computes in, head dim of Q and K, head dim of V, whether the decode kernel
    serves, how it reads K and V in place: paged (ir/paged.py), as the pieces the spec concatenates
    (ir/segments.py), or None) for a call on `arch`; refuses what no kernel takes (a head dim none takes is
    refused at lowering). Paged reads hold at the call's shapes: their program is guarded to them. The
    decode kernel reads pages and pieces; a prefill kernel the pages lower/tiles.py's pages_in_place takes."""
    from .ir.bind import lookup
    from .ir.paged import paged_operands
    from .ir.segments import segment_operands
    from .lower.source import decode_refusal, in_place_refusal, program_tile
    from .lower.tiles import decode_call, pages_in_place
    from .ops.runner import DTYPES
    ops = operand_shapes(p, bound)
    q = ops["q"]
    if q.dtype not in DTYPES:
        raise UnsupportedSpec(f"the kernel computes in bfloat16 or float16; the inputs are {q.dtype}", op="kernel")
    head_dim = q.shape[p.q.dims.index("d")]
    dv = ops["v"].shape[p.v.dims.index("d")]
    # calls with few queries get the split-KV decode kernel where it takes the program
    decode = decode_call(q.shape[p.q.dims.index("s")]) and decode_refusal(p, head_dim, dv) is None
    reads: Any = None
    if decode and decode_refusal(p, head_dim, dv, paged=True) is None:  # else the prologue gathers or joins
        reads = paged_operands(p, bound) or segment_operands(p)
    elif not decode and in_place_refusal(p) is None:
        try:
            tile = program_tile(p, arch, head_dim, dv)
        except UnsupportedSpec:  # refused again, with its reason, at lowering
            tile = None
        reads = paged_operands(p, bound) if tile is not None else None
        if reads is not None and not pages_in_place(lookup(bound, reads[0].pages).shape[reads[0].slot_dim], tile):
            reads = None  # gathered by the prologue
    return DTYPES[q.dtype], head_dim, dv, decode, reads


def _read_kind(reads: Any) -> dict[str, bool]:
    """lower()'s flags for how the kernel reads K and V in place (kernel_choice's `reads`)."""
    from .ir.segments import KVSegments
    return {"paged": isinstance(reads, tuple), "segmented": isinstance(reads, KVSegments)}


def _readers(reads: Any) -> dict[str, Any]:
    """KernelRunner's paged reads or K/V pieces (kernel_choice's `reads`)."""
    from .ir.segments import KVSegments
    return {"paged": reads if isinstance(reads, tuple) else None,
            "segments": reads if isinstance(reads, KVSegments) else None}


def build_ahead(fn: Callable, args: tuple, kwargs: dict[str, Any], arch: str,
                progress: Callable[[str], None]) -> list[dict]:
    """capture -> transfer -> verify (CPU, fp64) -> lower -> build fn(*args, **kwargs)'s spec, with no GPU.
    The verified program (under its spec hash, and under the call's warm_key, for a serving process's calls
    of that signature inside its guards, at other sizes too) and the kernels (under the keys a serving
    process computes for `arch` and the inputs' dtype) land in the disk cache, so a server's first call
    builds nothing; it still verifies on its GPU."""
    from .capture.signature import call_signature
    from .capture.trace import bind_example
    from .lower import lower
    from .ops.kernel import load_kernel
    progress("capture, transfer and CPU verification")
    bound = bind_example(fn, args, kwargs)
    res = transfer_stage(fn, bound, where=warm_key(fn, call_signature(args, kwargs)))
    p = res.program
    dtype, head_dim, value_dim, decode, reads = kernel_choice(p, bound, arch)  # as a serving process chooses
    out = []
    for fast in (True, False):  # the variants a serving process may try, in its order
        low = lower(p, arch, dtype, head_dim, fast_tanh=fast, decode=decode, value_dim=value_dim,
                    **_read_kind(reads))
        dims = f"head dim {head_dim}" + (f", value head dim {value_dim}" if value_dim != head_dim else "")
        progress(f"building {low.kernel} for {arch} ({dims}{', decode' if decode else ''})")
        _, info, _ = load_kernel(low, arch)  # builds into the cache; nothing is loaded on a GPU
        out.append({"key": info["key"], "built": info["built"], "seconds": info["seconds"],
                    "kernel": low.kernel, "program": res.key})
        if not low.fast_tanh:
            break
    return out


@dataclass
class BuildRecord:
    """A build-ahead pass over a model's calls (`cubridge build --model`): the kernels built and the refusals."""
    arch: str
    progress: Callable[[str], None]
    built: list[dict] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)

    def call(self, fn: Callable, args: tuple, kwargs: dict[str, Any], where: str, **fields: Any) -> None:
        """fn(*args, **kwargs)'s spec verified on the CPU and its kernels built (each recorded with `fields`),
        or its refusal recorded under `where`."""
        try:
            for b in build_ahead(fn, args, kwargs, self.arch, self.progress):
                self.built.append(dict(b, **fields))
        except UnsupportedSpec as e:
            self.refused.append(f"{where}: {e}")

    def result(self) -> dict[str, list]:
        return {"built": self.built, "refused": self.refused}


def _device_id(device: torch.device) -> str:
    """What a GPU verdict holds for: the GPU model, its arch and the CUDA build of torch."""
    props = torch.cuda.get_device_properties(device)
    return f"{props.name}|sm_{props.major}{props.minor}|cuda {torch.version.cuda}"


def on_cuda(bound: dict[str, Any]) -> bool:
    ts = [v for v in bound.values() if isinstance(v, torch.Tensor)]
    return bool(ts) and ts[0].device.type == "cuda" and torch.cuda.is_available()


def warn_once(cache: set, key: Any, msg: str) -> None:
    if key not in cache:
        cache.add(key)
        warnings.warn(msg, RuntimeWarning, stacklevel=4)
