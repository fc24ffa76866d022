"""The annotation format of expert kernels.

One annotation per line, in program order, next to the code that does it:

    // @cuir <step> key=value key=value

Steps: tile, load, loop, endloop, hook, skip, mma, softmax, epilogue, store.
`loop axis=...` opens a block closed by `endloop axis=...`. `hook name=...`
marks a site where a variant plugs in; its optional `when=` says on which
tiles it runs. Nothing else in the source is read.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

STEPS = ("tile", "load", "loop", "endloop", "hook", "skip", "mma", "softmax", "epilogue", "store")
_LINE = re.compile(r"//\s*@cuir\s+(\w+)((?:\s+\w+=[\w.]+)*)\s*$")


class AnnotationError(ValueError):
    pass


@dataclass(frozen=True)
class Annotation:
    step: str
    attrs: tuple[tuple[str, str], ...]
    line: int

    def get(self, key: str, default: str | None = None) -> str | None:
        return dict(self.attrs).get(key, default)


def parse_annotations(text: str) -> list[Annotation]:
    out = []
    for n, raw in enumerate(text.splitlines(), 1):
        if "@cuir" not in raw:
            continue
        m = _LINE.search(raw.strip())
        if not m:
            raise AnnotationError(f"line {n}: malformed annotation: {raw.strip()}")
        step = m.group(1)
        if step not in STEPS:
            raise AnnotationError(f"line {n}: unknown step {step!r}")
        attrs = tuple(tuple(kv.split("=", 1)) for kv in m.group(2).split())
        out.append(Annotation(step, attrs, n))
    return out
