"""The launch rules exist once: ops/rules.py in Python, and the same functions rendered to C in the header
the host module is built with (ops/host_header.py). Here the C rendering, compiled with the machine's C
compiler, agrees with the Python over a grid of inputs; an edit of the Python source changes the C (and the
module's name); the kernel structs' layout is read from the headers, and the C struct and the Python format
put every field at the same offset."""
import importlib.util
import random
import shutil
import subprocess
from pathlib import Path

import pytest

from torch_cubridge.build import cgen
from torch_cubridge.ops import host_header, host_module, layout, pack, rules

CC = shutil.which("gcc") or shutil.which("cc")
needs_cc = pytest.mark.skipif(CC is None, reason="no C compiler")

_MAIN = r"""
#include <stdio.h>
#include <stddef.h>
#include "host_rules.h"
static long long rd(void) {
    long long x = 0;
    return scanf("%lld", &x) == 1 ? x : 0;
}
int main(void) {
    char op;
    long long a[16];
    while (scanf(" %c", &op) == 1) {
        if (op == 'A') {
            for (int i = 0; i < 5; i++) a[i] = rd();
            printf("%d\n", rows_aligned(a[0], a + 1) != 0);
        } else if (op == 'S') {
            for (int i = 0; i < 14; i++) a[i] = rd();
            printf("%d\n", shapes_fit(a, a + 4, a + 8, a[12], a[13]) != 0);
        } else if (op == 'P') {
            a[0] = rd();
            a[1] = rd();
            printf("%d\n", pool_fits(a[0], a[1]) != 0);
        } else if (op == 'W') {
            a[0] = rd();
            printf("%lld\n", page_div(a[0]));
        } else if (op == 'D') {
            long long n, per;
            for (int i = 0; i < 5; i++) a[i] = rd();
            decode_split(a[0], a[1], a[2], a[3], a[4], &n, &per);
            printf("%lld %lld\n", n, per);
        }
    }
    return 0;
}
"""


def _build(tmp: Path, header: str, main: str = _MAIN) -> Path:
    (tmp / host_header.NAME).write_text(header)
    (tmp / "main.c").write_text(main)
    exe = tmp / "harness"
    subprocess.run([CC, "-std=c11", "-O1", "-Wall", "-Werror", f"-I{tmp}", str(tmp / "main.c"), "-o", str(exe)],
                   check=True, capture_output=True, text=True)
    return exe


def _grid() -> list[tuple]:
    """(C command, what the Python rule gives) over the inputs each rule meets, and their edges."""
    rng = random.Random(0)
    cases = []
    for ptr in (0, 2, 8, 16, 48, 1 << 40, (1 << 40) + 8):
        for st in ((8, 8, 8, 1), (0, 0, 8, 1), (64, 16, 8, 2), (12, 8, 8, 1), (8, 4, 8, 1), (8, 8, 6, 1), (-8, 0, 8, 1),
                   (1 << 33, 1 << 20, 128, 1)):
            cases.append((("A", ptr, *st), int(rules.rows_aligned(ptr, st))))
    for _ in range(400):
        q = [rng.choice((0, 1, 2, 8)), rng.choice((0, 1, 6, 8, 32)), rng.choice((1, 4)), rng.choice((64, 128))]
        k = [rng.choice((q[0], q[0], 3)), rng.choice((0, 1, 2, 4, 8)), rng.choice((0, 16, 4096)), rng.choice((64, 128))]
        v = [rng.choice((k[0], k[0], 1)), rng.choice((k[1], k[1], 3)), rng.choice((k[2], k[2], 7)), rng.choice((64, 128))]
        hd, vd = rng.choice((64, 128)), rng.choice((64, 128))
        cases.append((("S", *q, *k, *v, hd, vd), int(rules.shapes_fit(tuple(q), tuple(k), tuple(v), hd, vd))))
    for a in (0, 1, 40, 2 ** 31 - 1, 2 ** 31, 2 ** 40):
        for b in (0, 1, 2 ** 31 - 1, 2 ** 31):
            cases.append((("P", a, b), int(rules.pool_fits(a, b))))
    pages = list(range(1, 600)) + [1 << i for i in range(31)] + [(1 << 31) - 1] + \
        [rng.randrange(600, 1 << 31) for _ in range(200)]
    cases += [(("W", p), rules.page_div(p)) for p in pages]
    for ctas in (1, 2, 3, 7, 8, 64, 100, 132, 256, 264, 1000, 5000):
        for n_blk in (1, 2, 3, 5, 16, 63, 64, 65, 313, 512, 4096):
            for sms in (1, 78, 108, 132):
                for per_sm in (1, 2, 3):
                    for mb in (1, 4):
                        cases.append((("D", ctas, n_blk, sms, per_sm, mb), rules.decode_split(ctas, n_blk, sms, per_sm, mb)))
    return cases


def _run(exe: Path, cases: list[tuple]) -> list:
    cmds = "\n".join(" ".join(map(str, c)) for c, _ in cases) + "\n"
    out = subprocess.run([str(exe)], input=cmds, capture_output=True, text=True, check=True).stdout.split("\n")
    return [tuple(map(int, line.split())) if c[0] == "D" else int(line) for (c, _), line in zip(cases, out)]


@needs_cc
def test_the_c_rules_agree_with_the_python_rules(tmp_path):
    cases = _grid()
    got = _run(_build(tmp_path, host_header.text()), cases)
    bad = [(c, want, g) for (c, want), g in zip(cases, got) if want != g]
    assert not bad, bad[:10]
    assert len(cases) > 3000


@needs_cc
def test_an_edit_of_a_rule_changes_the_c_and_the_module(tmp_path, monkeypatch):
    """The header is derived from the rules' source: edit decode_split in a copy of rules.py and the header's
    C follows it (and agrees with the edited Python, not the original), and the host module gets another name."""
    src = Path(rules.__file__).read_text()
    edited = src.replace("n = max(1, min(n_blk, per_sm * sms // ctas))", "n = max(1, min(n_blk, (per_sm * sms + ctas - 1) // ctas))")
    assert edited != src
    (tmp_path / "edited_rules.py").write_text(edited)
    spec = importlib.util.spec_from_file_location("edited_rules", tmp_path / "edited_rules.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    before = host_header.text()
    first = host_module.module_path()
    monkeypatch.setattr(host_header, "rules", mod)
    after = host_header.text()
    assert after != before and "(per_sm * sms) + ctas" in after
    assert host_module.module_path() != first
    cases = [(c, mod.decode_split(*c[1:])) for c, _ in _grid() if c[0] == "D"]
    got = _run(_build(tmp_path, after), cases)
    assert got == [want for _, want in cases]
    assert any(want != rules.decode_split(*c[1:]) for c, want in cases)  # the edit changed the rule


def _offsets_main(lay: layout.Layout) -> str:
    lines = "".join(f'    printf("%zu\\n", offsetof({lay.name}, {w}));\n' for w in lay.words)
    return f'#include <stdio.h>\n#include <stddef.h>\n#include "host_rules.h"\nint main(void) {{\n{lines}    return 0;\n}}\n'


@needs_cc
@pytest.mark.parametrize("name", ["FwdArgs", "PagedKV"])
def test_the_c_struct_and_the_python_format_place_every_word_alike(tmp_path, name):
    lay = layout.read(name)
    exe = _build(tmp_path, host_header.text(), _offsets_main(lay))
    got = [int(x) for x in subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()]
    assert got == [lay.offset(w) for w in lay.words] == list(range(0, lay.format.size, 8))


def test_the_layouts_are_the_headers():
    """FwdArgs: 5 pointers, 12 strides, 5 sizes, a double; PagedKV: 2 table pointers, 11 integers; SegKV's
    arrays as long as its kMax (ir/segments.py MAX_PIECES)."""
    fwd, paged, seg = (layout.read(n) for n in ("FwdArgs", "PagedKV", "SegKV"))
    assert [f.kind for f in fwd.fields] == ["ptr"] * 5 + ["i64"] * 17 + ["f64"]
    assert fwd.words[:6] == ("q", "k", "v", "o", "lse", "q_sb") and fwd.words[-1] == "scale"
    assert [f.kind for f in paged.fields] == ["ptr"] * 2 + ["i64"] * 11 and paged.words[11] == "page_div"
    assert pack.FWD_FORMAT.size == 184 and pack.PAGED_FORMAT.size == 104 and len(pack.NO_PAGES) == 104
    assert pack.SEG_PIECES == 4 and pack.SEG_FORMAT.size == 40 * 8


def test_a_reordered_struct_packs_by_name_and_an_added_field_is_refused():
    text = "struct S {\n  static constexpr bool kX = true;\n  const void* p;  // a pointer\n  long long a, b;\n  double s;\n};"
    lay = layout.parse(text, "S")
    assert lay.words == ("p", "a", "b", "s") and lay.format.format == "<Qqqd"
    swapped = layout.parse(text.replace("long long a, b;", "long long b, a;"), "S")
    by_name = swapped.packer(("p", "a", "b", "s"))
    assert by_name(1, 2, 3, 0.5) == swapped.format.pack(1, 3, 2, 0.5)
    assert lay.packer(("p", "a", "b", "s")) == lay.format.pack  # the declaration order: no work per call
    grown = layout.parse(text.replace("double s;", "double s;\n  long long extra;"), "S")
    with pytest.raises(layout.LayoutError):
        grown.packer(("p", "a", "b", "s"))
    with pytest.raises(layout.LayoutError):
        layout.parse("struct S {\n  int x;\n};", "S")  # 4 bytes: not a word the host packs
    arr = layout.parse("struct T {\n  static constexpr int kMax = 3;\n  const void* k[kMax];\n  long long e[2];\n};", "T")
    assert arr.words == ("k[0]", "k[1]", "k[2]", "e[0]", "e[1]") and arr.format.format == "<3Q2q"


def test_a_layout_is_found_where_its_struct_moved(tmp_path):
    """The kernel headers may be split by role: a struct is looked for in every header of csrc/cubridge."""
    (tmp_path / "args.cuh").write_text("namespace cubridge {\nstruct FwdArgs {\n  const void* q;\n  double scale;\n};\n}\n")
    assert layout.read("FwdArgs", tmp_path).words == ("q", "scale")
    with pytest.raises(layout.LayoutError):
        layout.read("PagedKV", tmp_path)


def test_the_subset_refuses_what_it_cannot_render():
    def floats(x: int) -> int:
        return x / 2  # true division has no C rendering in the subset

    def loops(x: int) -> int:
        for _ in range(x):
            x += 1
        return x

    def untyped(x) -> int:
        return x

    for fn in (floats, loops, untyped):
        with pytest.raises(cgen.CodegenError):
            cgen.render([fn])


def test_the_python_page_word_refuses_empty_pages_and_keeps_the_rule():
    assert pack.page_div_word(48) == rules.page_div(48)
    with pytest.raises(ValueError):
        pack.page_div_word(0)


def test_the_backward_arguments_are_the_header_with_fwdargs_inside():
    """BwdArgs (bwd_config.cuh) begins with a FwdArgs field, read as its words named through it; the backward
    packs the struct by those names, so a field added to the header and not filled is refused."""
    bwd = layout.read("BwdArgs")
    fwd = layout.read("FwdArgs")
    assert bwd.words[:len(fwd.words)] == tuple(f"f.{w}" for w in fwd.words)
    assert bwd.words[len(fwd.words):] == ("dout", "do_sb", "do_sh", "do_ss", "delta", "dq_acc", "dq", "dq_sb", "dq_sh",
                                          "dq_ss", "dk", "dk_sb", "dk_sh", "dk_ss", "dv", "dv_sb", "dv_sh", "dv_ss",
                                          "lse_pad", "sq_pad", "dq_sem", "b0", "hk0", "h0",
                                          "slot_heads", "slot_base")
    assert bwd.format.format == "<" + fwd.format.format[1:] + "Qqqq" + "QQ" + "Qqqq" * 3 + "QqQ" + "q" * 5
    from torch_cubridge.ops import backward_gpu
    words = list(range(len(bwd.words)))
    assert backward_gpu._pack_bwd(*words[:22], 0.5, *words[23:]) == bwd.format.pack(*words[:22], 0.5, *words[23:])
    grown = layout.parse("struct B {\n  FwdArgs f;\n  long long extra;\n};", "B", lambda n: fwd)
    assert grown.words == tuple(f"f.{w}" for w in fwd.words) + ("extra",)
    with pytest.raises(layout.LayoutError):
        layout.parse("struct B {\n  Unknown u;\n};", "B", lambda n: fwd)
