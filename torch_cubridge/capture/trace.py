"""Capture: trace a spec into an aten-level FX graph with fake tensors.

make_fx over fake tensors was chosen over dynamo/export because it sees
through closures, nn.Module arguments and Python scalars without guards, and
because fake tensors make data-dependent Python control flow fail loudly
instead of being baked into the graph.
"""
from __future__ import annotations

import inspect
import logging
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from ..errors import UnsupportedSpec
from .sdpa_math import SdpaAsMath
from .statekeep import modules_kept
from .tracememo import reading_modules


@dataclass
class Captured:
    graph: torch.fx.GraphModule
    signature: tuple[str, ...]        # parameter names ("*args", "**kwargs" for varargs)
    tensor_paths: list[str]           # graph placeholder i reads this argument path
    example: dict[str, Any]           # bound example values by path
    constants: dict[str, torch.Tensor] = field(default_factory=dict)   # get_attr name -> value
    constant_paths: dict[str, str] = field(default_factory=dict)       # get_attr name -> "module.attr"


def signature_of(fn: Callable) -> tuple[str, ...]:
    out = []
    for p in inspect.signature(fn).parameters.values():
        prefix = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}.get(p.kind, "")
        out.append(prefix + p.name)
    return tuple(out)


def bind_example(fn: Callable, args: tuple, kwargs: dict) -> dict[str, Any]:
    """Bound arguments by path, defaults applied."""
    try:
        ba = inspect.signature(fn).bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"{getattr(fn, '__name__', 'spec')}: {e}") from None
    ba.apply_defaults()
    out: dict[str, Any] = {}
    for p in inspect.signature(fn).parameters.values():
        val = ba.arguments.get(p.name)
        if p.kind == inspect.Parameter.VAR_POSITIONAL:
            out.update({f"{p.name}.{i}": v for i, v in enumerate(val or ())})
        elif p.kind == inspect.Parameter.VAR_KEYWORD:
            out.update({f"{p.name}.{k}": v for k, v in (val or {}).items()})
        else:
            out[p.name] = val
    return out


def rebuild_call(fn: Callable, bound: dict[str, Any]) -> tuple[list, dict]:
    args: list = []
    kwargs: dict = {}
    for p in inspect.signature(fn).parameters.values():
        if p.kind == inspect.Parameter.VAR_POSITIONAL:
            i = 0
            while f"{p.name}.{i}" in bound:
                args.append(bound[f"{p.name}.{i}"])
                i += 1
        elif p.kind == inspect.Parameter.VAR_KEYWORD:
            kwargs.update({k.split(".", 1)[1]: v for k, v in bound.items() if k.startswith(p.name + ".")})
        elif p.kind == inspect.Parameter.KEYWORD_ONLY:
            kwargs[p.name] = bound[p.name]
        else:
            args.append(bound[p.name])
    return args, kwargs


def _module_tensors(bound: dict[str, Any]) -> dict[int, str]:
    """data_ptr -> "arg.attr" for tensors hanging off nn.Module arguments."""
    found: dict[int, str] = {}
    for name, obj in bound.items():
        if isinstance(obj, torch.nn.Module):
            for attr, t in list(obj.named_parameters()) + list(obj.named_buffers()):
                found[t.data_ptr()] = f"{name}.{attr}"
    return found


def _nested_tensors(bound: dict[str, Any]) -> dict[int, str]:
    """data_ptr -> "arg[i]" for tensors inside tuple, list or dict arguments (the trace sees no such
    tensor as an input)."""
    found: dict[int, str] = {}

    def visit(x: Any, where: str) -> None:
        if isinstance(x, torch.Tensor):
            if x.numel():
                found.setdefault(x.data_ptr(), where)
        elif isinstance(x, (tuple, list)):
            for i, v in enumerate(x):
                visit(v, f"{where}[{i}]")
        elif isinstance(x, dict):
            for k, v in x.items():
                visit(v, f"{where}[{k!r}]")
    for name, obj in bound.items():
        if isinstance(obj, (tuple, list, dict)):
            visit(obj, name)
    return found


# make_fx is not thread-safe: its patcher of module calls is process state (torch.fx's CURRENT_PATCHER), and
# two first calls tracing at once in two threads failed with "CURRENT_PATCHER is None". Every trace of a spec
# takes this lock; re-entrant, as a spec may reach a compiled function that traces in the same thread.
TRACE_LOCK = threading.RLock()


def spec_over(fn: Callable, bound: dict[str, Any], paths: list[str]) -> Callable[..., Any]:
    """The spec as a function of the tensors at `paths` (the rest of the call bound), SDPA as math."""
    def flat(*tensors: torch.Tensor) -> Any:
        b = dict(bound)
        b.update(zip(paths, tensors))
        args, kwargs = rebuild_call(fn, reading_modules(b))  # module stand-ins while a memoised stage records
        with SdpaAsMath(), modules_kept(bound.values()):
            return fn(*args, **kwargs)
    return flat


class _NoMetaFailureLog(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("failed while attempting to run meta")


@contextmanager
def quiet_meta_failures() -> Iterator[None]:
    """torch's fake tensors log a failing meta kernel at ERROR, with its stack, and raise it as well. A trace
    here that fails (a probe at sizes a spec hardcodes) is a refusal or a held program this package reports
    itself, so those records are dropped while it traces (a filter of this trace's own: traces on other
    threads add theirs)."""
    lg, f = logging.getLogger("torch._subclasses.fake_tensor"), _NoMetaFailureLog()
    lg.addFilter(f)
    try:
        yield
    finally:
        lg.removeFilter(f)


def capture(fn: Callable, bound: dict[str, Any]) -> Captured:
    """Trace fn at the shapes of the bound example arguments."""
    paths = [p for p, v in bound.items() if isinstance(v, torch.Tensor)]
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        # fresh fakes per argument: two arguments holding one tensor must stay two inputs
        fakes = [torch.empty_strided(bound[p].shape, bound[p].stride(), dtype=bound[p].dtype, device=bound[p].device)
                 for p in paths]

    try:
        with TRACE_LOCK, mode, quiet_meta_failures():
            gm = make_fx(spec_over(fn, bound, paths), tracing_mode="real")(*fakes)
            if writes_through_view(gm):  # traced again with the write made a value (slice_scatter, ...)
                gm = make_fx(torch.func.functionalize(spec_over(fn, bound, paths), remove="mutations"),
                             tracing_mode="real")(*fakes)
            if fused_sdpa(gm):  # traced again with SDPA's math backend, which decomposes into plain ops
                # (torch's backend flags are process-wide: another thread's SDPA in this window takes the
                # math backend too, slower, never wrong; only specs whose first trace held a fused op get here)
                from torch.nn.attention import SDPBackend, sdpa_kernel
                with sdpa_kernel([SDPBackend.MATH]), math_sdpa_in_input_dtype():
                    gm = make_fx(torch.func.functionalize(spec_over(fn, bound, paths), remove="mutations"),
                                 tracing_mode="real")(*fakes)
    except UnsupportedSpec:
        raise
    except Exception as e:  # data-dependent control flow and friends surface here
        name = type(e).__name__
        if "DataDependent" in name or "data-dependent" in str(e) or "GuardOnDataDependent" in name:
            raise UnsupportedSpec("data-dependent Python control flow (a tensor value decides a branch or a size)",
                                  op=_last_frame(e)) from None
        raise UnsupportedSpec(f"capture failed: {name}: {str(e).splitlines()[0] if str(e) else ''}",
                              op=_last_frame(e)) from None
    consts = {n.target: getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    nested = _nested_tensors(bound)
    for t in consts.values():
        if isinstance(t, torch.Tensor) and t.data_ptr() in nested:
            # it would be baked into the program: a later call's values would be ignored
            raise UnsupportedSpec(f"the tensor {nested[t.data_ptr()]} sits inside a tuple or list argument, so "
                                  "the trace would bake it in; pass it as an argument of its own", op="capture")
    owners = _module_tensors(bound)
    cpaths = {k: owners[t.data_ptr()] for k, t in consts.items()
              if isinstance(t, torch.Tensor) and t.data_ptr() in owners}
    return Captured(gm, signature_of(fn), paths, bound, consts, cpaths)


@contextmanager
def math_sdpa_in_input_dtype() -> Iterator[None]:
    """SDPA's math backend without its upcast: for bf16 and fp16 inputs it computes in float32 (`_to_copy`
    nodes to float32 and back) unless reduced-precision reductions are allowed. Those casts belong to the
    bf16 trace only: the spec in float64 (verification's reference) has none, and the program replaying them
    mixed float32 with the module's float64 weights (nn.MultiheadAttention's out-projection). The fused
    backends the call would take keep the input dtype too. Process-wide, like the backend flag."""
    flag = getattr(torch.backends.cuda, "allow_fp16_bf16_reduction_math_sdp", None)
    if flag is None:
        yield
        return
    before = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    flag(True)
    try:
        yield
    finally:
        flag(before)


def fused_sdpa(gm: torch.fx.GraphModule) -> bool:
    """Whether an SDPA call reached a backend kernel op the graph analysis cannot read. SdpaAsMath sees the
    spec's own SDPA calls, but a TorchFunctionMode is off while it handles a call, so SDPA called from inside
    another handled function (nn.MultiheadAttention's F.multi_head_attention_forward) goes straight to the
    backend's op (`_scaled_dot_product_flash_attention_for_cpu`, `_scaled_dot_product_cudnn_attention`, ...)."""
    return any(n.op == "call_function" and "scaled_dot_product" in str(n.target) for n in gm.graph.nodes)


def writes_through_view(gm: torch.fx.GraphModule) -> bool:
    """Whether an in-place op writes into a view of another tensor (`mask[:G] = True`, `m[a:b, a:b] = 0`).
    The graph then records the write on the view's node only, and later reads of the base would miss
    it; functionalization turns it into a value (slice_scatter, select_scatter, ...). An in-place op on
    the base itself needs none of that: its node is what later reads refer to."""
    def is_view(n: torch.fx.Node) -> bool:
        t = n.target
        return isinstance(t, torch._ops.OpOverload) and t._schema.returns \
            and t._schema.returns[0].alias_info is not None and not t._schema.returns[0].alias_info.is_write
    for n in gm.graph.nodes:
        t = n.target
        if n.op != "call_function" or not isinstance(t, torch._ops.OpOverload) or not n.args:
            continue
        writes = t._schema.arguments and t._schema.arguments[0].alias_info is not None \
            and t._schema.arguments[0].alias_info.is_write
        if writes and isinstance(n.args[0], torch.fx.Node) and is_view(n.args[0]):
            return True
    return False


def _last_frame(e: BaseException) -> str:
    """The user's line that failed (file:line (fn): code), else the innermost function's name."""
    from .locate import frame_of_exception
    where = frame_of_exception(e)
    if where:
        return where
    tb = e.__traceback__
    last = None
    while tb is not None:
        last = tb
        tb = tb.tb_next
    return f"{last.tb_frame.f_code.co_name}" if last else "capture"


_rebuild_call = rebuild_call  # older name, still imported by verify.reference
