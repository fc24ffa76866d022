"""The backward of the custom op (ops/custom_op.py): one interface, two implementations.

- The GPU kernel (ops/backward_gpu.py), where lower_backward takes the program and the call (dtype, head dims,
  no gradient reaching a returned LSE) and its first backward, at each head dim, dtype and set of learnable
  extras, matched the float64 reference on the call's own inputs, row by row. The gradients of learnable
  tensors the score reads are the kernel's (its learnable sites, lower/sites.py). A sink needs nothing of the
  kernel (its P from the forward's LSE, the sink joined, is softmax's times the sink's factor); the gradients
  of learnable tensors the sink reads are a reduction over rows beside it
  (backward_reference.kernel_sink_gradients), checked with the rest. A kernel that fails
  that check, or raises, never serves that program again in this process.
- The reference backward (ops/backward_reference.py: ir/backward.py's backward of the program, checked
  against float64 autograd of the spec in tests/ir), recomputed from the saved operands, a query tile at a
  time, in float32 (float64 for float64 operands). It serves everything else, with a warning once per
  program and reason.

`served` counts who computed each backward: "kernel" or "reference".
"""
from __future__ import annotations

import collections
import warnings
from typing import Any

import torch

from ..ir.bind import to_canonical
from ..verify.judge import judge_rows
from . import backward_gpu, backward_trials, row_flags
from .backward_reference import canonical_out, dout_for_lse_rounding, kernel_sink_gradients, reference_backward

# a row of dQ, dK or dV may be off by this fraction of its own largest element (floored at 1/32 of the median
# row's): bf16 P and dS on the tensor cores give ~1e-2 (benchmarks/kernel_dev/bwd_check.py), a wrong tile,
# a missed mask or a lost key is of the order of the row itself
ROW_TOL = 0.05


def lse_has_gradient(runner: Any) -> bool:
    """Whether a gradient can reach the op's LSE output: the spec returns the LSE, or the row scale PyTorch
    applies after the op reads it (a sink per row). A row scale that does not (a gate, a temperature) leaves
    the LSE without one, and the backward is the attention's alone, which the kernel computes."""
    from ..ir.expr import ROW_LSE, free_vars
    p = runner.p
    return bool(getattr(runner, "_lse_out", False)) or (p.row_scale is not None and ROW_LSE in free_vars(p.row_scale))


def autograd_refusal(runner: Any) -> str | None:
    """Why a call of `runner`'s program that needs gradients cannot go through the op; None where it can.
    The op's output is the kernel's, before anything PyTorch applies after it but the layout."""
    from ..ir.backward import derive
    p = runner.p
    if getattr(runner, "paged", None) is not None or getattr(runner, "segments", None) is not None:
        return "K and V read in place from pages or pieces have no backward"
    learnable = {x.name for x in p.extras if x.dtype.startswith(("float", "bfloat"))}
    try:
        derive(p, learnable)
    except Exception as err:  # NotDifferentiable: a step function of the scores
        return f"the score has no derivative ({err})"
    return None


def prepare(runner: Any, bound: dict[str, Any] | None = None) -> None:
    """Decide once, before any trace, whether calls that need gradients may go through the op; where this first
    call (`bound`, its arguments) wants gradients, keep what the first backward check draws its redrawn cases
    from (ops/backward_trials.py)."""
    try:
        why = autograd_refusal(runner)
    except Exception as err:  # never an internal exception: such calls run the spec
        why = f"{type(err).__name__}: {err}"
    try:
        runner.autograd_refusal = why
    except AttributeError:  # a plain function serving (tests): no op path
        return
    if why is None and bound is not None and torch.is_grad_enabled() and any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in bound.values()):
        try:
            runner.grad_example = backward_trials.keep_example(runner.p, bound)
        except Exception:  # the first backward is then checked on its own inputs alone
            runner.grad_example = None


class BackwardRunner:
    """The backward of one kernel id's program: `__call__` gives dQ, dK, dV and the learnable extras'
    gradients, by the GPU kernel where it is verified, else by the reference."""

    def __init__(self, runner: Any) -> None:
        self.p = runner.p
        self._forward = runner  # its op_operands and op_forward make the redrawn cases' O and LSE
        self.name = getattr(runner, "kernel_id", "attention")
        # the LSE's gradient is real where the spec returns the LSE or a row scale, applied after the op, reads it
        self.lse_grad = lse_has_gradient(runner)
        self.served: collections.Counter = collections.Counter()
        self._kernels: dict[tuple, Any] = {}     # _key -> GpuBackward, or None
        self._verified: dict[tuple, bool] = {}   # its verdict on its first call
        self._why: dict[tuple, str] = {}         # why it does not serve
        self._warned: set[str] = set()

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, extras: list[torch.Tensor],
                 scalars: list[float], out: torch.Tensor, lse: torch.Tensor | None, dout: torch.Tensor,
                 dlse: torch.Tensor | None, learn: list[int], deterministic: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """deterministic: bitwise-equal gradients run to run (compile(deterministic=True) or
        torch.use_deterministic_algorithms): the kernel's mode that adds dQ in a fixed order, else the reference."""
        why = self._refusal(q, k, v, lse, dlse, learn)
        if why is None:
            key = self._key(q, v, deterministic, learn)
            if self._kernels.get(key, True) is None:  # refused or failed before: no row check owed
                why = self._why[key]
            else:
                why, kdout = self._rows(q, k, v, extras, scalars, lse, dout)
        if why is None:
            try:
                got = self._kernel(key, q, k, v, extras, scalars, out, lse, dout, kdout, learn)
            except Exception as err:  # a build or launch failure: the reference serves this program from now on
                self._kernels[key] = None
                self._why[key] = f"the backward kernel failed ({type(err).__name__}: {err})"
                got = None
            if got is not None:
                self.served["kernel"] += 1
                return got
            why = self._why[key]
        self._warn(why)
        self.served["reference"] += 1
        return reference_backward(self.p, q, k, v, extras, scalars, dout, dlse if self.lse_grad else None, learn)

    # -- the kernel's gate -----------------------------------------------------------------
    def _refusal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor | None,
                 dlse: torch.Tensor | None, learn: list[int]) -> str | None:
        if self.lse_grad and dlse is not None:
            return "the rows' log-sum-exp has a gradient (returned, or read by a row scale), which the backward " \
                   "kernel does not take"
        return backward_gpu.refusal(self.p, q, k, v, lse is not None)

    def _key(self, q: torch.Tensor, v: torch.Tensor, deterministic: bool = False, learn: list[int] = ()) -> tuple:
        """(arch, dtype, head dim, device model, value head dim, deterministic, the learnable extras): one
        kernel and one verdict each (a program's calls may differ in V's width alone, or in which of its
        tensors want gradients: the kernel adds into those alone)."""
        d, dv = to_canonical(q, self.p.q).shape[-1], to_canonical(v, self.p.v).shape[-1]
        names = tuple(self.p.extras[i].name for i in learn)
        if not q.is_cuda:
            return q.device.type, q.dtype, d, q.device.type, dv, deterministic, names
        from ..build.arch import backward_arch
        return backward_arch(q.device), q.dtype, d, torch.cuda.get_device_name(q.device), dv, deterministic, names

    def _rows(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, extras: list[torch.Tensor],
              scalars: list[float], lse: torch.Tensor, dout: torch.Tensor) -> tuple[str | None, torch.Tensor]:
        """What this call's rows ask of the kernel, from the forward's LSE (ops/row_flags.py: noted when the
        forward made it): why it cannot take them (rows with no key where the program gives them the mean of V),
        or the dO to hand it (divided by P's row sum on rows a finite fill fills whole)."""
        any_fill, any_empty = row_flags.read(lse)
        if any_empty and self.p.empty_rows == "mean_v":
            return "rows with every key masked take the mean of V, whose gradient the backward kernel does not " \
                   "give", dout
        if any_fill and self.p.sink is not None:  # the row sums to divide by are the sink's factor, not 1
            return "rows a finite fill fills whole beside a sink below the fill", dout
        if not any_fill:
            return None, dout
        return None, dout_for_lse_rounding(self.p, q, k, v, extras, scalars, lse, row_flags.fill_rows(lse), dout)

    def _kernel(self, key: tuple, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, extras: list[torch.Tensor],
                scalars: list[float], out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
                kdout: torch.Tensor, learn: list[int]) -> tuple | None:
        """The kernel's dQ, dK, dV and the learnable tensors' gradients (extras[i] for i in `learn`: the kernel's
        where the score reads them, plus the sink's), or None where it does not serve (self._why says why).
        kdout: the dO the kernel is handed (_rows); the check holds its result to the call's own dO."""
        if key not in self._kernels:
            self._kernels[key] = None
            try:
                self._kernels[key] = build_kernel(self.p, key[0], key[1], key[2], key[4], key[5], key[6])
            except Exception as err:  # UnsupportedSpec from lower_backward, or a build error
                self._why[key] = f"no backward kernel ({type(err).__name__}: {err})"
        kern = self._kernels[key]
        if kern is None:
            return None
        got = self._gradients(kern, q, k, v, extras, scalars, out, lse, dout, kdout, learn)
        if key not in self._verified:
            bad = self.check(q, k, v, extras, scalars, out, dout, got, learn)
            bad = f"{bad}, on the call's own inputs" if bad is not None else \
                self.check_cases(kern, learn, q.dtype, q.device)
            self._verified[key] = bad is None
            if bad is not None:
                self._kernels[key] = None
                self._why[key] = f"the backward kernel failed its check against float64 ({bad})"
                return None
        return got

    def _gradients(self, kern: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, extras: list[torch.Tensor],
                   scalars: list[float], out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
                   kdout: torch.Tensor, learn: list[int]) -> tuple:
        """The kernel's (dQ, dK, dV, [the gradient of extras[i] for i in learn]): the score's share of a learnable
        tensor's gradient is the kernel's (float32), the sink's is added beside it."""
        dq, dk, dv, sites = kern(q, k, v, extras, scalars, out, lse, kdout)
        sink = kernel_sink_gradients(self.p, q, k, v, extras, scalars, out, dout, lse, learn) if learn else []
        learned = []
        for i, g in zip(learn, sink):
            site = sites.get(self.p.extras[i].name)
            learned.append(g if site is None else site.add_(g).to(extras[i].dtype))
        return dq, dk, dv, learned

    def check_cases(self, kern: Any, learn: list[int], dtype: torch.dtype, device: torch.device) -> str | None:
        """The kernel on the redrawn cases of the first call that wanted gradients (ops/backward_trials.py),
        each held to float64 as the call's own inputs are: the forward's O and LSE for them, a random dO. None
        where every case holds (or none was kept); else which failed and how. The cases are drawn once: the
        example is let go after."""
        example = getattr(self._forward, "grad_example", None)
        if example is None:
            return None
        self._forward.grad_example = None
        gen = torch.Generator(device).manual_seed(11)
        for bound, what in backward_trials.cases(self.p, example, dtype, device):
            try:  # the case's operands and forward: not the backward kernel's doing where they fail
                q, k, v, extras, scalars = self._forward.op_operands(bound)
                out, lse = self._forward.op_forward(q, k, v, extras, scalars, want_lse=True)
                dout = torch.randn(out.shape, generator=gen, device=device).to(out.dtype)
                why, kdout = self._rows(q, k, v, extras, scalars, lse, dout)
            except Exception:
                continue
            if why is not None:  # a case the reference serves anyway (rows with no key under a mean-of-V rule)
                continue
            got = self._gradients(kern, q, k, v, extras, scalars, out, lse, dout, kdout, learn)
            bad = self.check(q, k, v, extras, scalars, out, dout, got, learn)
            if bad is not None:
                return f"{bad}, on {what}"
        return None

    def check(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, extras: list[torch.Tensor],
              scalars: list[float], out: torch.Tensor, dout: torch.Tensor, got: tuple,
              learn: list[int] = ()) -> str | None:
        """got (dQ, dK, dV, the gradients of extras[i] for i in `learn`) against the float64 backward of the
        same call, with the O the kernel was handed (its delta = rowsum(dO * O) reads that O, as every
        FlashAttention-style backward does), each row held to ROW_TOL of its own scale (a learnable tensor's
        gradient as one row); where float64 is missed, against the same backward in float32 (see below). None
        where every row holds; else which gradient failed float64 and how."""
        p = self.p
        qc, vc = to_canonical(q, p.q), to_canonical(v, p.v)
        o = canonical_out(p, out, *qc.shape[:3], vc.shape[-1])
        ref64 = reference_backward(p, q, k, v, extras, scalars, dout, None, list(learn), fdt=torch.float64, o=o)
        found = self._judged(got, ref64, learn)
        if all(verdict.ok for _, verdict in found):
            return None
        # As the forward's verification judges (verify/cpu.py judge): the kernel holds scores in float32, where
        # a finite fill such as -1e9 absorbs the score and a row it fills whole is uniform, while float64 still
        # resolves the scores. A kernel that misses float64 is held to the spec's backward in float32 instead,
        # every gradient at the same rule (a wrong tile or a lost mask misses both), where that backward is
        # finite wherever float64's is: the judge leaves NaN elements of a reference unjudged
        if q.dtype != torch.float64:
            ref32 = reference_backward(p, q, k, v, extras, scalars, dout, None, list(learn), fdt=torch.float32, o=o)
            finite = all(bool((torch.isfinite(a) | ~torch.isfinite(b)).all())
                         for a, b in zip([*ref32[:3], *ref32[3]], [*ref64[:3], *ref64[3]]))
            if finite and all(verdict.ok for _, verdict in self._judged(got, ref32, learn)):
                return None
        return next(f"{name} {verdict}" for name, verdict in found if not verdict.ok)

    def _judged(self, got: tuple, ref: tuple, learn: list[int]) -> list[tuple[str, Any]]:
        """(name, row verdict) of each gradient in `got` (dQ, dK, dV, extras[i]'s for i in `learn`) against `ref`."""
        p = self.p
        out = [(name, judge_rows(to_canonical(g, op), to_canonical(r, op), ROW_TOL))
               for name, g, r, op in zip(("dQ", "dK", "dV"), got, ref, (p.q, p.k, p.v))]
        return out + [(f"the gradient of {p.extras[i].name}", judge_rows(g.reshape(1, -1), r.reshape(1, -1), ROW_TOL))
                      for i, g, r in zip(learn, got[3], ref[3])]

    def _warn(self, why: str) -> None:
        if why in self._warned:
            return
        self._warned.add(why)
        from ..callsite import user_stacklevel
        warnings.warn(f"torch_cubridge: {self.name}: the reference backward computes the gradients: {why}",
                      RuntimeWarning, stacklevel=user_stacklevel())


def build_kernel(p: Any, arch: str, dtype: torch.dtype, head_dim: int, value_dim: int,
                 deterministic: bool = False, learnable: tuple[str, ...] = ()) -> Any:
    """The GPU backward of p (ops/backward_gpu.py); tests replace it to stand in for the kernel."""
    return backward_gpu.GpuBackward(p, arch, dtype, head_dim, value_dim=value_dim, deterministic=deterministic,
                                    learnable=learnable)


_RUNNERS: dict[str, BackwardRunner] = {}


def backward_for(kernel_id: str) -> BackwardRunner:
    """The backward runner of a registered kernel (ops/registry.py), made at its first backward."""
    if kernel_id not in _RUNNERS:
        from .registry import runner_for
        _RUNNERS[kernel_id] = BackwardRunner(runner_for(kernel_id))
    return _RUNNERS[kernel_id]
