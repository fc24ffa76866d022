"""The readable text form of a program (what `cubridge explain` prints)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from .prologue import FIXED, length_rule

if TYPE_CHECKING:  # annotations only: Program.run and str() call into this module
    from .program import Program



def format_program(p: Program) -> str:
    lines = [f"cuir.program({', '.join(p.signature)})"]
    for name in ("q", "k", "v"):
        op = getattr(p, name)
        n = ""
        if op.length is not None:
            path, d, off, _, scale = length_rule(op)
            n = f"  length {off} (fixed)" if path == FIXED else f"  length {path}.shape[{d}]" + (
                f" * {scale}" if scale != 1 else "") + (f" {'+' if off >= 0 else '-'} {abs(off)}" if off else "")
        lines.append(f"  {name:<6} = {op.arg}  layout [{', '.join(op.dims)}]{n}")
    lines.append("  heads  : kv_head = " + ("h // (H // Hkv)" if p.head_map == "group" else "h % Hkv"))
    for st in p.prologue:
        lines.append(f"  torch  {st.name} = {st.op}{_args(st)}")
    for e in p.extras:
        src = e.arg if e.arg is not None else (f"prologue {e.step}" if e.step else "captured constant")
        lines.append(f"  tensor {e.name}: {e.dtype} rank {e.rank} <- {src}")
    for s in p.scalars:
        if s.expr is not None:
            src = f"= {s.expr}"
        elif s.arg is not None:
            src = f"<- {s.arg}"
        else:
            src = f"= {s.value!r}"
        lines.append(f"  scalar ${s.name}: {s.kind} {src}")
    lines.append(f"  score  = {p.score}")
    lines.append(f"  mask   = {p.mask if p.mask is not None else 'none'}")
    lines.append(f"  blocks : {p.block_rule}")
    norm = "softmax" if p.sink is None else f"softmax with sink logit {p.sink}"
    lines.append(f"  normal : {norm}; fully masked rows -> {p.empty_rows}")
    if p.row_scale is not None:
        lines.append(f"  rows   : output scaled by {p.row_scale} (PyTorch, after the kernel)")
    o = p.out
    where = f" (element {o.index} of a {o.tuple_len}-tuple)" if o.tuple_len else ""
    lines.append(f"  out    : [{', '.join(o.dims)}] dtype {o.dtype}{where}")
    for st in p.epilogue:  # PyTorch, on the kernel's output (read as __attention__)
        lines.append(f"  after  {st.name} = {st.op}{_args(st)}")
    if p.requires:
        lines.append("  only at : " + ", ".join(f"{k}={v}" for k, v in p.requires))
    if p.guards:
        lines.append("  guards : " + " and ".join(str(g) for g in p.guards))
    for n in p.notes:
        lines.append(f"  note   : {n}")
    return "\n".join(lines)


def _args(st) -> str:
    def show(x) -> str:
        if isinstance(x, tuple) and x and isinstance(x[0], str) and x[0].startswith("@"):
            return {"@arg": lambda: x[1], "@step": lambda: x[1], "@const": lambda: "<constant>",
                    "@device": lambda: "<device>"}.get(x[0], lambda: str(x[-1]))()
        if isinstance(x, tuple):
            return "[" + ", ".join(show(i) for i in x) + "]"
        return repr(x)
    parts = [show(a) for a in st.args] + [f"{k}={show(v)}" for k, v in st.kwargs]
    return "(" + ", ".join(parts) + ")"
