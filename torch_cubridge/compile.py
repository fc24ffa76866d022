"""`@torch_cubridge.compile`: capture on first call, then a table lookup per call.

One dispatch table serves eager calls and calls traced by torch.compile: the
key is the call signature (dtypes, devices, size-1 dims, Python values), and
each entry is served only where its program's guards hold. A call no entry
covers gets a new capture (eager) or the spec itself (traced). Any failure
serves the spec with a warning; the only errors raised are the spec's own.
"""
from __future__ import annotations

import collections
import functools
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
import torch.utils.checkpoint
from torch._subclasses.fake_tensor import FakeTensor

from .capture.signature import alive, call_signature, traced_signature
from .capture.trace import bind_example
from .capture.checks import check_call
from .capture.codekey import GlobalsWatch
from .capture.modulestate import ModuleState
from .capture.tracememo import memoised_stage
from .errors import UnsupportedSpec
from .ir.guards import GuardSet, reader
from .ir.prologue import operand_shapes
from .lower.tiles import decode_call
from .ops import hotpath
from .callsite import user_stacklevel
from .ops.backward_runner import prepare as prepare_autograd
from .ops.errors import NeedsAutograd, SpecServes
from .pipeline import Transferred, kernel_stage, on_cuda, stage, transfer_stage, warm_key, warm_transfer


def _fake_call(args: tuple, kwargs: dict) -> bool:
    """Whether the call's first tensor is a fake one (a capture is tracing the call)."""
    for a in args:
        if isinstance(a, torch.Tensor):
            return isinstance(a, FakeTensor)
    for a in kwargs.values():
        if isinstance(a, torch.Tensor):
            return isinstance(a, FakeTensor)
    return False


# torch.utils.checkpoint stops a recompute early by raising this through the recomputed forward
_STOP_RECOMPUTE = getattr(torch.utils.checkpoint, "_StopRecomputationError", ())

MAX_PROGRAMS = 32  # per function; past it (a size that moves with every call, say) the spec serves, with a warning


@dataclass(frozen=True)
class Options:
    fallback: str = "warn"        # warn: run the spec and warn once; raise: raise; silent
    backend: str = "symbolic"     # symbolic | llm | auto (symbolic, then the LLM for what it refuses)
    llm: dict = field(default_factory=dict)  # model, base_url, api_key for the LLM backend
    # bitwise-equal gradients run to run (as torch.use_deterministic_algorithms(True) asks for every function)
    deterministic: bool = False

    def __post_init__(self) -> None:
        if self.fallback not in ("warn", "raise", "silent"):
            raise ValueError(f"fallback must be warn, raise or silent; got {self.fallback!r}")
        if self.backend not in ("symbolic", "llm", "auto"):
            raise ValueError(f"backend must be symbolic, llm or auto; got {self.backend!r}")


@dataclass
class Entry:
    """What serves the calls of one signature inside one program's guards."""
    reason: str                                   # why the kernel or the spec serves
    result: Transferred | None = None             # None: the spec serves every call of the signature
    guards: GuardSet | None = None
    # a call's (head dim, few queries): each pair gets its own kernel (prefill or decode), built and
    # verified on the first call of that kind
    kernel_for: Callable[[tuple, dict], tuple[int, bool]] | None = None
    runners: dict[tuple[int, bool], Any] = field(default_factory=dict)   # -> GPU-verified kernel, or None
    reasons: dict[tuple[int, bool], str] = field(default_factory=dict)
    bad_input: Exception | None = None            # re-raised if the spec also refuses the call
    # calls the spec computed though a kernel was ready (a layout or an input it cannot take), by why: a warning
    # says it once, and this keeps the count (the flash API's generate once saw 24 such calls and no reason)
    spec_calls: collections.Counter = field(default_factory=collections.Counter)
    modules: ModuleState | None = None            # plain attributes of module arguments at capture

    def holds(self, args: tuple, kwargs: dict, traced: bool = False) -> bool:
        if self.guards is not None and not self.guards(args, kwargs):
            return False
        if self.modules is None:
            return True
        return self.modules.holds_traceable(args, kwargs) if traced else self.modules.holds(args, kwargs)


class CompiledAttention:
    def __init__(self, fn: Callable, options: Options) -> None:
        self.fn = fn
        self.options = options
        self._table: dict[tuple, list[Entry]] = {}
        self._served: collections.Counter = collections.Counter()  # calls of the Python path, by who computed them
        self._warned: set[str] = set()  # per instance: a set keyed by id(self) would silence a successor at its address
        self._watch: GlobalsWatch | None = None  # the globals and closure cells the captured programs read
        # launches replayed from C for calls of exactly a served call's layout (ops/hotpath.py)
        self._hot: list = []
        self._hot_made = 0
        self._hot_folded = 0  # calls served by records since dropped
        self._serve: Callable[[list, tuple, Any], Any] | None = None  # the C module's serve, once a record exists
        self._watched: Any = None  # the watch as the C serve checks it (GlobalsWatch.held)
        functools.update_wrapper(self, fn)

    # -- the call path -----------------------------------------------------------
    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        # first the host fast path, which checks the globals watch itself (a rebinding misses, and is found below)
        if self._hot and not kwargs and not stage.depth and not torch.compiler.is_compiling():
            try:
                out = self._serve(self._hot, args, self._watched)
            except Exception as err:  # a failed launch: the Python path serves, and decides what to retire
                self._drop_hot()
                self._warn(f"the host fast path failed ({type(err).__name__}: {err}); the Python path serves")
                out = None
            if out is not None:  # counted by its record (served)
                return out
        if torch.compiler.is_compiling():
            return self._traced(args, kwargs)
        if stage.depth:  # called inside a spec this thread captures or verifies: that spec's own ops
            return self.fn(*args, **kwargs)
        if self._watch is not None and not self._watch.unchanged():
            self._forget()  # a global the programs baked in was rebound: none of them holds
        if _fake_call(args, kwargs):  # traced by someone else's make_fx: the spec's ops, not a capture
            return self.fn(*args, **kwargs)
        key = call_signature(args, kwargs)
        e = self._find(key, args, kwargs)
        if e is None:
            e = self._prepare(key, args, kwargs)
        runner = self._runner(e, args, kwargs) if e.result is not None else None
        if runner is not None:
            try:
                record = not kwargs and e.modules is None and getattr(runner, "replayable", False) \
                    and self._records_pay()
                serve = getattr(runner, "serve", None)  # a KernelRunner's; tests serve through the interpreter
                out = serve(args, kwargs, record) if serve is not None else runner(*args, **kwargs)
                self._served["kernel"] += 1
                if record:
                    self._remember(runner, args, out)
                return out
            except NeedsAutograd:
                # through the custom op, whose autograd runs the backward (ops/backward_runner.py); where the
                # op has no backward for this program, the spec: a silent missing gradient would be a wrong answer
                try:
                    out = runner.op_call(args, kwargs, self._deterministic())
                    why = getattr(runner, "autograd_refusal", None)
                except _STOP_RECOMPUTE:  # activation checkpointing ends its recompute so; never ours to catch
                    raise
                except Exception as err:
                    out, why = None, f"the kernel's autograd path failed ({type(err).__name__}: {err})"
                if out is not None:
                    self._served["kernel"] += 1
                    return out
                self._spec_call(e, f"inputs require grad and {why}; the spec computes this call")
            except SpecServes as why:
                self._spec_call(e, f"the spec computes this call: {why}")
            except Exception as err:  # never an internal exception out of a call: retire this kernel
                self._drop_hot()
                d = e.kernel_for(args, kwargs)
                e.runners[d] = None
                e.reasons[d] = f"the kernel failed ({type(err).__name__}: {err}); the spec serves"
                self._warn(e.reasons[d])
        out = self._spec(e, args, kwargs)
        if runner is None:  # said once the spec has computed the call: a call the spec itself cannot take
            # (q and k of different head dims) raises the spec's own error alone, with no warning before it
            if e.result is not None:
                self._warn(e.reasons[e.kernel_for(args, kwargs)])
            elif e.bad_input is None:  # (_spec said why it computed a bad input)
                self._warn(e.reason)
        return out

    def _spec_call(self, e: Entry, why: str) -> None:
        e.spec_calls[why] += 1
        self._warn(why)

    def _spec(self, e: Entry, args: tuple, kwargs: dict) -> Any:
        self._served["spec"] += 1
        if e.bad_input is None:
            return self.fn(*args, **kwargs)
        try:
            out = self.fn(*args, **kwargs)
        except Exception as spec_err:  # the spec refuses too: our message says why more clearly
            raise e.bad_input from spec_err
        self._warn(f"the spec computes this call: {e.bad_input}")
        return out

    def _find(self, key: tuple, args: tuple, kwargs: dict, traced: bool = False) -> Entry | None:
        for e in self._table.get(key, ()):
            if e.holds(args, kwargs, traced):
                return e
        return None

    def _runner(self, e: Entry, args: tuple, kwargs: dict) -> Any:
        d = e.kernel_for(args, kwargs)
        if d not in e.runners:  # a head dim this program has no kernel for yet: build and verify one
            bound = bind_example(self.fn, args, kwargs)
            e.runners[d], e.reasons[d] = kernel_stage(self.fn, e.result, bound)
            if e.runners[d] is not None:
                prepare_autograd(e.runners[d], bound)
            if e.runners[d] is None:
                if self.options.fallback == "raise" and on_cuda(bound):
                    raise UnsupportedSpec(e.reasons[d], op="kernel")
        return e.runners[d]

    @property
    def served(self) -> collections.Counter:
        """Who computed each call so far: "kernel" (the Python path's launches and the fast path's) and "spec"."""
        out = collections.Counter(self._served)
        hits = sum(r.hits for r in self._hot)
        if hits:
            out["kernel"] += hits
        return out

    def _drop_hot(self, keep: int = 0) -> None:
        """Drop the records past the first `keep`, their calls counted."""
        hits = sum(r.hits for r in self._hot[keep:])
        self._served["kernel"] += hits
        self._hot_folded += hits
        del self._hot[keep:]

    def _records_pay(self) -> bool:
        """Whether records still pay: once eight were made, only while they have served at least one call
        each on average (a decode loop over a growing cache never repeats a layout; its calls then launch
        through the runner's C Decoder instead)."""
        return self._hot_made < hotpath.MAX_RECORDS or sum(r.hits for r in self._hot) + self._hot_folded >= self._hot_made

    def _remember(self, runner: Any, args: tuple, out: Any) -> None:
        """Record the launch that served this call for the host fast path."""
        rec = hotpath.record(runner, args, out)
        if rec is not None:
            self._serve = hotpath.module().serve
            self._watched = self._watch.held() if self._watch is not None else None
            self._hot_made += 1
            self._hot.insert(0, rec)
            self._drop_hot(keep=hotpath.MAX_RECORDS)

    # -- the slow path: capture, transfer, verify -----------------------------------
    def _forget(self) -> None:
        self._table.clear()
        self._drop_hot()
        self._watch = None

    def _prepare(self, key: tuple, args: tuple, kwargs: dict) -> Entry:
        if self._watch is None:  # taken before capture: the values the programs will bake in
            self._watch = GlobalsWatch(self.fn)
        entries = self._table.setdefault(key, [])
        bound = bind_example(self.fn, args, kwargs)  # a call the signature cannot bind raises, as the spec would
        try:
            check_call(bound)
        except (TypeError, ValueError) as bad:
            e = Entry(f"the spec serves calls: {bad}", bad_input=bad)
            entries.append(e)
            return e
        if self._full():
            e = Entry(f"the spec serves calls: {MAX_PROGRAMS} programs were captured already, the most one "
                      "compiled function keeps (a size or value that changes with every call?)")
            entries.append(e)  # later calls of this signature skip the slow path
            self._warn(e.reason)
            return e
        try:
            where = warm_key(self.fn, key)  # once: hashing the code is not free
            res = warm_transfer(where, bound, self.options.backend)
            if res is None:  # the entry must not keep the call's module and tensors alive: no `captured`
                res = memoised_stage(self.fn, bound, ("transfer", self.options.backend, repr(self.options.llm)),
                                     lambda: replace(transfer_stage(self.fn, bound, self.options.backend,
                                                                    self.options.llm, where=where), captured=None))
            res = replace(res, captured=None)
        except Exception as err:
            if self.options.fallback == "raise":
                raise
            why = err if isinstance(err, UnsupportedSpec) else f"internal error: {type(err).__name__}: {err}"
            e = Entry(f"the spec serves calls: {why}")  # warned once the spec has computed a call
            entries.append(e)
            return e
        p = res.program
        nargs = len(args)
        d, s = p.q.dims.index("d"), p.q.dims.index("s")
        if p.q.step:  # a computed query: its guards pin the shape, so one kernel choice holds
            fixed = operand_shapes(p, bound)["q"].shape
            choice = (fixed[d], decode_call(fixed[s]))

            def kernel_for(a: tuple, kw: dict) -> tuple[int, bool]:
                return choice
        else:
            q = reader(p.signature, nargs, p.q.arg)

            def kernel_for(a: tuple, kw: dict) -> tuple[int, bool]:
                shape = q(a, kw).shape
                return shape[d], decode_call(shape[s])
        mods = ModuleState(bound, p.signature, nargs)
        e = Entry("", res, GuardSet(p.guards, p.signature, nargs), kernel_for, modules=mods or None)
        entries.append(e)
        return e

    def _full(self) -> bool:
        """At the cap, once the entries of dead objects (modules keyed by identity) are dropped."""
        for key in [k for k in self._table if not alive(k)]:
            del self._table[key]
        return sum(map(len, self._table.values())) >= MAX_PROGRAMS

    def _traced(self, args: tuple, kwargs: dict) -> Any:
        """Under torch.compile: the same table; only a kernel already verified eagerly is used."""
        e = self._find(traced_signature(args, kwargs), args, kwargs, traced=True)
        runner = e.runners.get(e.kernel_for(args, kwargs)) if e is not None and e.result is not None else None
        if runner is None:
            # no kernel verified for this call: trace the spec itself.
            # No warning here: warnings.warn cannot be traced under fullgraph=True. explain() says which
            # calls a kernel serves.
            return self.fn(*args, **kwargs)
        out = runner.op_call(args, kwargs, self._deterministic())
        return self.fn(*args, **kwargs) if out is None else out  # None: gradients the op has no backward for

    def _deterministic(self) -> bool:
        """Whether this call's gradients must be bitwise-equal run to run: this function's option, or torch's for
        every op (both constant under a trace: dynamo guards torch's flag)."""
        return self.options.deterministic or torch.are_deterministic_algorithms_enabled()

    def _warn(self, reason: str) -> None:
        if self.options.fallback != "silent" and reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(f"torch_cubridge: {getattr(self.fn, '__name__', 'spec')}: {reason}", RuntimeWarning,
                          stacklevel=user_stacklevel())

    def serving_report(self, *args: Any, **kwargs: Any) -> str:
        key = call_signature(args, kwargs)
        e = self._find(key, args, kwargs) or self._prepare(key, args, kwargs)
        runner = self._runner(e, args, kwargs) if e.result is not None else None
        why = e.reasons.get(e.kernel_for(args, kwargs), "") if e.result is not None else e.reason
        spec = "".join(f"\nthe spec computed {n} call(s): {r}" for r, n in e.spec_calls.items())
        return ("served by: the fused kernel" if runner is not None else "served by: the spec") + f"\nwhy: {why}" + spec

    def entries(self) -> list[Entry]:
        """Every entry of the dispatch table (for explain and tests)."""
        return [e for es in self._table.values() for e in es]

    def kernels(self) -> list[Any]:
        """Every GPU-verified kernel runner built so far, oldest first."""
        return [r for e in self.entries() for r in e.runners.values() if r is not None]


def compile(fn: Callable | None = None, **options: Any) -> Any:
    """Decorator: `@compile` or `@compile(fallback="raise")`."""
    opts = Options(**options)
    if fn is None:
        return lambda f: CompiledAttention(f, opts)
    return CompiledAttention(fn, opts)
