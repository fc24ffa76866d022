"""CuIR programs: plain frozen dataclasses with a JSON round trip.

A program says everything the kernel needs and nothing about how the spec
was written: where q/k/v/extras come from and in which layout, the score
expression, the mask predicate, how tiles are classified, the normaliser and
the output layout. Scalars stay runtime parameters (kernel arguments).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from typing import Any

from .expr import CANON, ROW_LSE, Expr, call, var  # noqa: F401  (CANON re-exported)


def row_sink(c: Expr, row_scale: Expr | None) -> Expr:
    """The row scale that adds sink logit c (per b, h and q) to the normaliser, after `row_scale`:
    sum e^x V / (sum e^x + e^c) = (sum e^x V / sum e^x) * sigmoid(lse - c)."""
    f = call("sigmoid", call("sub", var(ROW_LSE), c))
    return f if row_scale is None else call("mul", row_scale, f)


@dataclass(frozen=True)
class Operand:
    """q, k or v: which argument, and the spec's dim order in canonical names.

    dims uses "b", "h", "s", "d"; a rank-3 operand has no "b" (batch 1) or no "h" (one head, MQA). A computed operand (RoPE or a
    norm applied in the spec, keys concatenated from several sources) is made by prologue step
    `step`; its arg then reads "prologue:<step>". Its length: argument `length[0]`'s dim `length[1]`
    plus `length[2]` (keys a cache holds plus the new ones), where the prologue's run over symbolic
    sizes shows it is (transfer/lengths.py); `length[3]`: every (argument, dim) that moves with it;
    `length[4]`, where present, multiplies the dim (a block table's width times the page size).
    None holds a computed operand at its shape.
    """
    arg: str
    dims: tuple[str, ...]
    step: str | None = None
    length: tuple | None = None


@dataclass(frozen=True)
class ExtraTensor:
    """A tensor read by index expressions (`load` nodes) in score or mask."""
    name: str
    dtype: str
    rank: int
    arg: str | None = None     # call argument (or "module.attr") read at call time
    value: Any = None          # nested list for a captured constant
    step: str | None = None    # or made by this prologue step


@dataclass(frozen=True)
class Step:
    """One op of the prologue: PyTorch runs it on the call's tensors before the kernel.

    The prologue is the spec's own ops for values that do not depend on q.k (a bias table, a
    cumulative sum of gates, ids from cu_seqlens), so it is correct by construction for any op.
    args are literals and tuples; a tuple whose first item starts with "@" is a tagged value:
    ("@arg", path) a call argument, ("@step", name) an earlier step's result, ("@const", dtype,
    nested values) a captured constant, ("@dtype", d), ("@dtype_of", path) the dtype of a call
    argument (a cast to the inputs' dtype follows them), ("@device",) the call's device,
    ("@layout", l), ("@memory_format", m). kwargs: (name, value) pairs.
    """
    name: str
    op: str                    # "aten.cumsum.default", "getitem" of a tuple result, "tuple"/"list" pack results
    args: tuple = ()
    kwargs: tuple = ()


@dataclass(frozen=True)
class Scalar:
    """A runtime scalar parameter: a kernel argument, never baked into code."""
    name: str
    kind: str                  # "float" or "int"
    value: float | int | None = None   # captured literal
    arg: str | None = None     # or read from a call argument
    expr: Expr | None = None   # or derived from sizes (B, H, Sq, Skv, ...)


@dataclass(frozen=True)
class Output:
    """The spec's output layout; "h*d" is merged heads. index: position in a tuple result (with an
    epilogue: of the item made from the attention output, which the epilogue's last step packs)."""
    dims: tuple[str, ...]
    dtype: str = "q"           # "q" follows the query dtype
    tuple_len: int = 0         # 0: the spec returns a tensor
    index: int = 0
    # the rows' log-sum-exp of the scores, returned too (flash-attention's `lse`): its place in the tuple
    # (-1: not returned), its layout over "b", "h", "s" ("1": a kept unit dim) and its dtype
    lse_index: int = -1
    lse_dims: tuple[str, ...] = ()
    lse_dtype: str = "q"


@dataclass(frozen=True)
class Program:
    signature: tuple[str, ...]          # the spec's parameter names, "*name"/"**name" for varargs
    q: Operand
    k: Operand
    v: Operand
    score: Expr                         # over s, b, h, q, kv, loads, scalars -> logit
    out: Output
    mask: Expr | None = None            # True keeps (q, kv)
    head_map: str = "group"             # kv head = h // (H // Hkv) ("group") or h % Hkv ("tile")
    extras: tuple[ExtraTensor, ...] = ()
    scalars: tuple[Scalar, ...] = ()
    block_rule: str = "none"            # none | interval | prepass
    sink: Expr | None = None            # per-(b, h) sink logit joining the normaliser
    empty_rows: str = "zero"            # zero | mean_v (rows with every key masked)
    requires: tuple[tuple[str, int], ...] = ()   # sizes the program is only valid at (extent-1 broadcasts, specialised shapes)
    guards: tuple[Expr, ...] = ()       # predicates over the call (argument sizes and Python values) it holds under
    notes: tuple[str, ...] = ()
    prologue: tuple[Step, ...] = ()     # ops PyTorch runs before the kernel; extras read their results
    row_scale: Expr | None = None       # over b, h, q (and ROW_LSE): the probabilities scaled (or zeroed) by row
                                        # after the softmax; the same factor on the output, applied by PyTorch after the kernel
    epilogue: tuple[Step, ...] = ()     # ops PyTorch runs on the attention output (in `out`'s layout) after the
                                        # kernel: the spec's own, up to its result (an output projection, a gate)
    batch: tuple[tuple[str, int], ...] = ()  # (argument, dim) of every size that is the batch, where the pro- or
                                        # epilogue's literals are fitted to it ("@size" of "B"): B then moves; ()
                                        # holds B at the call's where a prologue or epilogue names it

    # -- JSON ------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(_to_obj(self), sort_keys=True)

    @staticmethod
    def from_json(text: str) -> "Program":
        return _from_obj(Program, json.loads(text))

    def structure(self) -> "Program":
        """The program without scalar values: equal structures share a kernel."""
        return replace(self, scalars=tuple(replace(s, value=None) for s in self.scalars),
                       extras=tuple(replace(e, value=None) for e in self.extras), notes=())

    # -- behaviour lives in sibling modules; imported lazily to keep this plain data
    def run(self, /, *args: Any, **kwargs: Any):
        """Execute on a call's arguments; a call outside the program's guards is refused."""
        from .guards import GuardSet
        from .interpreter import run_program
        bad = GuardSet(self.guards, self.signature, len(args)).failing(args, kwargs) if self.guards else None
        if bad is not None:
            raise ValueError(f"this program holds only where {bad} (a guard recorded at capture); "
                             "transfer the spec again for this call")
        return run_program(self, *args, **kwargs)

    def validate(self) -> None:
        from .validate import validate
        validate(self)

    def __str__(self) -> str:
        from .printer import format_program
        return format_program(self)


_NESTED = {"q": Operand, "k": Operand, "v": Operand, "out": Output}


def _to_obj(x: Any) -> Any:
    if isinstance(x, Expr):
        return x.to_obj()
    if hasattr(x, "__dataclass_fields__"):
        return {f.name: _to_obj(getattr(x, f.name)) for f in fields(x)}
    if isinstance(x, (tuple, list)):
        return [_to_obj(i) for i in x]
    return x


def _tuple(x: Any) -> Any:
    return tuple(_tuple(i) for i in x) if isinstance(x, list) else x


def _from_obj(cls: type, o: dict) -> Any:
    kw: dict[str, Any] = {}
    for f in fields(cls):
        if f.name not in o:
            continue
        val = o[f.name]
        t = str(f.type)
        if f.name in _NESTED and cls is Program:
            val = _from_obj(_NESTED[f.name], val)
        elif f.name == "extras":
            val = tuple(_from_obj(ExtraTensor, e) for e in val)
        elif f.name == "scalars":
            val = tuple(_from_obj(Scalar, s) for s in val)
        elif f.name in ("prologue", "epilogue"):
            val = tuple(Step(s["name"], s["op"], _tuple(s["args"]), _tuple(s["kwargs"])) for s in val)
        elif f.name == "guards":
            val = tuple(Expr.from_obj(g) for g in val)
        elif "Expr" in t:
            val = None if val is None else Expr.from_obj(val)
        elif f.name in ("requires", "batch"):
            val = tuple((str(a), int(b)) for a, b in val)
        elif f.name == "value":
            val = val
        else:
            val = _tuple(val)
        kw[f.name] = val
    return cls(**kw)
