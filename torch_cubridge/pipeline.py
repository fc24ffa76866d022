"""The CuBridge pipeline: the one module that says which stage runs when.

    capture -> transfer -> generalise -> guard -> verify (CPU, fp64)
            -> lower -> build/load -> verify on GPU (the call's own inputs first) -> register

Data flows one way: each stage takes the previous stage's output. Everything
above this module (compile, api, integrations) asks for a program or a kernel
here; nothing below it imports it. The work is the stages' own: the guards in
capture/program_guards.py, the kernel choice in lower/choice.py (made once per
call), the build started before verification ends in build/early.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .build import early
from .build.ahead import build_variants
from .cache import verdicts
from .capture.checks import check_call
from .capture.hashing import spec_hash
from .capture.nesting import stage, staged  # noqa: F401  (stage: compile.py reads it from here)
from .capture.program_guards import held
from .capture.recall import Transferred, remembered, warm_key, warm_transfer  # noqa: F401  (warm_transfer: compile.py)
from .capture.refusal import located
from .capture.trace import Captured, capture
from .errors import UnsupportedSpec
from .ir.bind import call_device
from .ir.program import Program
from .transfer import symbolic_transfer
from .transfer.generalize import generalize
from .transfer.lengths import with_lengths
from .verify.cpu import VerifyReport, verify_program


def transfer_stage(fn: Callable, bound: dict[str, Any], backend: str = "symbolic",
                   llm_options: dict | None = None, where: tuple[str, str] | None = None) -> Transferred:
    """capture -> transfer -> generalise -> guard -> verify. Raises UnsupportedSpec on refusal.
    With `where` (warm_key of the call), the verified program is also recorded for warm_transfer."""
    check_call(bound)  # bad input raises TypeError/ValueError here, before any work
    if on_cuda(bound):
        early.warm_compiler()
        from .ops import hotpath
        hotpath.module()  # the host fast path's C module builds on its thread while this call transfers
    with staged():
        return _transfer_stage(fn, bound, backend, llm_options, where)


def _transfer_stage(fn: Callable, bound: dict[str, Any], backend: str, llm_options: dict | None,
                    where: tuple[str, str] | None) -> Transferred:
    try:
        cap = capture(fn, bound)
        key = spec_hash(cap)
        warm = remembered(cap, key, backend, "record in the disk cache")
        if warm is not None:  # verified by an earlier process for exactly this spec hash
            return warm
        with verdicts.transfer_turn(key) as waited:  # processes racing on a new spec: one works, the rest wait
            warm = remembered(cap, key, backend, "record in the disk cache") if waited else None
            return warm if warm is not None else _transfer_and_verify(fn, bound, backend, llm_options, cap, key,
                                                                      where)
    except UnsupportedSpec:
        raise
    except Exception as e:  # an internal error is a refusal that names itself, never an escape
        raise UnsupportedSpec(f"internal error ({type(e).__name__}: {e}); please report it with the spec",
                              op="torch_cubridge") from e


def _transfer_and_verify(fn: Callable, bound: dict[str, Any], backend: str, llm_options: dict | None,
                         cap: Captured, key: str, where: tuple[str, str] | None) -> Transferred:
    try:
        candidates, used = _transfer(fn, bound, backend, llm_options, cap)
        # Modules that differ only in attributes the trace never read (a model's layers: layer_idx) give
        # one graph; where this module's own transfer gives a program (guards included) verified for
        # such a module, that verdict holds here: its guards came from this module's trace.
        modular = any(isinstance(v, torch.nn.Module) for v in bound.values())
        tkey = spec_hash(cap, module_values=False) if modular else None
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
    _build_early(prog, bound)  # before the probes: the generic program lowers to the same source, as a rule
    out = []
    tied = with_lengths(prog, bound)  # a computed q/k/v whose length no argument dim gives: held at its shape
    if tied is not None:
        gen, generic = generalize(fn, bound, tied, symbolic_transfer if used == "symbolic" else (lambda c: tied))
        if generic:
            _build_early(gen, bound)
            out.append((held(fn, bound, gen, True), True))
    out.append((held(fn, bound, prog, False), False))
    return out, used


def _build_early(prog: Program, bound: dict[str, Any]) -> None:
    """Start building the kernel _build_and_verify asks for first, where this call may build (build/early.py)."""
    if on_cuda(bound):
        early.build_early(prog, bound, call_device(bound))
        early.build_backward_early(prog, bound, call_device(bound))


def kernel_stage(fn: Callable, res: Transferred, bound: dict[str, Any]) -> tuple[Any | None, str]:
    """lower -> build/load -> verify on GPU -> register. Returns (runner or None, why); never raises."""
    if not torch.cuda.is_available():
        return None, "CUDA is not available, so no kernel is used; the spec computes the result"
    if not on_cuda(bound):
        return None, "the inputs are not CUDA tensors, so no kernel is used; the spec computes the result"
    try:
        with staged():
            return _build_and_verify(fn, res, bound)
    except UnsupportedSpec as e:
        return None, f"no kernel for this program: {e}"
    except Exception as e:  # a build or launch problem must never become a wrong answer
        return None, f"kernel build failed ({type(e).__name__}: {e}); the spec computes the result"


def _build_and_verify(fn: Callable, res: Transferred, bound: dict[str, Any]) -> tuple[Any | None, str]:
    """lower -> build/load -> runner -> GPU verification (fast tanh first, then exact) -> register."""
    from .lower import lower
    from .lower.choice import choose_kernel
    from .ops.registry import register
    from .build.arch import arch_for
    from .ops.runner import KernelRunner
    from .verify.gpu import gpu_cases, verify_kernel
    p = res.program
    device = call_device(bound)
    arch = arch_for(device)
    choice = choose_kernel(p, bound, arch)
    dtype = getattr(torch, choice.dtype)
    last = None
    for fast in (True, False):
        low = lower(p, choice=choice, fast_tanh=fast)
        # while NVRTC still builds it (a new kernel, so no GPU verdict is on record): the references
        cases = gpu_cases(fn, p, bound, dtype, device) if early.building(low, arch) else None
        kern, info, aux = early.load(low, arch)
        info["program"] = res.key
        runner = KernelRunner(p, low, kern, choice.head_dim, info, aux, choice.value_dim, **choice.readers(),
                              pad_from=choice.pad_from)
        gpu = _device_id(device)
        cubin = info["key"] + ":" + info["sha256"]  # the verdict holds for this binary
        known = verdicts.gpu_verdict(cubin, res.key, gpu)
        if known is not None:
            rep = VerifyReport(ok=known, reason=f"({'verified' if known else 'failed GPU verification'} on this "
                                                f"GPU model {verdicts.gpu_origin(cubin, res.key, gpu)})")
        else:
            rep = verify_kernel(runner.run_bound, fn, p, bound, dtype, device, cases=cases)
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


def build_ahead(fn: Callable, args: tuple, kwargs: dict[str, Any], arch: str,
                progress: Callable[[str], None]) -> list[dict]:
    """capture -> transfer -> verify (CPU, fp64) -> lower -> build fn(*args, **kwargs)'s spec, with no GPU.
    The verified program (under its spec hash, and under the call's warm_key, for a serving process's calls
    of that signature inside its guards, at other sizes too) and the kernels (under the keys a serving
    process computes for `arch` and the inputs' dtype) land in the disk cache, so a server's first call
    builds nothing; it still verifies on its GPU."""
    from .capture.signature import call_signature
    from .capture.trace import bind_example
    progress("capture, transfer and CPU verification")
    bound = bind_example(fn, args, kwargs)
    res = transfer_stage(fn, bound, where=warm_key(fn, call_signature(args, kwargs)))
    return build_variants(res.program, bound, arch, res.key, progress)


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
