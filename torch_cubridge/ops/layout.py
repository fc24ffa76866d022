"""The kernel argument structs, read from the kernel's own headers (csrc/cubridge/*.cuh).

FwdArgs (variant.cuh), PagedKV (paged.cuh), SegKV (decode_kernel.cuh) and BwdArgs (bwd_config.cuh) are
passed to the kernels by value, every field 8 bytes wide (a field of another such struct is its words,
named through it: BwdArgs' `f.q`), so the host packs each as a flat array of 64-bit words in declaration
order. The declaration is the one source of that layout: the Python runner packs with the `struct.Struct`
derived here, and the C host module fills the C struct rendered here (ops/host_header.py), both by field
name. A field added to a struct that a host does not fill is an error when its packing is made
(`Layout.order`), not a silently shifted word.
"""
from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Callable

from .. import config
from ..lower.source import DECODE_NAME

# the header each struct is declared in; another header of csrc/cubridge is searched where it moved
HOME = {"FwdArgs": "variant.cuh", "PagedKV": "paged.cuh", "SegKV": "decode_kernel.cuh", "BwdArgs": "bwd_config.cuh"}

_TYPES = {"const void*": "ptr", "void*": "ptr", "float*": "ptr", "int*": "ptr", "long long": "i64", "double": "f64"}
_CODE = {"ptr": "Q", "i64": "q", "f64": "d"}
_C = {"ptr": "unsigned long long", "i64": "long long", "f64": "double"}
# few patterns, compiled once: a struct body, a line comment, a constant of the struct, a declared name
_STRUCT = re.compile(r"\bstruct\s+(\w+)\s*\{(.*?)\n\};", re.S)
_COMMENT = re.compile(r"//[^\n]*")
_CONST = re.compile(r"static\s+constexpr\s+int\s+(\w+)\s*=\s*(\d+)\s*;")
_VAR = re.compile(r"\s*(\w+)\s*(?:\[\s*(\w+)\s*\])?\s*")


class LayoutError(ValueError):
    pass


@dataclass(frozen=True)
class Field:
    name: str
    kind: str  # "ptr", "i64" or "f64": 8 bytes each
    count: int = 1  # an array field's length


@dataclass(frozen=True)
class Layout:
    """One struct's fields in declaration order."""
    name: str
    fields: tuple[Field, ...]

    @cached_property
    def words(self) -> tuple[str, ...]:
        """One name per 8-byte word: a field's own, or name[i] for an array's elements."""
        return tuple(f.name if f.count == 1 else f"{f.name}[{i}]" for f in self.fields for i in range(f.count))

    @cached_property
    def format(self) -> struct.Struct:
        return struct.Struct("<" + "".join(f"{f.count if f.count > 1 else ''}{_CODE[f.kind]}" for f in self.fields))

    def offset(self, word: str) -> int:
        return 8 * self.words.index(word)

    def order(self, words: tuple[str, ...]) -> tuple[int, ...] | None:
        """Where each of the struct's words is in `words` (the order a host supplies them in), or None
        where that is the struct's own order; raises where the two name different words."""
        if set(words) != set(self.words) or len(words) != len(self.words):
            raise LayoutError(f"{self.name} holds {self.words}; the host fills {words}")
        at = tuple(words.index(w) for w in self.words)
        return None if at == tuple(range(len(at))) else at

    def packer(self, words: tuple[str, ...]) -> Callable[..., bytes]:
        """A function of the struct's words given in the order of `words` (by name) to the struct's bytes:
        the format's own pack where that is the declaration order (no work per call beyond it)."""
        fmt, at = self.format, self.order(words)
        if at is None:
            return fmt.pack
        return lambda *vals: fmt.pack(*(vals[i] for i in at))

    def c_struct(self) -> str:
        """The struct for C host code: the same words, addresses as unsigned 64-bit integers."""
        body = "".join(f"    {_C[f.kind]} {f.name}{'' if f.count == 1 else f'[{f.count}]'};\n" for f in self.fields)
        return (f"typedef struct {{\n{body}}} {self.name};\n"
                f"_Static_assert(sizeof({self.name}) == {8 * len(self.words)}, \"{self.name}: 8-byte words\");\n")


def parse(text: str, name: str, nested: Callable[[str], Layout] | None = None) -> Layout:
    """The layout of `struct name { ... };` in header text: fields `type a, b;` or `type a[N];` (N a literal
    or a `static constexpr int` of the struct), every type 8 bytes wide; static members are not fields. A
    field whose type is another struct of HOME (`FwdArgs f;`) is that struct's fields named `f.<field>`, its
    layout from `nested`."""
    m = next((m for m in _STRUCT.finditer(text) if m.group(1) == name), None)
    if m is None:
        raise LayoutError(f"no struct {name}")
    body = _COMMENT.sub("", m.group(2))
    consts = {k: int(v) for k, v in _CONST.findall(body)}
    fields = []
    for decl in body.split(";"):
        decl = " ".join(decl.split())
        if not decl or decl.startswith("static "):
            continue
        decl = decl.replace(" *", "*")
        ctype = next((t for t in _TYPES if decl.startswith(t) and not (decl[len(t):len(t) + 1].isalnum()
                                                                     or decl[len(t):len(t) + 1] in "_*")), None)
        if ctype is None:
            inner = decl.split(" ", 1)
            if nested is not None and inner[0] in HOME and len(inner) == 2 and _VAR.fullmatch(inner[1]):
                sub = nested(inner[0])
                fields += [Field(f"{inner[1].strip()}.{f.name}", f.kind, f.count) for f in sub.fields]
                continue
            raise LayoutError(f"{name}: a field the host cannot pack as 8-byte words: {decl}")
        kind = _TYPES[ctype]
        for var in decl[len(ctype):].split(","):
            a = _VAR.fullmatch(var)
            if a is None:
                raise LayoutError(f"{name}: cannot read {var!r}")
            n = a.group(2)
            count = 1 if n is None else int(n) if n.isdigit() else consts.get(n, 0)
            if count < 1:
                raise LayoutError(f"{name}: array length {n!r} is not a literal or a constant of the struct")
            fields.append(Field(a.group(1), kind, count))
    return Layout(name, tuple(fields))


@lru_cache(maxsize=None)
def read(name: str, root: Path | None = None) -> Layout:
    """`name`'s layout from the kernel headers under `root` (config.csrc_dir()/cubridge by default)."""
    root = root or Path(config.csrc_dir()) / "cubridge"
    home = root / HOME[name]
    for f in [home] + sorted(p for p in root.glob("*.cuh") if p != home):
        if f.is_file():
            text = f.read_text()
            if f"struct {name}" in text and any(m.group(1) == name for m in _STRUCT.finditer(text)):
                return parse(text, name, lambda inner: read(inner, root))
    raise LayoutError(f"no header under {root} declares struct {name}")


@dataclass(frozen=True)
class KernelParams:
    """A kernel entry's parameter list (lower/source.py declares the entry): each parameter's name and C type,
    in the order the kernel takes them, one launch block each. The Python runner builds its blocks in this
    order and the C Decoder puts each block where the index rendered here (c_enum) says, both by name."""
    kernel: str  # the entry's name
    tag: str  # the C enum's prefix
    params: tuple[tuple[str, str], ...]  # (name, C type); "KV": the kernel's K/V pages or pieces struct

    @cached_property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.params)

    def order(self, names: tuple[str, ...]) -> tuple[int, ...] | None:
        """Where each parameter is in `names` (the order a host makes the blocks in), or None where that
        is the kernel's own order; raises where the two name different parameters."""
        if sorted(names) != sorted(self.names):
            raise LayoutError(f"{self.kernel} takes {self.names}; the host makes {names}")
        at = tuple(names.index(n) for n in self.names)
        return None if at == tuple(range(len(at))) else at

    def c_enum(self) -> str:
        """Each parameter's launch block index for C host code, as TAG_NAME, and their count as TAG_NPARAMS."""
        body = "".join(f"{self.tag}_{n.upper()} = {i}, " for i, n in enumerate(self.names))
        return (f"/* {self.kernel}'s parameters: each one's launch block */\n"
                f"enum {{ {body}{self.tag}_NPARAMS = {len(self.names)} }};\n")


# The split-KV decode kernel (cubridge_decode): FwdArgs and Params, the splits' fp32 partial O and
# (max, sum) and their counters (ops/splitkv.py Scratch), the keys per split, the PagedKV or SegKV block.
DECODE_PARAMS = KernelParams(DECODE_NAME, "DEC", (("a", "cubridge::FwdArgs"), ("p", "Variant::Params"),
                                                   ("part_o", "float*"), ("part_lse", "float*"), ("counters", "int*"),
                                                   ("chunk", "long long"), ("pg", "KV")))
