"""Lift: the expert kernel's annotations become its reference CuIR program.

The kernel source is the single source of truth; this module only reads it.
The reference makes the orchestration explicit (query tiles, the key-block
loop, block skipping, online softmax, epilogue) and names the hook sites a
target program fills.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..config import csrc_dir
from .annotations import Annotation, AnnotationError, parse_annotations

KERNEL = "cubridge/fwd_kernel.cuh"
# every expert kernel by the tile kind that selects it (lower/tiles.py); each is lifted on its own
KERNELS = {"sm80": KERNEL, "sm90": "cubridge/fwd_kernel_sm90.cuh", "decode": "cubridge/decode_kernel.cuh"}
# every hook the lowering fills; a kernel without one of these cannot host all programs
REQUIRED_HOOKS = ("block_class", "score", "mask", "sink")


@dataclass(frozen=True)
class Step:
    step: str
    attrs: tuple[tuple[str, str], ...]
    body: tuple["Step", ...] = ()

    def text(self, indent: int = 0) -> list[str]:
        args = " ".join(f"{k}={v}" for k, v in self.attrs)
        head = "  " * indent + f"{self.step} {args}".rstrip()
        if not self.body:
            return [head]
        return [head + " {"] + [t for s in self.body for t in s.text(indent + 1)] + ["  " * indent + "}"]


@dataclass(frozen=True)
class Reference:
    kernel: str
    steps: tuple[Step, ...]

    def hooks(self) -> dict[str, str]:
        """hook name -> the tiles it runs on ("all" unless annotated)."""
        out: dict[str, str] = {}

        def walk(steps: tuple[Step, ...]) -> None:
            for s in steps:
                d = dict(s.attrs)
                if s.step == "hook":
                    out[d["name"]] = d.get("when", "all")
                walk(s.body)
        walk(self.steps)
        return out

    def __str__(self) -> str:
        return "\n".join([f"reference {self.kernel}"] + [t for s in self.steps for t in s.text(1)])


def _nest(anns: list[Annotation]) -> tuple[Step, ...]:
    stack: list[tuple[Annotation, list[Step]]] = []
    top: list[Step] = []
    for a in anns:
        cur = stack[-1][1] if stack else top
        if a.step == "loop":
            stack.append((a, []))
        elif a.step == "endloop":
            if not stack or stack[-1][0].get("axis") != a.get("axis"):
                raise AnnotationError(f"line {a.line}: endloop axis={a.get('axis')} closes no open loop")
            opened, body = stack.pop()
            (stack[-1][1] if stack else top).append(Step("loop", opened.attrs, tuple(body)))
        else:
            cur.append(Step(a.step, a.attrs))
    if stack:
        raise AnnotationError(f"line {stack[-1][0].line}: loop is never closed")
    return tuple(top)


def lift_reference(source: str | None = None, kernel: str = KERNEL) -> Reference:
    text = source if source is not None else (Path(csrc_dir()) / kernel).read_text()
    ref = Reference(kernel, _nest(parse_annotations(text)))
    missing = [h for h in REQUIRED_HOOKS if h not in ref.hooks()]
    if missing:
        raise AnnotationError(f"{kernel}: no hook site for {missing}")
    return ref
