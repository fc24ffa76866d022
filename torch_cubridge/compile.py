"""`@torch_cubridge.compile`: capture on first call, then a dictionary hit per call."""
from __future__ import annotations

import collections
import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .api import TransferResult, transfer_bound, warn_once
from .capture.checks import check_against, check_call
from .capture.signature import call_signature
from .capture.trace import bind_example
from .errors import UnsupportedSpec
from .ir.program import Program
from .ops.errors import NeedsAutograd, SpecServes

_WARNED: set = set()


@dataclass(frozen=True)
class Options:
    fallback: str = "warn"        # warn: run the spec and warn once; raise: raise; silent
    backend: str = "symbolic"     # symbolic | llm | auto (symbolic, then the LLM for what it refuses)
    llm: dict = field(default_factory=dict)  # model, base_url, api_key for the LLM backend

    def __post_init__(self) -> None:
        if self.fallback not in ("warn", "raise", "silent"):
            raise ValueError(f"fallback must be warn, raise or silent; got {self.fallback!r}")
        if self.backend not in ("symbolic", "llm", "auto"):
            raise ValueError(f"backend must be symbolic, llm or auto; got {self.backend!r}")


@dataclass
class Entry:
    program: Program | None
    runner: Callable | None           # the compiled kernel's call, or None: the spec serves
    reason: str                       # why the kernel or the spec serves calls
    result: TransferResult | None = None
    shapes: tuple | None = None       # exact tensor shapes when the program is not generic
    square: bool | None = None        # Sq == Skv at capture; a call that differs re-captures
    qk: tuple | None = None           # ((q position or name, seq dim), (k ..., ...))

    def fits(self, args: tuple, kwargs: dict) -> bool:
        if self.shapes is not None:
            return _shapes(args, kwargs) == self.shapes
        if self.square is not None and self.qk is not None:
            (qa, qd), (ka, kd) = self.qk
            q = args[qa] if isinstance(qa, int) and qa < len(args) else kwargs.get(qa if isinstance(qa, str) else "")
            k = args[ka] if isinstance(ka, int) and ka < len(args) else kwargs.get(ka if isinstance(ka, str) else "")
            if q is None or k is None:
                return False
            return (q.shape[qd] == k.shape[kd]) == self.square
        return True


def _shapes(args: tuple, kwargs: dict) -> tuple:
    return tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor)) + tuple(
        (k, tuple(v.shape)) for k, v in sorted(kwargs.items()) if isinstance(v, torch.Tensor))


class CompiledAttention:
    def __init__(self, fn: Callable, options: Options) -> None:
        self.fn = fn
        self.options = options
        self._table: dict[tuple, Entry] = {}
        self._established: Program | None = None
        self._last_runner: Any = None
        self.served: collections.Counter = collections.Counter()  # "kernel" / "spec": who computed each call
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return self._traced(args, kwargs)
        key = call_signature(args, kwargs)
        e = self._table.get(key)
        if e is None or not e.fits(args, kwargs):
            e = self._prepare(key, args, kwargs)
        if e.runner is not None:
            try:
                out = e.runner(*args, **kwargs)
                self.served["kernel"] += 1
                return out
            except NeedsAutograd:
                # a silent missing gradient would be a wrong answer: autograd goes through the spec
                self._warn("inputs require grad and the kernel has no backward yet; the spec computes this call")
            except SpecServes as why:
                self._warn(f"the spec computes this call: {why}")
        self.served["spec"] += 1
        return self.fn(*args, **kwargs)

    # -- slow path: capture, transfer, verify, build ---------------------------
    def _prepare(self, key: tuple, args: tuple, kwargs: dict) -> Entry:
        bound = bind_example(self.fn, args, kwargs)
        check_call(bound)
        if self._established is not None:
            check_against(self._established, bound)
        try:
            res = transfer_bound(self.fn, bound, self.options.backend, self.options.llm)
        except UnsupportedSpec as err:
            if self.options.fallback == "raise":
                raise
            entry = Entry(None, None, f"the spec serves calls: {err}")
            self._warn(entry.reason)
            self._table[key] = entry
            return entry
        self._established = self._established or res.program
        entry = Entry(res.program, None, "", res)
        if not res.generic:
            entry.shapes = _shapes(args, kwargs)
        else:
            entry.square, entry.qk = _square_check(self.fn, res.program, args)
        entry.runner, entry.reason = _kernel_for(self.fn, res, bound, self.options)
        if entry.runner is not None:
            self._last_runner = entry.runner
        if entry.runner is None:
            if self.options.fallback == "raise" and not _no_cuda(bound):
                raise UnsupportedSpec(entry.reason, op="kernel")
            self._warn(entry.reason)
        self._table[key] = entry
        return entry

    def _traced(self, args: tuple, kwargs: dict) -> Any:
        """Under torch.compile: the custom op of the kernel built by an earlier eager call."""
        runner = self._last_runner
        if runner is None:
            return self.fn(*args, **kwargs)  # no verified kernel: trace the spec itself
        return runner.op_call(args, kwargs)

    def _warn(self, reason: str) -> None:
        if self.options.fallback != "silent":
            warn_once(_WARNED, (id(self), reason), f"torch_cubridge: {getattr(self.fn, '__name__', 'spec')}: {reason}")

    def serving_report(self, *args: Any, **kwargs: Any) -> str:
        key = call_signature(args, kwargs)
        e = self._table.get(key) or self._prepare(key, args, kwargs)
        return ("served by: the fused kernel" if e.runner is not None else "served by: the spec") + f"\nwhy: {e.reason}"


def _no_cuda(bound: dict[str, Any]) -> bool:
    ts = [v for v in bound.values() if isinstance(v, torch.Tensor)]
    return not torch.cuda.is_available() or not ts or ts[0].device.type != "cuda"


def _kernel_for(fn: Callable, res: TransferResult, bound: dict[str, Any], options: Options) -> tuple[Callable | None, str]:
    if not torch.cuda.is_available():
        return None, "CUDA is not available, so no kernel is used; the spec computes the result"
    if _no_cuda(bound):
        return None, "the inputs are not CUDA tensors, so no kernel is used; the spec computes the result"
    try:
        from .ops.runner import build_runner
        return build_runner(fn, res, bound)
    except UnsupportedSpec as e:
        return None, f"no kernel for this program: {e}"
    except Exception as e:  # a build or launch problem must never become a wrong answer
        return None, f"kernel build failed ({type(e).__name__}: {e}); the spec computes the result"


def kernel_status(p: Program, bound: dict[str, Any]) -> str:
    if _no_cuda(bound):
        return "served by: the spec (no CUDA device or CPU inputs)"
    return "served by: the fused kernel when compiled with @torch_cubridge.compile"


def _square_check(fn: Callable, p: Program, args: tuple) -> tuple[bool | None, tuple | None]:
    from .capture.trace import signature_of
    sig = [s for s in signature_of(fn) if not s.startswith("*")]

    def where(op: Any) -> tuple:
        pos = sig.index(op.arg) if op.arg in sig else op.arg
        if isinstance(pos, int) and pos >= len(args):
            pos = op.arg
        return pos, op.dims.index("s")
    qk = (where(p.q), where(p.k))
    (qa, qd), (ka, kd) = qk
    q = args[qa] if isinstance(qa, int) else None
    k = args[ka] if isinstance(ka, int) else None
    if q is None or k is None:
        return None, None
    return q.shape[qd] == k.shape[kd], qk


def compile(fn: Callable | None = None, **options: Any) -> Any:
    """Decorator: `@compile` or `@compile(fallback="raise")`."""
    opts = Options(**options)
    if fn is None:
        return lambda f: CompiledAttention(f, opts)
    return CompiledAttention(fn, opts)
